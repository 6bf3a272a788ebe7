"""Reference VPT, IVLP and MaPLe computations on OpenCLIP's own modules.

The vision prompts concatenated onto the sequence of open_clip's own `VisionTransformer` modules,
as the MaPLe repository's `VisionTransformer_MaPLe` and `ResidualAttentionBlock_IVLP` do
(`coop.reference.vision`); on open_clip's timm towers, timm's own forward with the prompts as
extra prefix tokens (`coop.reference.timm_vit`). The text side is `coop.reference.coop`'s
full-length `deep_text_features`.
"""

from __future__ import annotations

import torch
from torch import nn

from coop.reference.coop import deep_text_features
from coop.reference.vision import vision_features


def _clip_logits(openclip_model: nn.Module, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """logit_scale.exp() * normalised image @ normalised text.T, as the original code writes it."""
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    return openclip_model.logit_scale.exp() * image @ text.t()


def vpt_logits(
    openclip_model: nn.Module,
    images: torch.Tensor,
    text_ids: torch.Tensor | None,
    vision_prompts,
    text_features: torch.Tensor | None = None,
) -> torch.Tensor:
    """VPT: frozen text features of `text_ids` (open_clip's `encode_text`), prompted image tower.

    Args:
        images: (B, 3, H, W).
        text_ids: (n_cls, 77) ids of "a photo of a {class}.".
        vision_prompts: J tensors (M, W_vision).
        text_features: (n_cls, E) features computed once beforehand, as the original does at
            build time; then `text_ids` is not used.
    Returns:
        (B, n_cls) logits.
    """
    if text_features is None:
        with torch.no_grad():
            text_features = openclip_model.encode_text(text_ids)
    image = vision_features(openclip_model.visual, images, vision_prompts)
    return _clip_logits(openclip_model, image, text_features)


def ivlp_logits(
    openclip_model: nn.Module,
    images: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    text_ctx: torch.Tensor,
    deep_text: torch.Tensor | None,
    vision_prompts,
) -> torch.Tensor:
    """IVLP: independent deep text prompts (`deep_text_features`) and deep vision prompts.

    Args:
        ids, slots, text_ctx, deep_text: as in `deep_text_features` (`reference_inputs` gives
            ids and slots for a `PromptLearner`).
        vision_prompts: J_v tensors (M_v, W_vision).
    Returns:
        (B, n_cls) logits.
    """
    text = deep_text_features(openclip_model, ids, slots, text_ctx, deep_text)
    image = vision_features(openclip_model.visual, images, vision_prompts)
    return _clip_logits(openclip_model, image, text)


def maple_logits(
    openclip_model: nn.Module,
    images: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    text_ctx: torch.Tensor,
    deep_text: torch.Tensor | None,
    projections,
) -> torch.Tensor:
    """MaPLe: the vision prompt of layer i is projections[i] of the text prompt of layer i.

    As the MaPLe repository's `MultiModalPromptLearner`: layer 0's vision tokens are `proj(ctx)`,
    layer i's are `compound_prompt_projections[i-1](compound_prompts_text[i-1])`, so vision
    gradients flow into the text prompts.

    Args:
        ids, slots: as in `deep_text_features`.
        text_ctx: (M, W_text) shared input-layer context (`prompt_learner.ctx`).
        deep_text: (J-1, M, W_text) deep text prompts (`compound_prompts_text`), or None for J = 1.
        projections: J modules W_text -> W_vision: `proj`, then `compound_prompt_projections`.
    Returns:
        (B, n_cls) logits.
    """
    if text_ctx.dim() != 2:
        raise ValueError(
            f"MaPLe couples one shared context (M, W) to the image tower; got {tuple(text_ctx.shape)}"
        )
    layers = [text_ctx] + ([] if deep_text is None else list(deep_text))
    vision_prompts = [project(t) for project, t in zip(projections, layers, strict=True)]
    return ivlp_logits(openclip_model, images, ids, slots, text_ctx, deep_text, vision_prompts)
