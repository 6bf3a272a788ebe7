"""CoOp's linear-probe baseline: logistic regression on frozen image-tower features.

Features are the image tower's raw output under the test transform (not L2-normalised), for the
few-shot train and val splits. The regularisation strength C is chosen on val as CoOp does:

1. fit C in 1e6, 1e4, 1e2, 1, 1e-2, 1e-4, 1e-6 and keep the best val accuracy (first on ties);
2. bisect 8 times in log space, starting from [C*/10, 10 C*]: fit both ends, keep the better one
   (the left one on ties), and halve the interval towards it (in log10).

The classifier of the last step is the result. It runs on cached features in seconds, as the
engine's `tune` step (`Method.tunes_on_val`): no SGD, the search is the whole fit.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from omegaconf import DictConfig

from coop.data import DataError
from coop.methods.base import FeatureRequest, Method, TransferError
from coop.model.clip import CLIP

log = logging.getLogger(__name__)

C_GRID = (1e6, 1e4, 1e2, 1.0, 1e-2, 1e-4, 1e-6)
BISECTION_STEPS = 8


def _fit(x: np.ndarray, y: np.ndarray, c: float):
    import sklearn
    from sklearn.linear_model import LogisticRegression

    # L2 logistic regression with L-BFGS, as CoOp fits it. scikit-learn 1.8 deprecated `penalty`;
    # its default there (l1_ratio=0) is the same L2 penalty.
    major, minor = (int(v) for v in sklearn.__version__.split(".")[:2])
    l2 = {"penalty": "l2"} if (major, minor) < (1, 8) else {}
    return LogisticRegression(solver="lbfgs", max_iter=1000, C=c, **l2).fit(x, y)


def _accuracy(clf, x: np.ndarray, y: np.ndarray) -> float:
    return float((clf.predict(x) == y).mean())


def search_c(train_x, train_y, val_x, val_y, steps: int = BISECTION_STEPS):
    """CoOp's C search; returns (fitted LogisticRegression, C, val accuracy in %)."""
    accs = [_accuracy(_fit(train_x, train_y, c), val_x, val_y) for c in C_GRID]
    peak = C_GRID[int(np.argmax(accs))]
    log.info("linear probe: val accuracy on the C grid %s; best C=%g", [round(a, 4) for a in accs], peak)
    left, right = peak / 10, peak * 10
    best = None
    for _ in range(steps):
        clf_l, clf_r = _fit(train_x, train_y, left), _fit(train_x, train_y, right)
        acc_l, acc_r = _accuracy(clf_l, val_x, val_y), _accuracy(clf_r, val_x, val_y)
        mid = 0.5 * (math.log10(left) + math.log10(right))
        if acc_l < acc_r:
            best = (clf_r, right, acc_r)
            left = 10**mid
        else:
            best = (clf_l, left, acc_l)
            right = 10**mid
    if best is None:  # steps == 0: the grid's best
        best = (_fit(train_x, train_y, peak), peak, max(accs))
    clf, c, acc = best
    return clf, c, 100.0 * acc


class LinearProbe(Method):
    """A linear classifier (n_cls, E) on raw image features, fitted in closed form by `fit`."""

    name = "linear_probe"
    trainer = "none"
    tunes_on_val = True
    fit_request = FeatureRequest(views=1, augment=False)  # the test transform, as CoOp extracts them

    @classmethod
    def own_classes_only(cls, cfg: DictConfig) -> str | None:
        return "method=linear_probe learns one classifier row per base class"

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        dim = clip.embed_dim
        self.register_buffer("weight", torch.zeros(self.n_cls, dim, dtype=torch.float64))
        self.register_buffer("bias", torch.zeros(self.n_cls, dtype=torch.float64))
        self.register_buffer("C", torch.tensor(float("nan"), dtype=torch.float64))

    def learnable(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias, "C": self.C}

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        """Rows follow the class names, so a subset of the trained classes (ImageNet-A/R) works."""
        index = {name: i for i, name in enumerate(classnames)}
        missing = [c for c in self.classnames if c not in index]
        if missing:
            raise TransferError(
                f"the linear probe was trained without class {missing[0]!r}; it can only score its own classes"
            )
        rows = torch.tensor([index[c] for c in self.classnames])
        with torch.no_grad():
            self.weight.copy_(tensors["weight"][rows])
            self.bias.copy_(tensors["bias"][rows])
            self.C.copy_(tensors["C"])

    def tune(self, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """CoOp's C search on (features (V=1, N, E) or (N, E), labels) of train and val."""
        (tx, ty), (vx, vy) = train, val
        tx = tx[0] if tx.dim() == 3 else tx  # (N, E): the one test-transform view
        if len(vy) == 0:
            raise DataError("linear_probe chooses C on the val split, and it is empty")
        to_np = lambda t: t.detach().cpu().double().numpy()  # noqa: E731
        clf, c, val_acc = search_c(to_np(tx), ty.numpy(), to_np(vx), vy.numpy())
        coef = torch.from_numpy(clf.coef_)
        bias = torch.from_numpy(clf.intercept_)
        classes = torch.from_numpy(clf.classes_).long()
        with torch.no_grad():
            self.weight.zero_()
            self.bias.fill_(-math.inf)  # a class absent from training is never predicted
            if coef.shape[0] == 1:  # binary: sklearn keeps one row, the score of classes_[1]
                self.weight[classes[1]] = coef[0]
                self.bias[classes[1]] = bias[0]
                self.bias[classes[0]] = 0.0
            else:
                self.weight[classes] = coef
                self.bias[classes] = bias
            self.C.fill_(c)
        log.info("linear probe: C=%g (val accuracy %.2f%%)", c, val_acc)
        return {"C": c, "val_accuracy": val_acc}

    def logits(self, image_features: torch.Tensor, prepared=None) -> torch.Tensor:
        x = image_features.to(self.weight.device, torch.float64)
        return (x @ self.weight.t() + self.bias).float()  # (B, n_cls), float64 inside: sklearn's argmax

    def describe(self) -> dict:
        return {"C": float(self.C)}
