"""Reference DePT computation, as the DePT repository's `trainers/elp_*.py` write it.

The host's similarity logits and its unnormalised text and image features come from the host's
own reference (`coop.reference.coop.coop_text_features`, `deep_text_features`, `vision_features`);
this module adds what `_forward_logits_linear_probe` and `_loss` compute on top of them, with the
FiLM modules and the linear head written out as plain tensor algebra.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def film(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """FiLM: `scale.unsqueeze(0) * x + bias.unsqueeze(0)`."""
    return scale.unsqueeze(0) * x + bias.unsqueeze(0)


def dept_loss(
    sim: torch.Tensor,
    text: torch.Tensor,
    image: torch.Tensor,
    labels: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    weight: float,
    extra: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """(1 - w) CE(sim, y) + w CE(head(cat(FiLM_t(text[y]), FiLM_i(image))), cat(y, y)) + extra.

    Args:
        sim: (B, C) the host's logits.
        text: (C, E) unnormalised class text features (the host's, with grad).
        image: (B, E) unnormalised image features.
        tensors: DePT's tensors by checkpoint name (`dept.film_text.scale`, ..., `dept.head.bias`).
        extra: the host's own loss terms (KgCoOp's `W * (1 - mean cos)`).
    """
    t = film(text[labels], tensors["dept.film_text.scale"], tensors["dept.film_text.bias"])
    i = film(image, tensors["dept.film_image.scale"], tensors["dept.film_image.bias"])
    logits = F.linear(torch.cat([t, i]), tensors["dept.head.weight"], tensors["dept.head.bias"])
    lp = F.cross_entropy(logits, torch.cat([labels, labels]))
    return (1 - weight) * F.cross_entropy(sim, labels) + weight * lp + extra


def dept_test_logits(sim: torch.Tensor, image: torch.Tensor, tensors: dict[str, torch.Tensor], weight: float):
    """Test-time fusion on the training classes: (1 - w) sim + w head(FiLM_i(image))."""
    i = film(image, tensors["dept.film_image.scale"], tensors["dept.film_image.bias"])
    return (1 - weight) * sim + weight * F.linear(i, tensors["dept.head.weight"], tensors["dept.head.bias"])
