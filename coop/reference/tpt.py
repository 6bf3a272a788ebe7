"""Reference TPT and C-TPT: one test image at a time, as TPT's `test_time_tuning` runs it.

Per image: the tuned tensors reset to their starting values and a fresh AdamW (TPT reloads the
optimizer's initial state), then `steps` times: the forward over every view (all classes' full
77-token prompts through open_clip's own text modules, `coop.reference.coop`), the confident views
selected on the first step, TPT's `avg_entropy` (minus C-TPT's lambda times the text features'
dispersion), `loss.backward()`, `optimizer.step()`; finally the forward on the image itself
without a graph. Slow on purpose: ground truth for tests/test_tpt.py and the baseline of
tools/bench/bench_tta.py.

`forward(tensors, x)` is the host's, returning (logits (V, n_cls), text features (n_cls, E)):
`prompt_forward` for prompts over image features (zero-shot with TPT's own prompt, CoOp, CoCoOp's
generated context, `cocoop_start`), `maple_forward` for MaPLe's prompted towers over pixels.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from coop.reference.coop import coop_text_features, deep_text_features
from coop.reference.vision import vision_features


def clip_logits(openclip_model: nn.Module, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """logit_scale.exp() * image / |image| @ (text / |text|).T, as TPT's `inference` writes it."""
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    return openclip_model.logit_scale.exp() * image @ text.t()


def select_confident_samples(logits: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TPT's selection: the int(V * top) rows of lowest entropy (here at least one, ties in index
    order: TPT's `argsort` leaves them in any order, and keeps none of fewer than 10 views)."""
    batch_entropy = -(logits.softmax(1) * logits.log_softmax(1)).sum(1)
    idx = torch.sort(batch_entropy, descending=False, stable=True).indices[: max(1, int(len(logits) * top))]
    return logits[idx], idx


def avg_entropy(outputs: torch.Tensor) -> torch.Tensor:
    """TPT's `avg_entropy`, line by line."""
    logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
    avg_logits = logits.logsumexp(dim=0) - np.log(logits.shape[0])
    min_real = torch.finfo(avg_logits.dtype).min
    avg_logits = torch.clamp(avg_logits, min=min_real)
    return -(avg_logits * torch.exp(avg_logits)).sum(dim=-1)


def l2_norm_mean(text_features: torch.Tensor) -> torch.Tensor:
    """C-TPT's `l2_norm_mean_training` of the normalised text features (n_cls, E)."""
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    prompt_mean = text_features.mean(0)
    feature_distance = text_features - prompt_mean
    return torch.linalg.norm(feature_distance, dim=-1).mean()


def tpt_image(
    forward,
    start: dict[str, torch.Tensor],
    x: torch.Tensor,
    selection: float = 0.1,
    lr: float = 5e-3,
    steps: int = 1,
    weight_decay: float = 0.01,
    lambda_term: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One test image: (logits (n_cls,) of x[0] after tuning, the tuned tensors by name).

    Args:
        forward: (tensors by name, x) -> (logits (V, n_cls), text features (n_cls, E)).
        start: the starting values of the tuned tensors, by name.
        x: the views' image features (V, E) or pixels (V, 3, H, W), x[0] the image itself.
        lambda_term: C-TPT's lambda (0: TPT).
    """
    tensors = {k: v.detach().clone().requires_grad_(True) for k, v in start.items()}  # model.reset()
    optimizer = torch.optim.AdamW(list(tensors.values()), lr, weight_decay=weight_decay)  # fresh state
    selected_idx = None
    for _ in range(steps):
        output, text = forward(tensors, x)
        if selected_idx is not None:
            output = output[selected_idx]
        else:
            output, selected_idx = select_confident_samples(output, selection)
        loss = avg_entropy(output)
        if lambda_term:
            loss = loss + (-lambda_term * l2_norm_mean(text))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        output, _ = forward(tensors, x[:1])
    return output[0], {k: v.detach() for k, v in tensors.items()}


def prompt_forward(openclip_model: nn.Module, learner, inputs):
    """The forward of a prompt over frozen image features: tensors "ctx" (and "deep_ctx") in
    `learner`'s layout, x the views' image features (V, E); `inputs` from `reference_inputs`."""

    def forward(tensors: dict[str, torch.Tensor], features: torch.Tensor):
        text = coop_text_features(
            openclip_model, learner, inputs, ctx=tensors["ctx"], deep=tensors.get("deep_ctx")
        )
        return clip_logits(openclip_model, features, text), text

    return forward


def cocoop_start(learner, meta_net: nn.Module, features: torch.Tensor) -> dict[str, torch.Tensor]:
    """TPT's `gen_ctx` on CoCoOp: ctx + meta_net(image feature of the image itself), here of the
    normalised feature as CoCoOp computes it (TPT passes the unnormalised one)."""
    with torch.no_grad():
        image = features[:1] / features[:1].norm(dim=-1, keepdim=True)
        return {"ctx": learner.ctx + meta_net(image)[0]}


def maple_forward(openclip_model: nn.Module, ids: torch.Tensor, slots: torch.Tensor, depth: int):
    """MaPLe's forward over pixels with the tuned tensors "ctx", "deep_ctx", "proj.weight",
    "proj.bias" and "compound_prompt_projections.{i}.weight|bias" (PromptAlign tunes all of them);
    ids, slots as in `deep_text_features`."""

    def forward(tensors: dict[str, torch.Tensor], images: torch.Tensor):
        ctx, deep = tensors["ctx"], tensors.get("deep_ctx")
        text = deep_text_features(openclip_model, ids, slots, ctx, deep)
        w, b = tensors["proj.weight"], tensors["proj.bias"]
        prompts = [F.linear(ctx.to(w.dtype), w, b)]
        for i in range(depth - 1):
            w, b = (tensors[f"compound_prompt_projections.{i}.{k}"] for k in ("weight", "bias"))
            prompts.append(F.linear(deep[i].to(w.dtype), w, b))
        image = vision_features(openclip_model.visual, images, prompts)
        return clip_logits(openclip_model, image, text), text

    return forward
