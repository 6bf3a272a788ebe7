"""Reference image features with vision prompts, on open_clip's own image modules.

`vision_features` writes out the MaPLe repository's vision tower over open_clip's ViT (and hands
open_clip's timm towers to `coop.reference.timm_vit`); `vit_embeddings` is its input stage.
"""

from __future__ import annotations

import torch
from open_clip.timm_model import TimmModel
from torch import nn

from coop.reference.timm_vit import timm_vision_features


def vit_embeddings(visual: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The input of open_clip's ViT `visual` before ln_pre, written out: patches, the class token
    prepended, the positional embedding added. (B, 3, H, W) -> (B, 1+P, W)."""
    x = visual.conv1(images)  # (B, W, gh, gw)
    b, width = x.shape[:2]
    x = x.reshape(b, width, -1).permute(0, 2, 1)  # (B, W, P) -> (B, P, W)
    cls = visual.class_embedding.to(x.dtype) + torch.zeros(b, 1, width, dtype=x.dtype, device=x.device)
    return torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)  # (B, 1+P, W)


def vision_features(visual: nn.Module, images: torch.Tensor, prompts=None) -> torch.Tensor:
    """Image features (B, E) of open_clip's `VisionTransformer`, vision prompts written out.

    As the MaPLe repository's vision tower: patches, class token prepended, positional embedding
    added; then prompts[0] appended at the end (no positional embedding) and ln_pre over the whole
    sequence; before block i (1 <= i < J) the last M hidden states are cut off and prompts[i]
    concatenated in their place; the prompts' outputs dropped, then open_clip's own pooling
    (`_pool`: ln_post of the class token; CLIPA's average of the patches with ln_post after it;
    CoCa's attention pool) times proj. A timm tower (`TimmModel`: SigLIP, EVA, PE-Core) goes to
    `coop.reference.timm_vit.timm_vision_features`, timm's own forward with the prompts placed by hooks.

    Args:
        visual: open_clip's image tower (`model.visual`), a ViT or a timm ViT/EVA trunk.
        images: (B, 3, H, W).
        prompts: None or J tensors (M, W), shared by all images.
    """
    if isinstance(visual, TimmModel):
        return timm_vision_features(visual, images, prompts)
    x = vit_embeddings(visual, images)  # (B, 1+P, W)
    b = x.shape[0]
    prompts = [] if prompts is None else list(prompts)
    if prompts:
        x = torch.cat([x, prompts[0].to(x.dtype).expand(b, -1, -1)], dim=1)  # (B, 1+P+M, W)
    x = visual.ln_pre(x)
    for i, block in enumerate(visual.transformer.resblocks):
        if 1 <= i < len(prompts):
            kept = x[:, : x.shape[1] - len(prompts[i])]  # drop the previous layer's M prompt outputs
            x = torch.cat([kept, prompts[i].to(x.dtype).expand(b, -1, -1)], dim=1)
        if visual.transformer.batch_first:
            x = block(x)
        else:
            x = block(x.transpose(0, 1)).transpose(0, 1)  # (B, L, W) <-> (L, B, W)
    if prompts:
        x = x[:, : x.shape[1] - len(prompts[-1])]  # the pool reads the tower's own tokens
    pooled, _ = visual._pool(x)
    return pooled @ visual.proj
