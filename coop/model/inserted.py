"""Tokens inserted into a Transformer's sequence after its first token: MMRL's representation tokens.

Both towers (`coop.model.text_encoder`, `coop.model.image_encoder`) take them the same way: K tokens enter
after [SOS] / [CLS] at the input of one block, without positional embedding, so the sequence grows
by K (77 -> 77+K, 197 -> 197+K); at the input of each later listed block the K hidden states at
positions 1..K are replaced by that block's tokens; the other blocks carry them on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InsertedTokens:
    """K tokens that enter a sequence after its first token ([SOS] or [CLS]) at the input of block
    `layers[0]` and replace those K hidden states at the input of each later block in `layers`;
    no positional embedding is added to them (MMRL's representation tokens, both towers).

    Attributes:
        tokens: one (K, W) tensor per listed block, the same for every sequence.
        layers: 0-based block indices, increasing.
    """

    tokens: Sequence[torch.Tensor]
    layers: Sequence[int]

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, L, W) at the input of block i, with the tokens inserted (B, L+K, W)
        at the first listed block, written over positions 1..K at a later one, else unchanged."""
        if i not in self.layers:
            return x
        j = list(self.layers).index(i)
        tokens = self.tokens[j].to(x.dtype).expand(len(x), -1, -1)  # (B, K, W)
        rest = x[:, 1:] if j == 0 else x[:, 1 + tokens.shape[1] :]
        return torch.cat([x[:, :1], tokens, rest], dim=1)
