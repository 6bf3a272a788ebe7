"""PromptFL as its authors ran it, without a simulation: the per-client few-shot draw against a
separate re-derivation of the official pipeline, the last-client aggregation against a client's
own local result, and clients and server running the `train.precision` asked for."""

from __future__ import annotations

import copy
import json
import random
from collections import Counter

import pytest
import torch

pytest.importorskip("flwr")

from conftest import TINY_CONFIG  # noqa: E402

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.data.base import Datum  # noqa: E402
from coop.federated import client, task  # noqa: E402
from coop.federated.partition import PartitionError  # noqa: E402
from coop.federated.promptfl_data import promptfl_partition  # noqa: E402
from coop.federated.strategy import aggregate  # noqa: E402
from coop.train.engine import evaluate  # noqa: E402

# ---------------------------------------------------------------- the official pipeline, re-derived


def official_clients(train_labels, val_labels, shots, users, iid, repeat_rate, seed, builds=2):
    """federated_main.py's data on item ids: random.seed(seed); each of the `builds` trainers reads
    the dataset (CoOp's K-shot train and min(K, 4) val draws, then generate_federated_fewshot_dataset
    on the full train split); the local trainer's (the last) client lists are what clients train on.
    Uses Python's global `random`, as the original does (state restored afterwards)."""
    saved = random.getstate()
    random.seed(seed)
    try:
        for _ in range(builds):
            for labels, k in ((train_labels, shots), (val_labels, min(shots, 4))):
                tracker = {}
                for i, y in enumerate(labels):
                    tracker.setdefault(y, []).append(i)
                for items in tracker.values():
                    if len(items) >= k:
                        random.sample(items, k)
            users_items = federated_draw(train_labels, shots, users, iid, repeat_rate)
        return users_items
    finally:
        random.setstate(saved)


def federated_draw(labels, shots, users, iid, repeat_rate):
    tracker = {}
    for i, y in enumerate(labels):
        tracker.setdefault(y, []).append(i)
    n_cls = max(labels) + 1
    per_user = int(round(n_cls / users))
    order = list(range(n_cls))
    random.shuffle(order)
    if repeat_rate > 0:
        n_rep = int(repeat_rate * n_cls)
        rep, norep = order[:n_rep], order[n_rep:]
        per_user = int(round((n_cls - n_rep) / users))
        fold = int(users / shots)
        if fold > 0:
            per_fold, rep_fold = int(round(users / fold)), int(round(n_rep / fold))
            ids = list(range(users))
            random.shuffle(ids)
            groups = {g: ids[g * per_fold : min((g + 1) * per_fold, users)] for g in range(fold)}
    out = {}
    for u in range(users):
        if iid:
            mine = list(range(n_cls))
        elif repeat_rate == 0:
            mine = order[u * per_user : n_cls] if u == users - 1 else order[u * per_user : (u + 1) * per_user]
        else:
            mine = []
            if fold > 0:
                for g, members in groups.items():
                    if u in members:
                        mine += (
                            rep[g * rep_fold : n_rep]
                            if g == len(groups) - 1
                            else rep[g * rep_fold : (g + 1) * rep_fold]
                        )
            else:
                mine += rep
            last = (
                norep[u * per_user : n_cls - n_rep]
                if u == users - 1
                else norep[u * per_user : (u + 1) * per_user]
            )
            mine += last
        picked = []
        for y, items in tracker.items():
            if y not in mine:
                continue
            if repeat_rate == 0:
                picked += random.sample(items, shots) if len(items) >= shots else items
            elif y in rep:
                picked += random.sample(items, int(shots / users) if int(shots / users) > 0 else 1)
            else:
                picked += random.sample(items, shots)
        out[u] = picked
    return [out[u] for u in range(users)]


def items(counts: dict[int, int], seed: int = 0) -> list[Datum]:
    """Datums with `counts[label]` images per label, shuffled (labels appear out of order)."""
    data = [Datum(f"img/{y}/{i}.png", y, f"class{y}") for y, n in counts.items() for i in range(n)]
    random.Random(seed).shuffle(data)
    return data


TRAIN = items({0: 6, 1: 2, 2: 5, 3: 7, 4: 4, 5: 6, 6: 3})  # class 1 has fewer than K = 3
VAL = items({y: 3 for y in range(7)}, seed=1)


@pytest.mark.parametrize(
    ("shots", "clients", "iid", "repeat_rate"),
    [(3, 4, True, 0.0), (3, 3, False, 0.0), (2, 2, False, 0.0), (1, 4, False, 0.3), (2, 4, True, 0.3)],
    ids=["iid", "noniid-remainder", "noniid-2", "repeat-folds", "iid-repeat"],
)
def test_promptfl_draw_equals_the_official_pipeline(shots, clients, iid, repeat_rate):
    labels, val = [d.label for d in TRAIN], [d.label for d in VAL]
    part = promptfl_partition(
        TRAIN, VAL, shots=shots, clients=clients, iid=iid, repeat_rate=repeat_rate, seed=1
    )
    want = official_clients(labels, val, shots, clients, iid, repeat_rate, seed=1)
    assert part.clients == want
    # the second build's draw: one build (no global trainer) gives other images
    assert want != official_clients(labels, val, shots, clients, iid, repeat_rate, seed=1, builds=1)
    assert (
        part.clients
        != promptfl_partition(
            TRAIN, VAL, shots=shots, clients=clients, iid=iid, repeat_rate=repeat_rate, seed=2
        ).clients
    )
    record = json.loads(json.dumps(part.to_json()))
    assert record["scheme"] == "promptfl" and record["clients"] == want and record["shots"] == shots
    counts = [Counter(labels[i] for i in c) for c in part.clients]
    if repeat_rate == 0:
        n = Counter(labels)
        for held, classes in zip(counts, record["client_classes"], strict=True):
            assert held == {y: min(shots, n[y]) for y in classes}  # K per class; class 1 gives its 2
        assert all(len(set(c)) == len(c) for c in part.clients)


def test_noniid_classes_and_the_last_clients_remainder():
    part = promptfl_partition(TRAIN, VAL, shots=3, clients=3, iid=False, repeat_rate=0.0, seed=1)
    classes = part.to_json()["client_classes"]
    assert [len(c) for c in classes] == [2, 2, 3]  # c = round(7 / 3) = 2, the last takes the rest
    assert sorted(sum(classes, [])) == list(range(7))
    iid = promptfl_partition(TRAIN, VAL, shots=3, clients=4, iid=True, repeat_rate=0.0, seed=1)
    assert all(c == list(range(7)) for c in iid.to_json()["client_classes"])
    assert iid.sizes() == [3 * 6 + 2] * 4  # every client: 3 of each class, both of class 1's


def test_promptfl_draw_refuses_what_the_official_code_cannot_run():
    # round(7 / 10) = 1 class each: clients 0-6 take one, 7-9 none (the official loader asserts)
    with pytest.raises(PartitionError, match="leaves client 7 without images") as e:
        promptfl_partition(TRAIN, VAL, shots=1, clients=10, iid=False, repeat_rate=0.0, seed=1)
    assert "\n" not in str(e.value)
    with pytest.raises(PartitionError, match="data.shots >= 1"):
        promptfl_partition(TRAIN, VAL, shots=0, clients=2, iid=True, repeat_rate=0.0, seed=1)


# ---------------------------------------------------------------- the run: data, config, recipe


def fl_cfg(root, *extra):
    args = [
        f"model.name={TINY_CONFIG}",
        "model.pretrained=none",
        "data.name=imagefolder",
        f"data.root={root}",
        "data.shots=2",
        "data.num_workers=0",
        "device=cpu",
        "train.batch_size=4",
        "train.lr=0.05",
        "fl.partition=promptfl",
        "fl.iid=true",
        "fl.clients=2",
        "fl.local_epochs=2",
        *extra,
    ]
    cfg = load_config(None, args, base=task.FEDERATED_BASE)
    task.check_config(cfg)
    return cfg


def test_promptfl_partition_of_a_run(image_folder):
    cfg = fl_cfg(image_folder, "fl.iid=false", "fl.clients=3")
    ds = task.load_data(cfg)
    assert len(ds.train) == 18 and ds.shots == 0  # the full train split: every client draws K from it
    part = task.client_partition(cfg, ds)
    assert part.clients == official_clients(
        [d.label for d in ds.train], [d.label for d in ds.val], 2, 3, False, 0.0, 1
    )
    assert [sorted({ds.train[i].label for i in c}) for c in part.clients] == [
        sorted(c) for c in part.to_json()["client_classes"]
    ]
    assert part.sizes() == [2, 2, 2]  # one class each, K = 2
    assert "_promptfl-noniid_fedavg_c3" in task.fl_run_name(cfg)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.shots=0"], "fl.partition=promptfl draws data.shots images per class per client"),
        (["data.subsample_classes=base"], "data.subsample_classes=base is not supported"),
        (["fl.repeat_rate=1.0"], "fl.repeat_rate must be a number in [0, 1)"),
        (["fl.iid=1"], "fl.iid must be true or false"),
        (["fl.method=latent_domains", "fl.aggregation=last_client"], "it needs fl.method=promptfl"),
    ],
)
def test_promptfl_settings_that_cannot_run_are_one_line(image_folder, args, message):
    with pytest.raises(ConfigError) as e:
        fl_cfg(image_folder, *args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_paper_recipe():
    cfg = load_config("configs/federated/promptfl_paper.yaml", [], base=task.FEDERATED_BASE)
    task.check_config(cfg)
    fl = cfg.fl
    assert (fl.local_epochs, cfg.train.lr, fl.rounds, fl.fraction, fl.clients, cfg.data.shots) == (
        5,
        0.001,
        20,
        1.0,
        64,
        1,
    )
    assert (fl.partition, fl.repeat_rate, cfg.prompt.n_ctx, cfg.prompt.position, cfg.prompt.csc) == (
        "promptfl",
        0.0,
        16,
        "end",
        False,
    )
    assert fl.aggregation == "uniform" and cfg.data.name == "caltech101" and cfg.train.batch_size == 32


def official_average_weights(w):
    """PromptFL's utils.average_weights: a copy of the first state dict plus the others, / len."""
    avg = copy.deepcopy(w[0])
    for key in avg:
        for i in range(1, len(w)):
            avg[key] += w[i][key]
        avg[key] = torch.div(avg[key], len(w))
    return avg


def test_last_client_is_what_the_official_loop_computes_and_a_clients_own_result(image_folder):
    # federated_main.py: one local model; its state_dict() (tensors sharing the model's storage) is
    # appended per client and never copied, so the "average" is of N views of the last client's weights
    model, kept = torch.nn.Linear(3, 2), []
    for value in (1.0, 2.0, 7.0):
        with torch.no_grad():
            model.weight.fill_(value)  # client i's local training
        kept.append(model.state_dict())
    assert torch.equal(official_average_weights(kept)["weight"], torch.full((2, 3), 7.0))

    cfg = fl_cfg(image_folder, "fl.aggregation=last_client")
    ds = task.load_data(cfg)
    part = task.client_partition(cfg, ds)
    clip_ = client.client_data(cfg, 0).clip
    start = {
        k: v.detach().clone() for k, v in task.build_method(clip_, ds.classnames, cfg).learnable().items()
    }
    lr = task.round_lr(1, int(cfg.fl.rounds), float(cfg.train.lr))
    replies = []
    for pid in (0, 1):  # each client's round, exactly as its ClientApp runs it
        sent, _, metrics = client.train_round(cfg, pid, start, 1, lr, 0.0, part.digest())
        replies.append({"pid": pid, "tensors": sent, "num_examples": metrics["num-examples"], "usage": []})
    new = aggregate(start, replies, "last_client", beta=0.5)
    mean = aggregate(start, replies, "uniform", beta=0.5)
    for key in start:
        assert torch.equal(new[key], replies[1]["tensors"][key])  # client 1's local result, bit for bit
        assert not torch.allclose(new[key], mean[key]) and not torch.allclose(new[key], start[key])


@pytest.mark.parametrize("precision", ["amp", "fp16"])
def test_clients_and_server_run_the_precision_asked(image_folder, tmp_path, monkeypatch, precision):
    """On a device that has it (here: CPU made to report it), clients train and the server evaluates
    at train.precision: amp under bf16 autocast with fp32 prompts, fp16 with half CLIP and prompts."""
    import coop.train.features
    import coop.train.precision
    from coop.federated.server import ServerRun

    monkeypatch.setattr(coop.train.precision, "resolve_precision", lambda p, d: p)  # autocast
    monkeypatch.setattr(coop.train.features, "resolve_precision", lambda p, d: p)  # cached_features
    monkeypatch.setattr(task, "resolve_precision", lambda p, d: p)
    results = {}
    for prec in ("fp32", precision):
        cfg = fl_cfg(image_folder, f"train.precision={prec}", f"output_dir={tmp_path / prec}")
        run = ServerRun(cfg, tmp_path / prec)
        assert run.precision == prec
        sent, _, metrics = client.train_round(cfg, 0, run.arrays, 1, 0.05, 0.0, run.part.digest())
        data = client.client_data(cfg, 0)
        results[prec] = (run, sent, metrics, data)
    run, sent, metrics, data = results[precision]
    run32, sent32, metrics32, _ = results["fp32"]
    want = torch.float16 if precision == "fp16" else torch.float32
    assert {t.dtype for t in run.arrays.values()} == {t.dtype for t in sent.values()} == {want}
    low = torch.float16 if precision == "fp16" else torch.bfloat16  # what encoded the images
    assert torch.equal(data.feats, data.feats.to(low).float())
    assert not torch.equal(results["fp32"][3].feats, results["fp32"][3].feats.to(low).float())
    assert metrics["train-loss"] != metrics32["train-loss"]  # bf16 / fp16 arithmetic really ran
    assert metrics["train-loss"] == pytest.approx(metrics32["train-loss"], rel=0.05)
    for key in sent:  # the same round up to low-precision arithmetic: within 5% of the fp32 prompts
        # (a norm, not element by element: a near-zero entry's rounding depends on the CPU's bf16 kernels)
        drift = (sent[key].float() - sent32[key]).norm() / sent32[key].norm()
        assert 0 < drift < 0.05, (key, float(drift))
    score = evaluate(run.method, run.test_feats[0], run.test_labels, "cpu", precision=run.precision)
    assert 0 <= score["accuracy"] <= 100
