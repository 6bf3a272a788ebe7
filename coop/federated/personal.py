"""The personalised metrics of FedOTP/FedPGP runs: computed by every client, averaged by the server.

    data = eval_data(cfg, clip, method, device, precision)        # a client, once per process and config
    acc = client_accuracies(data, pid, method, tensors, classnames) # its EVALUATE reply's metrics
    row = client_means([acc_0, ..., acc_N-1])                       # the server: one history row's part
    summary = round_summary(history)                                # metrics.json's personal fields

Client k's **personal model** is the round's global tensors plus k's own personal tensors (the
version the server names, `coop.federated.client_state`; the common initial value if k never
trained). Each round, after aggregation, the server sends every client (sampled or not) an
EVALUATE message with the new global tensors; each client evaluates its personal model with
`coop.train.engine.predict` and replies with its accuracies. Every metric predicts over the run's whole
label space (all C classes, or the C_base base classes), and each per-client accuracy is a micro
accuracy (correct / images):

    local_accuracy    mean over ALL clients k (unweighted, not Flower's example-weighted mean) of
                      the accuracy of k's personal model on k's test set (`client_test_sets`)
    base_accuracy     base-to-novel runs (data.subsample_classes=base): mean over all clients of
                      k's personal model on the whole base test set
    novel_accuracy    the same on the whole novel test set, over the novel classes' label space
    hm                3 / (1/local + 1/base + 1/novel) (FedPGP's HM)
    hm_base_novel     2 base novel / (base + novel) (CoOp's and CoCoOp's HM)
    global_accuracy   the global part alone (FedOTP: the global prompt, N = 1; FedPGP: sigma) on
                      the whole test set (FLiP's "global"), computed by the server; history's
                      `accuracy` column

`round_summary` turns the rounds into the final value, the mean and population std (numpy's
default, as the originals print) of the last 5 rounds, and the maximum over rounds, named
`*_max_test_selected`: choosing a round on test accuracy is test-set selection, which the
originals print (and save their model by); it is logged, never used.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from coop.data import DataError, build_dataset, subsample_classes
from coop.federated import task
from coop.federated.personal_data import client_test_sets
from coop.methods import Method
from coop.model.clip import CLIP
from coop.train.engine import predict

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


@dataclass
class EvalData:
    """What every client of a run is evaluated on; one per process and config (test features are big).

    feats, labels: the whole test split, (N, ...) and (N,); client_test: each client's test set
    (indices into it); novel_*: base-to-novel runs, the novel test split and a method over the novel
    class names (its tensors are overwritten per client).
    """

    feats: torch.Tensor
    labels: torch.Tensor
    client_test: list[torch.Tensor]
    novel_method: Method | None = None
    novel_feats: torch.Tensor | None = None
    novel_labels: torch.Tensor | None = None


def eval_data(cfg: DictConfig, clip: CLIP, method: Method, device, precision: str) -> EvalData:
    """The test split's features, every client's test set and, with data.subsample_classes=base,
    the novel test split (`task.features`: from the on-disk feature cache after the first build).

    Args:
        cfg: the run config.
        clip, method: a client's model and method (for its precision and `image_tokens`).
        device, precision: where and how to evaluate (`task.run_precision`).
    """
    ds = task.load_data(cfg)
    part = task.client_partition(cfg, ds)
    feats, labels = task.features(
        cfg, clip, ds.test, device, train=False, what="the test split", tokens=method.image_tokens
    )
    if len(labels) != len(ds.test):  # the clients' test sets index the whole test split
        raise DataError(
            f"personalised metrics need every test image: {len(ds.test) - len(labels)} were "
            "skipped as unreadable (data.skip_corrupt)"
        )
    client_test = [torch.tensor(t, dtype=torch.long) for t in client_test_sets(part, labels.tolist())]
    out = EvalData(feats[0], labels, client_test)
    if cfg.data.subsample_classes == "base":
        full = build_dataset(cfg.data.name, cfg.data.root, shots=0, seed=int(cfg.data.seed))
        novel = subsample_classes(full, "new")
        out.novel_method = task.build_method(clip, novel.classnames, cfg).to(device)
        task.prepare_precision(clip, out.novel_method, precision)
        nfeats, out.novel_labels = task.features(
            cfg,
            clip,
            novel.test,
            device,
            train=False,
            what="the novel test split",
            tokens=method.image_tokens,
        )
        out.novel_feats = nfeats[0]
    return out


def client_accuracies(
    data: EvalData, pid: int, method: Method, tensors: dict, classnames: list[str], device, precision: str
) -> dict[str, float]:
    """Client `pid`'s personal model `tensors` (global + personal) evaluated: `local-accuracy` on its
    own test set and, in base-to-novel runs, `base-accuracy` and `novel-accuracy` on the whole base
    and novel test splits (%, micro)."""
    method.load_learnable(tensors, classnames)
    idx = data.client_test[pid]
    # each test set is its own predict call: FedOTP's OT stops on a batch-global rule, and the
    # originals evaluate a client on its own test loader
    local = predict(method, data.feats[idx], device, precision) if len(idx) else idx  # no test image: 0
    out = {"local-accuracy": accuracy(local, data.labels[idx])}
    if data.novel_method is not None:
        out["base-accuracy"] = accuracy(predict(method, data.feats, device, precision), data.labels)
        data.novel_method.load_learnable(tensors, classnames)
        novel = predict(data.novel_method, data.novel_feats, device, precision)
        out["novel-accuracy"] = accuracy(novel, data.novel_labels)
    return out


def client_means(per_client: list[dict]) -> dict:
    """One round's personal fields from every client's `client_accuracies` (in partition order):
    unweighted means over the clients and the harmonic means (global_accuracy is the server's).

    Returns:
        {local_accuracy, base_accuracy, novel_accuracy, hm, hm_base_novel, local_per_client}
        (base/novel/hm fields None unless base-to-novel).
    """
    local = [float(c["local-accuracy"]) for c in per_client]
    row = {"local_accuracy": statistics.fmean(local), "local_per_client": local}
    row.update(base_accuracy=None, novel_accuracy=None, hm=None, hm_base_novel=None)
    if all("novel-accuracy" in c for c in per_client):
        b = statistics.fmean(float(c["base-accuracy"]) for c in per_client)
        n = statistics.fmean(float(c["novel-accuracy"]) for c in per_client)
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
