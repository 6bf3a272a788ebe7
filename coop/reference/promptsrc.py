"""Reference PromptSRC loss on OpenCLIP's own modules, as its `trainers/promptsrc.py` computes it.

IVLP's logits (`coop.reference.coop.deep_text_features`, `coop.reference.vision.vision_features`),
the frozen image tower and the frozen template features of its `VLPromptLearner`.
"""

from __future__ import annotations

import torch
from torch import nn

from coop.model.tokenizer import clip_bpe
from coop.reference.coop import deep_text_features
from coop.reference.vision import vision_features


def promptsrc_fixed_embeddings(openclip_model: nn.Module, classnames: list[str], templates) -> torch.Tensor:
    """PromptSRC's frozen text targets as its `VLPromptLearner` builds them: every template's
    prompts through open_clip's `encode_text` (full 77 tokens), stacked, averaged over templates,
    UNnormalised (the forward pass normalises them). (n_cls, E)."""
    tokenizer = clip_bpe(openclip_model.context_length)
    names = [c.replace("_", " ") for c in classnames]
    device = openclip_model.logit_scale.device
    with torch.no_grad():
        per_template = [
            openclip_model.encode_text(tokenizer([t.replace("{}", c) for c in names]).to(device)).unsqueeze(1)
            for t in templates
        ]  # each (n_cls, 1, E)
    return torch.cat(per_template, dim=1).mean(dim=1)


def promptsrc_loss(
    openclip_model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    text_ctx: torch.Tensor,
    deep_text: torch.Tensor | None,
    vision_prompts,
    fixed_embeddings: torch.Tensor,
    text_weight: float = 25.0,
    image_weight: float = 10.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One PromptSRC training loss the way `trainers/promptsrc.py` computes it (its fp32 branch).

    IVLP's logits (`deep_text_features` on full 77-token prompts, `vision_features`), the frozen
    image tower (open_clip's `encode_image`) on the same images every step, and

        loss = CE + (KL(log_softmax(logits), log_softmax(zs_logits), sum, log_target) / numel
                     + text_weight * L1(text, fixed) + image_weight * L1(image, zs_image))

    Args:
        ids, slots, text_ctx, deep_text, vision_prompts: as in `ivlp_logits`.
        fixed_embeddings: `promptsrc_fixed_embeddings` (n_cls, E), computed once.
    Returns:
        (loss, {"ce", "text", "image", "kl"} unweighted terms).
    """
    oc = openclip_model
    text = deep_text_features(oc, ids, slots, text_ctx, deep_text)
    image = vision_features(oc.visual, images, vision_prompts)
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    logit_scale = oc.logit_scale.exp()
    logits = logit_scale * image @ text.t()
    fixed = fixed_embeddings / fixed_embeddings.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        zs_image = oc.encode_image(images)
        zs_image = zs_image / zs_image.norm(dim=-1, keepdim=True)
        zs_logits = logit_scale * zs_image @ fixed.t()
    terms = {
        "ce": nn.functional.cross_entropy(logits, labels),
        "text": nn.functional.l1_loss(text, fixed, reduction="mean"),
        "image": nn.functional.l1_loss(image, zs_image, reduction="mean"),
        "kl": nn.functional.kl_div(
            nn.functional.log_softmax(logits, dim=1),
            nn.functional.log_softmax(zs_logits, dim=1),
            reduction="sum",
            log_target=True,
        )
        / logits.numel(),
    }
    scl = terms["kl"] + terms["text"] * text_weight + terms["image"] * image_weight
    return terms["ce"] + scl, terms
