"""Reference Tip-Adapter and Tip-Adapter-F computations on OpenCLIP's own modules.

Step by step as the original's utils.py and main.py compute them: the zero-shot classifier one class
at a time (`clip_classifier`), the cache from the image tower's raw output on each augmented view
(`build_cache_model`), the learnable keys as an `nn.Linear` whose weight is the keys
(`run_tip_adapter_F`), and the logits `100 f W + alpha exp(-(beta - beta f K)) L`. Ground truth
for tests/test_tip_adapter.py; slow on purpose (no caching, no batching of classes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coop.model.tokenizer import clip_bpe


@torch.no_grad()
def clip_classifier(openclip_model: nn.Module, classnames: list[str], templates: list[str]) -> torch.Tensor:
    """W_zs as (E, C): per class, every template's text feature normalised, averaged, renormalised."""
    tokenizer = clip_bpe(openclip_model.context_length)
    weights = []
    for name in classnames:
        texts = [t.format(name.replace("_", " ")) for t in templates]
        emb = openclip_model.encode_text(tokenizer(texts))  # (T, E)
        emb = emb / emb.norm(dim=-1, keepdim=True)
        mean = emb.mean(dim=0)
        weights.append(mean / mean.norm())
    return torch.stack(weights, dim=1)  # (E, C)


@torch.no_grad()
def build_cache(openclip_model: nn.Module, views: list[torch.Tensor], labels: torch.Tensor, n_cls: int):
    """(keys (E, NK), values (NK, C)): each view's raw image features, averaged over the views,
    normalised; values one-hot. `views` holds one (N, 3, H, W) batch per augmentation pass."""
    feats = torch.stack([openclip_model.encode_image(images) for images in views])  # (V, N, E)
    keys = feats.mean(dim=0)
    keys = keys / keys.norm(dim=-1, keepdim=True)
    return keys.permute(1, 0), F.one_hot(labels, n_cls).float()


def adapter_from_keys(keys: torch.Tensor) -> nn.Linear:
    """Tip-Adapter-F's learnable keys: Linear(NK <- E) whose weight (NK, E) starts at keys^T."""
    adapter = nn.Linear(keys.shape[0], keys.shape[1], bias=False)
    adapter.weight = nn.Parameter(keys.t().clone())
    return adapter


def tip_logits(
    openclip_model: nn.Module,
    images: torch.Tensor,
    clip_weights: torch.Tensor,
    keys: torch.Tensor | nn.Linear,
    values: torch.Tensor,
    alpha: float,
    beta: float,
) -> torch.Tensor:
    """Logits (B, C) of `images`: keys (E, NK) for Tip-Adapter, the adapter for Tip-Adapter-F."""
    with torch.no_grad():
        f = openclip_model.encode_image(images)
        f = f / f.norm(dim=-1, keepdim=True)  # (B, E)
    affinity = keys(f) if isinstance(keys, nn.Linear) else f @ keys  # (B, NK)
    cache_logits = ((-1) * (beta - beta * affinity)).exp() @ values
    clip_logits = 100.0 * f @ clip_weights
    return clip_logits + cache_logits * alpha


def tip_adapter_f_loss(openclip_model, images, labels, clip_weights, adapter, values, alpha, beta):
    """One Tip-Adapter-F training step's loss: cross-entropy of `tip_logits` through the adapter."""
    return F.cross_entropy(
        tip_logits(openclip_model, images, clip_weights, adapter, values, alpha, beta), labels
    )
