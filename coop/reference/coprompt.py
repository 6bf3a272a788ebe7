"""Reference CoPrompt training loss on OpenCLIP's own modules, as its `trainers/coprompt.py` writes it.

MaPLe's prompted towers (`coop.reference.coop.deep_text_features` on full 77-token prompts,
`coop.reference.vision.vision_features` with the projected prompts), the two adapters written out
from their weights, the description embeddings of `gpt_clip_classifier` stacked (S, n_cls, E), one
of them picked by index, and the frozen model's `encode_image` of the second view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coop.reference.coop import deep_text_features, sentence_embeddings
from coop.reference.vision import vision_features


def gpt_clip_classifier(openclip_model: nn.Module, sentences_per_class: list[list[str]]) -> torch.Tensor:
    """Every class's sentences through open_clip's `encode_text` (77 tokens), each normalised,
    stacked on dim 1: (S, n_cls, E), as the original's `clip_weights` (the same S for every class)."""
    return torch.stack(sentence_embeddings(openclip_model, sentences_per_class), dim=1)


def adapter(x: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The original's `Adapter.fc`: ReLU(ReLU(x @ down.T) @ up.T), both Linear layers without bias."""
    return torch.relu(torch.relu(x @ down.t()) @ up.t())


def coprompt_loss(
    openclip_model: nn.Module,
    image1: torch.Tensor,
    image2: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    ctx: torch.Tensor,
    deep_text: torch.Tensor | None,
    projections,
    tensors: dict[str, torch.Tensor],
    ori_embedding: torch.Tensor,
    index: int,
    weight: float,
    image_ratio: float = 0.1,
    text_ratio: float = 0.2,
    distill: str = "cosine",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`CustomCLIP.forward(image1, image2, label)` in training: (loss, logits).

    Args:
        image1, image2: (B, 3, H, W) the two augmented views.
        ids, slots, ctx, deep_text: as in `deep_text_features`.
        projections: J modules W_text -> W_vision: `proj`, then `compound_prompt_projections`.
        tensors: the adapters' weights by their official names (`adapter_image.fc.0.weight`, ...).
        ori_embedding: `gpt_clip_classifier` (S, n_cls, E); index: the step's `random.randint` draw.
        weight: TRAINER.W.
    """
    oc = openclip_model
    text = deep_text_features(oc, ids, slots, ctx, deep_text)
    layers = [ctx] + ([] if deep_text is None else list(deep_text))
    prompts = [project(t) for project, t in zip(projections, layers, strict=True)]
    image = vision_features(oc.visual, image1, prompts)

    x_a = adapter(image, tensors["adapter_image.fc.0.weight"], tensors["adapter_image.fc.2.weight"])
    image = image_ratio * x_a + (1 - image_ratio) * image
    x_b = adapter(text, tensors["adapter_text.fc.0.weight"], tensors["adapter_text.fc.2.weight"])
    text = text_ratio * x_b + (1 - text_ratio) * text
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    logits = oc.logit_scale.exp() * image @ text.t()

    pre_text = ori_embedding[index]
    with torch.no_grad():
        pre_image = oc.encode_image(image2)
    pre_text = pre_text / pre_text.norm(dim=-1, keepdim=True)
    pre_image = pre_image / pre_image.norm(dim=-1, keepdim=True)
    loss = F.cross_entropy(logits, labels)
    if distill == "cosine":
        cos = nn.CosineSimilarity(dim=1, eps=1e-07)
        distilled = (1.0 - torch.mean(cos(text, pre_text))) + (1.0 - torch.mean(cos(image, pre_image)))
    else:
        distilled = F.mse_loss(text, pre_text) + F.mse_loss(image, pre_image)
    return loss + weight * distilled, logits
