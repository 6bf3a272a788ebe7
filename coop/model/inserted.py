"""Tokens inserted into a Transformer's sequence after its leading token: MMRL's representation tokens.

Both towers (`coop.model.text_encoder`, `coop.model.image_encoder`) take them the same way: K tokens enter
after [SOS] / [CLS] at the input of one block, without positional embedding, so the sequence grows
by K (77 -> 77+K, 197 -> 197+K); at the input of each later listed block the K hidden states at
positions 1..K are replaced by that block's tokens; the other blocks carry them on. A text
tokenizer without a start token (SigLIP's, MetaCLIP 2's) has no leading token: the tokens enter at
position 0, before the first text token (`after=0`), and occupy positions 0..K-1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InsertedTokens:
    """K tokens that enter a sequence after its first `after` tokens ([SOS] or [CLS]; none for a
    tokenizer without a start token) at the input of block `layers[0]` and replace those K hidden
    states at the input of each later block in `layers`; no positional embedding is added to them
    (MMRL's representation tokens, both towers).

    Attributes:
        tokens: one (K, W) tensor per listed block, the same for every sequence.
        layers: 0-based block indices, increasing.
        after: how many leading tokens stay before them: 1 ([SOS], [CLS]) or 0.
    """

    tokens: Sequence[torch.Tensor]
    layers: Sequence[int]
    after: int = 1

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, L, W) at the input of block i, with the tokens inserted (B, L+K, W)
        at the first listed block, written over positions after..after+K-1 at a later one, else
        unchanged."""
        if i not in self.layers:
            return x
        j = list(self.layers).index(i)
        tokens = self.tokens[j].to(x.dtype).expand(len(x), -1, -1)  # (B, K, W)
        a = self.after
        rest = x[:, a:] if j == 0 else x[:, a + tokens.shape[1] :]
        return torch.cat([x[:, :a], tokens, rest], dim=1)

    def shift(self, positions: torch.Tensor) -> torch.Tensor:
        """Where tokens at `positions` (any shape) of the sequence before the insertion sit after
        it: K places further from `after` on, unchanged before."""
        k = self.tokens[0].shape[0]
        return positions + k * (positions >= self.after).to(positions.dtype)
