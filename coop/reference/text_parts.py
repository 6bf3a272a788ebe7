"""Where the references find open_clip's text tower and the token it pools, for any family.

An `open_clip.CLIP` (CLIP's family, EVA, PE-Core, MetaCLIP 2) holds its text modules itself
(`transformer`, `token_embedding`, `attn_mask`, `text_pool_type`, `text_eos_id`); a
`CustomTextCLIP` (SigLIP, CLIPA, MobileCLIP-S) holds them in `text`, an open_clip `TextTransformer`
(`pool_type`, `eos_id`; `attn_mask` None without the causal mask). The pooled position is the one
open_clip's `text_global_pool` reads: the highest id (argmax), the first `eos_id` (eos), the
last or the first position.
"""

from __future__ import annotations

import torch
from torch import nn


def text_parts(openclip_model: nn.Module) -> nn.Module:
    """The module that holds the text tower's parts (`token_embedding`, `positional_embedding`,
    `transformer`, `attn_mask`, `ln_final`, `text_projection`)."""
    return getattr(openclip_model, "text", openclip_model)


def pool_index(openclip_model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(N,) the position of ids (N, L) whose hidden state open_clip's text tower pools."""
    t = text_parts(openclip_model)
    pool = getattr(t, "pool_type", getattr(openclip_model, "text_pool_type", "argmax"))
    if pool == "argmax":
        return ids.argmax(dim=-1)
    if pool == "eos":
        eos_id = getattr(t, "eos_id", getattr(openclip_model, "text_eos_id", None))
        return (ids == eos_id).int().argmax(dim=-1)
    at = ids.shape[1] - 1 if pool == "last" else 0
    return torch.full((len(ids),), at, dtype=torch.long, device=ids.device)


def pooled_features(openclip_model: nn.Module, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """ln_final of the last block's output x (N, L, W), each row's hidden state at `index` (N,),
    through the text projection (a matrix, a linear layer, or none): (N, E)."""
    t = text_parts(openclip_model)
    pooled = t.ln_final(x)[torch.arange(len(x), device=x.device), index]  # (N, W)
    proj = t.text_projection
    if proj is None:
        return pooled
    return proj(pooled) if isinstance(proj, nn.Linear) else pooled @ proj
