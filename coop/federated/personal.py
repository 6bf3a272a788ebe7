"""The personalised metrics of FedOTP/FedPGP runs, computed by the server every round.

    ev = PersonalEvaluator(cfg, clip, ds, part, method, test_feats, test_labels, device, precision)
    row = ev.evaluate(global_tensors, strategy.personal_of)   # one history.csv row's personal part
    summary = round_summary(history)                           # metrics.json's personal fields

Client k's **personal model** is the round's global tensors plus k's own personal tensors (its
last trained ones; the common initial value if it never trained). Every metric predicts over
the run's whole label space (all C classes, or the C_base base classes), and each per-client
accuracy is a micro accuracy (correct / images):

    local_accuracy    mean over ALL clients k (sampled or not, unweighted) of the accuracy of
                      k's personal model on k's test set (`client_test_sets`)
    base_accuracy     base-to-novel runs (data.subsample_classes=base): mean over all clients of
                      k's personal model on the whole base test set
    novel_accuracy    the same on the whole novel test set, over the novel classes' label space
    hm                3 / (1/local + 1/base + 1/novel) (FedPGP's HM)
    hm_base_novel     2 base novel / (base + novel) (CoOp's and CoCoOp's HM)
    global_accuracy   the global part alone (FedOTP: the global prompt, N = 1; FedPGP: sigma) on
                      the whole test set (FLiP's "global"); history's `accuracy` column

`round_summary` turns the rounds into the final value, the mean and population std (numpy's
default, as the originals print) of the last 5 rounds, and the maximum over rounds, named
`*_max_test_selected`: choosing a round on test accuracy is test-set selection, which the
originals print (and save their model by); it is logged, never used.
"""

from __future__ import annotations

import statistics

import torch
from omegaconf import DictConfig

from coop.data import DataError, build_dataset, subsample_classes
from coop.engine import predict
from coop.federated import task
from coop.federated.partition import Partition
from coop.federated.personal_data import client_test_sets
from coop.methods import Method
from coop.model import CLIP

PERSONAL_FIELDS = [
    "local_accuracy",
    "base_accuracy",
    "novel_accuracy",
    "hm",
    "hm_base_novel",
    "global_accuracy",
]
LAST = 5  # the originals report the mean and std of the last 5 rounds


def harmonic(*values: float) -> float:
    """k / sum(1 / v); 0 when a value is 0."""
    return len(values) / sum(1.0 / v for v in values) if all(v > 0 for v in values) else 0.0


def accuracy(preds: torch.Tensor, labels: torch.Tensor) -> float:
    return 100.0 * float((preds == labels).sum()) / max(1, labels.numel())


class PersonalEvaluator:
    """Per-round personalised metrics (module docstring) of a run's clients.

    Args:
        cfg: the run config (`data.subsample_classes=base` adds the novel half).
        clip, method: the server's model and method (its tensors are overwritten per client).
        ds, part: the run's dataset and partition.
        test_feats, test_labels: features (N, ...) and labels (N,) of ds.test.
        device, precision: where and how to evaluate (`task.run_precision`).
    """

    def __init__(
        self,
        cfg: DictConfig,
        clip: CLIP,
        ds,
        part: Partition,
        method: Method,
        test_feats: torch.Tensor,
        test_labels: torch.Tensor,
        device,
        precision: str,
    ):
        if len(test_labels) != len(ds.test):  # the clients' test sets index the whole test split
            raise DataError(
                f"personalised metrics need every test image: {len(ds.test) - len(test_labels)} were "
                "skipped as unreadable (data.skip_corrupt)"
            )
        self.method, self.classnames = method, list(ds.classnames)
        self.feats, self.labels, self.device, self.precision = test_feats, test_labels, device, precision
        self.client_test = [
            torch.tensor(t, dtype=torch.long) for t in client_test_sets(part, test_labels.tolist())
        ]
        self.base_to_novel = cfg.data.subsample_classes == "base"
        if self.base_to_novel:
            full = build_dataset(cfg.data.name, cfg.data.root, shots=0, seed=int(cfg.data.seed))
            novel = subsample_classes(full, "new")
            self.novel_method = task.build_method(clip, novel.classnames, cfg).to(device)
            task.prepare_precision(clip, self.novel_method, precision)
            feats, self.novel_labels = task.features(
                cfg,
                clip,
                novel.test,
                device,
                train=False,
                what="the novel test split",
                tokens=method.image_tokens,
            )
            self.novel_feats = feats[0]

    def client_accuracies(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """One personal model's predictions on the whole test split ("preds"), its accuracy there
        ("whole") and, in base-to-novel runs, its accuracy on the novel test split ("novel")."""
        self.method.load_learnable(tensors, self.classnames)
        preds = predict(self.method, self.feats, self.device, self.precision)
        out = {"whole": accuracy(preds, self.labels), "preds": preds}
        if self.base_to_novel:
            self.novel_method.load_learnable(tensors, self.classnames)
            novel = predict(self.novel_method, self.novel_feats, self.device, self.precision)
            out["novel"] = accuracy(novel, self.novel_labels)
        return out

    def evaluate(self, global_tensors: dict[str, torch.Tensor], personal_of) -> dict:
        """The personal fields of one round (global_accuracy is the caller's `accuracy`).

        Args:
            global_tensors: the round's aggregated global tensors.
            personal_of: partition id -> that client's personal tensors.
        Returns:
            {local_accuracy, base_accuracy, novel_accuracy, hm, hm_base_novel, local_per_client}
            (base/novel/hm fields None unless base-to-novel).
        """
        local, base, novel = [], [], []
        for k, idx in enumerate(self.client_test):
            res = self.client_accuracies({**global_tensors, **personal_of(k)})
            local.append(accuracy(res["preds"][idx], self.labels[idx]))
            base.append(res["whole"])
            novel.append(res.get("novel"))
        row = {"local_accuracy": statistics.fmean(local), "local_per_client": local}
        row.update(base_accuracy=None, novel_accuracy=None, hm=None, hm_base_novel=None)
        if self.base_to_novel:
            b, n = statistics.fmean(base), statistics.fmean(novel)
            row.update(
                base_accuracy=b,
                novel_accuracy=n,
                hm=harmonic(row["local_accuracy"], b, n),
                hm_base_novel=harmonic(b, n),
            )
        return row


def round_summary(history: list[dict], fields=PERSONAL_FIELDS) -> dict:
    """metrics.json's personal fields from history rows: `<f>` (final round), `<f>_last5_mean`,
    `<f>_last5_std` (population std over the last min(5, R) rounds) and `<f>_max_test_selected`."""
    out = {}
    for f in fields:
        values = [float(r[f]) for r in history if r.get(f) not in (None, "")]
        if not values:
            continue
        last = values[-LAST:]
        out[f] = values[-1]
        out[f"{f}_last5_mean"] = statistics.fmean(last)
        out[f"{f}_last5_std"] = statistics.pstdev(last)
        out[f"{f}_max_test_selected"] = max(values)
    return out
