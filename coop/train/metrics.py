"""Classification metrics of predicted labels, as every evaluation in coop reports them.

classification_metrics(preds, labels, n_cls)            accuracy, macro_f1, per_class_accuracy, n_test
classification_metrics(preds, labels, n_cls, domains)   ... and per_domain_accuracy
logit_metrics(logits, labels)                           ... from logits, with top5 and ece (15 bins)
"""

from __future__ import annotations

import math

import torch


def classification_metrics(
    preds: torch.Tensor, labels: torch.Tensor, n_cls: int, domains: list[str] | None = None
) -> dict:
    """Top-1 accuracy (%), macro F1 (%) over the present classes and per-class accuracy (%, None for
    a class without test images), from predictions and labels (N,).

    Args:
        domains: one domain name per image: adds `per_domain_accuracy` {domain: %} (4 places).
    """
    conf = torch.bincount(labels * n_cls + preds, minlength=n_cls * n_cls).reshape(n_cls, n_cls).double()
    tp = conf.diag()
    support, predicted = conf.sum(1), conf.sum(0)
    recall = torch.where(support > 0, tp / support.clamp(min=1), torch.nan)
    f1 = 2 * tp / (support + predicted).clamp(min=1)
    present = support > 0
    out = {
        "accuracy": float(100.0 * tp.sum() / conf.sum()),
        "macro_f1": float(100.0 * f1[present].mean()),
        "per_class_accuracy": [None if math.isnan(r) else round(100.0 * float(r), 4) for r in recall],
        "n_test": int(labels.numel()),
    }
    if domains is not None:
        correct = (preds == labels).tolist()
        out["per_domain_accuracy"] = {
            d: round(
                100.0 * sum(c for c, e in zip(correct, domains, strict=True) if e == d) / domains.count(d), 4
            )
            for d in sorted(set(domains))
        }
    return out


def top_k_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 5) -> float:
    """Top-k accuracy (%) from logits (N, n_cls): the label among the k highest; of equal logits the
    lower class index ranks first (a stable sort), so the result never depends on the backend."""
    k = min(int(k), logits.shape[-1])
    top = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    return float(100.0 * (top == labels[:, None]).any(-1).double().mean())


def expected_calibration_error(logits: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """ECE (%) of softmax(logits) (N, n_cls): the confidence (the top probability) in `bins` equal
    bins (lower, upper] of [0, 1], and the mean over bins of |accuracy - mean confidence| weighted by
    each bin's share of the images."""
    probs = logits.double().softmax(-1)
    conf, preds = probs.max(-1)
    correct = (preds == labels).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    ece = torch.zeros((), dtype=torch.float64)
    for lower, upper in zip(edges[:-1], edges[1:], strict=True):
        inside = (conf > lower) & (conf <= upper)
        if inside.any():
            ece += inside.double().mean() * (correct[inside].mean() - conf[inside].mean()).abs()
    return float(100.0 * ece)


def logit_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """`classification_metrics` of the logits' argmax (N, n_cls), with `top5` and `ece` (15 bins)."""
    return {
        **classification_metrics(logits.argmax(-1), labels, logits.shape[-1]),
        "top5": top_k_accuracy(logits, labels, 5),
        "ece": expected_calibration_error(logits, labels, 15),
    }
