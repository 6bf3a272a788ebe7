"""Reference for prompts in open_clip's timm image towers: timm's own forward, with hooks.

`coop.model.image_timm.TimmImageTower` walks timm's modules with our forward and appends prompts
after the patches, with the identity rotation on RoPE trunks. This reference runs open_clip's
unmodified `TimmModel.forward` (timm's `forward_features` and `forward_head`, open_clip's head) on
a copy of the tower and places the added tokens the way timm places its own prefix tokens:

    at `trunk.norm_pre`'s input:                      x = [prefix; prompts[0]; patches]
    every attention module:                           num_prefix_tokens += M  (RoPE skips them)
    before block i (1 <= i < J):                      x[:, N:N+M] = prompts[i]
    after the final norm (`trunk.norm`'s output):     the M rows dropped, unless pool_prompts
                                                      (`all_tokens`: every row, fc_norm, the heads)

MMRL's inserted tokens take the same places at the input of block `layers[0]` (after norm_pre,
even at block 0) and after, and their rows after the final norm (and fc_norm) are returned. The
two placements differ in the tokens' order only, which attention without a mask does not see; on
RoPE trunks they agree exactly when an appended prompt's rotation is the identity, which is what
the test of this rule checks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn


def timm_vision_features(
    visual: nn.Module,
    images: torch.Tensor,
    prompts: Sequence[torch.Tensor] | None = None,
    inserted: tuple[Sequence[torch.Tensor], Sequence[int]] | None = None,
    pool_prompts: bool = False,
    all_tokens: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Image features (B, E) of open_clip's `TimmModel` with prompts or inserted tokens.

    Args:
        visual: open_clip's timm image tower (`model.visual`); a copy is hooked, not it.
        images: (B, 3, H, W).
        prompts: None or J tensors (M, W) (VPT, IVLP, MaPLe): enter after the positions, replaced
            before blocks 1..J-1.
        inserted: None or (tokens, layers): K tokens (K, W) per listed block (MMRL): enter before
            block layers[0], replaced before the later ones.
        pool_prompts: the pool sees the added tokens too.
        all_tokens: instead of the pooled features, every token after the final norms (norm, then
            fc_norm) through timm's and open_clip's heads, in timm's order: (B, N+M+P, E), the
            added tokens after the N prefix tokens.
    Returns:
        features (B, E) (or every token); with `inserted`, also the K tokens after the final norms
        (B, K, W).
    """
    tower = copy.deepcopy(visual)
    trunk = tower.trunk
    n = int(trunk.num_prefix_tokens)
    if prompts is not None:
        tokens, layers = list(prompts), list(range(len(prompts)))
    elif inserted is not None:
        tokens, layers = list(inserted[0]), list(inserted[1])
    else:
        tokens, layers = [], []
    m = tokens[0].shape[0] if tokens else 0
    final = {}

    def place(x: torch.Tensor, t: torch.Tensor, first: bool) -> torch.Tensor:
        t = t.to(x.dtype).expand(len(x), -1, -1)  # (B, M, W)
        return torch.cat([x[:, :n], t, x[:, n if first else n + m :]], dim=1)

    def enter(i: int):
        def hook(module, args, kwargs):
            x = place(args[0], tokens[layers.index(i)], first=i == layers[0])
            return (x, *args[1:]), kwargs

        return hook

    if prompts is not None:
        # prompts[0]: after the positions, at norm_pre's input (an Identity where the trunk has no
        # pre-norm), which every trunk passes; timm skips pos_drop on trunks without a pos_embed (ViTamin-XL).
        trunk.norm_pre.register_forward_pre_hook(
            lambda module, args: (place(args[0], tokens[0], first=True),)
        )
    for i, block in enumerate(trunk.blocks):
        if i in layers and (i > 0 or prompts is None):  # inserted tokens: at the block's input
            block.register_forward_pre_hook(enter(i), with_kwargs=True)
        if layers and i >= layers[0] and hasattr(block.attn, "num_prefix_tokens"):
            block.attn.num_prefix_tokens += m  # RoPE skips them, as it skips timm's own prefix

    def drop(module, args, out):
        final["x"] = out  # (B, N+M+P, W)
        return out if pool_prompts else torch.cat([out[:, :n], out[:, n + m :]], dim=1)

    trunk.norm.register_forward_hook(drop)
    features = tower(images)
    if all_tokens:  # what timm's forward_head and open_clip's head do to a pooled token, to each one
        features = tower.head(trunk.head(trunk.fc_norm(final["x"])))
    return (features, trunk.fc_norm(final["x"][:, n : n + m])) if inserted is not None else features
