"""Classification metrics of predicted labels, as every evaluation in coop reports them.

classification_metrics(preds, labels, n_cls)            accuracy, macro_f1, per_class_accuracy, n_test
classification_metrics(preds, labels, n_cls, domains)   ... and per_domain_accuracy
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
