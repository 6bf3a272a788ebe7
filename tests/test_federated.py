"""Federated prompt learning end to end on a tiny model and generated images, through the ServerApp's
round loop and the ClientApp in one process (tests/local_grid.py: Flower's Message API without a
SuperLink or Ray): one PromptFL run (3 clients, 3 rounds) shared by the run-folder, TensorBoard and
direct-computation tests; latent-domain prompts with a failing client; a client failure under
fl.on_client_failure=stop in the deployed ServerApp. The real simulation (`flwr run`, Ray, SIGKILL
and resume) is tests/test_federated_runs.py.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("flwr_datasets")

from conftest import REPO, TINY_CONFIG, make_image_folder, run_tool_in_process  # noqa: E402
from local_grid import LocalGrid, flower_identity, run_inprocess  # noqa: E402

from coop.federated import task  # noqa: E402

ROUNDS = 3
BASE = [
    f"model.name={TINY_CONFIG}",
    "model.pretrained=none",
    "data.shots=0",
    "data.num_workers=0",
    "device=cpu",
    "train.batch_size=4",
    "fl.clients=3",
]
PROMPTFL = [
    *BASE,
    "data.name=imagefolder",
    f"fl.rounds={ROUNDS}",
    "fl.local_epochs=2",
    "train.aug_views=2",
    "prompt.csc=true",
    "prompt.depth=2",
]


def history(folder: Path) -> list[dict]:
    path = folder / "history.csv"
    return list(csv.DictReader(path.open())) if path.is_file() else []


@pytest.fixture(scope="module")
def promptfl_data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("fl-images"), n_train=6, n_test=4)


@pytest.fixture(scope="module")
def reference(promptfl_data, fl_env, tmp_path_factory):
    """A PromptFL run: 3 clients, 3 rounds, csc, deep prompts, 2 views."""
    folder = tmp_path_factory.mktemp("fl-reference") / "run"
    overrides = [*PROMPTFL, f"data.root={promptfl_data}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COOP_CACHE_DIR", fl_env["COOP_CACHE_DIR"])  # the clients' features, for the tests too
        run_inprocess(folder, overrides, LocalGrid(3))
    return folder, overrides


# ---------------------------------------------------------------- PromptFL


def test_promptfl_run_folder(reference):
    folder, overrides = reference
    for name in ("config.yaml", "log.txt", "history.csv", "checkpoint.pt", "metrics.json", "partition.json"):
        assert (folder / name).is_file(), name
    rows = history(folder)
    assert [int(r["round"]) for r in rows] == list(range(1, ROUNDS + 1))
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    payload = sum(t.numel() * t.element_size() for t in ckpt["prompt"].values())
    assert set(ckpt["prompt"]) == {"ctx", "deep_ctx"}  # only the prompt travels and is stored
    for r in rows:
        assert r["clients"] == r["sampled"] == "3" and r["failed"] == ""
        assert int(r["bytes_down"]) == int(r["bytes_up"]) == 3 * payload
        assert int(r["bytes_sent"]) == 6 * payload
        assert 0 <= float(r["accuracy"]) <= 100 and float(r["train_loss"]) > 0
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["accuracy"] == pytest.approx(float(rows[-1]["accuracy"]), abs=1e-3)
    assert metrics["method"] == "promptfl" and metrics["rounds"] == ROUNDS and metrics["depth"] == 2
    assert metrics["client_failures"] == [] and len(metrics["per_class_accuracy"]) == 3
    part = json.loads((folder / "partition.json").read_text())
    assert part["scheme"] == "iid" and sorted(i for c in part["clients"] for i in c) == list(range(18))
    log = (folder / "log.txt").read_text()
    assert "round 3/3: accuracy" in log

    # a finished run is not repeated by the tool: no simulation, same metrics, checkpoint untouched
    mtime = (folder / "checkpoint.pt").stat().st_mtime_ns
    again = run_tool_in_process(
        REPO / "tools" / "federated.py", [*overrides, f"output_dir={folder}"], log=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["accuracy"] == metrics["accuracy"]
    assert (folder / "checkpoint.pt").stat().st_mtime_ns == mtime and not (folder / "flower.log").exists()
    assert "finished; not training again" in again.stderr


def test_promptfl_tensorboard_one_point_per_round(reference):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    folder, _ = reference
    acc = ea.EventAccumulator(str(folder / "tb"))
    acc.Reload()
    rows = history(folder)
    for tag, column in (("test/accuracy", "accuracy"), ("train/loss", "train_loss"), ("train/lr", "lr"),
                        ("comm/bytes_sent", "bytes_sent")):  # fmt: skip
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(1, ROUNDS + 1)), tag
        assert [e.value for e in events] == pytest.approx([float(r[column]) for r in rows], rel=1e-6)


def test_promptfl_equals_direct_computation(reference, fl_env, monkeypatch):
    """Each round = every client's local CoOp training outside Flower, then the weighted mean."""
    from omegaconf import OmegaConf

    from coop.model.weights import load_clip

    monkeypatch.setenv("COOP_CACHE_DIR", fl_env["COOP_CACHE_DIR"])  # the clients' features
    folder, _ = reference
    cfg = OmegaConf.load(folder / "config.yaml")
    clients = json.loads((folder / "partition.json").read_text())["clients"]
    clip = load_clip(cfg.model.name, pretrained="none")
    ds = task.load_data(cfg)
    global_ = {
        k: v.detach().clone() for k, v in task.build_method(clip, ds.classnames, cfg).learnable().items()
    }
    bs, epochs = int(cfg.train.batch_size), int(cfg.fl.local_epochs)
    for rnd in range(1, ROUNDS + 1):
        lr = task.round_lr(rnd, ROUNDS, float(cfg.train.lr))
        results = []
        for client, idx in enumerate(clients):
            feats, labels = task.features(cfg, clip, [ds.train[i] for i in idx], "cpu", train=True, what="x")
            local = task.build_method(clip, ds.classnames, cfg)
            local.load_learnable(global_, ds.classnames)
            params = local.learnable()
            opt = torch.optim.SGD(params.values(), lr=lr, momentum=0.9, weight_decay=5e-4)
            gen = torch.Generator().manual_seed(task.local_seed(int(cfg.data.seed), rnd, client))
            n = len(idx)
            for _ in range(epochs):
                order, view = (
                    torch.randperm(n, generator=gen),
                    torch.randint(feats.shape[0], (n,), generator=gen),
                )
                for b in range(max(1, n // bs)):
                    i = order[b * bs : (b + 1) * bs]
                    loss, _ = local.loss(feats[view[i], i], labels[i])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            results.append(({k: v.detach().clone() for k, v in params.items()}, n))
        total = sum(n for _, n in results)
        global_ = {k: sum(t[k].double() * n / total for t, n in results).float() for k in global_}
    final = torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]
    for key, tensor in global_.items():
        torch.testing.assert_close(final[key], tensor, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- client failures


def test_latent_domains_on_multidomain_data_with_a_failing_client(tmp_path):
    """Leave-one-domain-out on three generated styles, domains mixed across clients by a Dirichlet
    partition; one client holds an unreadable image, fails every round and is left out of it."""
    from omegaconf import OmegaConf
    from test_federated_parts import make_multidomain

    bad_file = os.path.join("photo", "red_thing", "3.png")
    root = make_multidomain(tmp_path / "styles", corrupt=bad_file)
    folder = tmp_path / "run"
    overrides = [
        *BASE,
        "data.name=multidomain",
        f"data.root={root}",
        "data.target_domain=sketch",
        "fl.method=latent_domains",
        "fl.domains=2",  # neither the number of clients nor of source domains
        "fl.partition=dirichlet",
        "fl.rounds=2",
        "prompt.position=middle",
        "prompt.depth=2",
    ]
    metrics = run_inprocess(folder, overrides, LocalGrid(3))

    ds = task.load_data(OmegaConf.load(folder / "config.yaml"))
    bad = next(i for i, d in enumerate(ds.train) if d.path.endswith(bad_file))
    part = json.loads((folder / "partition.json").read_text())
    culprit = next(c for c, idx in enumerate(part["clients"]) if bad in idx)
    assert all(set(counts) <= {"photo", "stripes"} for counts in part["domain_counts"])

    rows = history(folder)
    assert [(r["failed"], r["clients"], r["sampled"]) for r in rows] == [(str(culprit), "2", "3")] * 2
    assert metrics == json.loads((folder / "metrics.json").read_text())
    assert [(f["round"], f["client"]) for f in metrics["client_failures"]] == [(1, culprit), (2, culprit)]
    assert all("3.png" in f["error"] and f["error"].startswith(f"client {culprit}: DataError") for f in
               metrics["client_failures"])  # fmt: skip
    assert f"round 1: client {culprit} failed" in (folder / "log.txt").read_text()

    assert metrics["method"] == "latent_domains" and metrics["target_domain"] == "sketch"
    assert metrics["per_domain_accuracy"] == {"sketch": pytest.approx(metrics["accuracy"], abs=1e-3)}
    assert metrics["n_test"] == 18 and len(metrics["domain_usage"]) == 2 and sum(metrics["domain_usage"]) > 0
    prompt = torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]
    assert {"global.deep_ctx", "domain0.deep_ctx", "domain1.deep_ctx", "query"} <= set(prompt)


def test_a_client_failure_with_stop_comes_back_to_the_tool_as_one_line(tmp_path):
    """The deployed ServerApp (`coop.federated.app.server_app`, what `flwr run` starts, here on the
    in-process grid) with fl.on_client_failure=stop: its FederatedError goes to the result file with
    its class, which `simulate` raises again in the tool as the same one line; the checkpoint of the
    last complete round stays (none: round 1 failed). The tool prints a FederatedError as one line
    and exits with 1."""
    from flwr.app import Context, RecordDict

    from coop.config.load import load_config, to_yaml
    from coop.federated.app import server_app
    from coop.federated.server import FederatedError
    from coop.federated.simulation import raise_remote

    root = make_image_folder(tmp_path / "images", n_train=6, n_test=4)
    bad = sorted((root / "train").rglob("*.png"))[0]
    bad.write_bytes(b"not an image")
    folder = tmp_path / "run"
    overrides = [
        *BASE,
        "data.name=imagefolder",
        f"data.root={root}",
        "fl.rounds=2",
        "fl.on_client_failure=stop",
    ]
    config = tmp_path / "config.yaml"  # the tool's resolved config, as `simulate` writes it
    config.write_text(
        to_yaml(load_config(None, [*overrides, f"output_dir={folder}"], base=task.FEDERATED_BASE))
    )
    result = tmp_path / "result.json"
    run_config = {"config": str(config), "overrides": "", "tool-pid": 0, "result-file": str(result)}
    with flower_identity(), pytest.raises(FederatedError) as e:
        server_app(LocalGrid(3), Context(1, 0, {}, RecordDict(), run_config))
    message = str(e.value)
    assert message.startswith("round 1: client ") and str(bad) in message and "\n" not in message
    assert message.endswith("fl.on_client_failure=stop, the checkpoint keeps round 0")
    sent = json.loads(result.read_text())
    assert sent == {"error": message, "type": "FederatedError", "module": "coop.federated.server"}
    with pytest.raises(FederatedError) as again:
        raise_remote(sent)
    assert str(again.value) == message
    assert not (folder / "checkpoint.pt").exists() and not (folder / "metrics.json").exists()

    (folder / "checkpoint.pt").write_bytes(b"garbage")  # the tool's own FederatedError: one line, exit 1
    proc = run_tool_in_process(REPO / "tools" / "federated.py", [*overrides, f"output_dir={folder}"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot read checkpoint {folder / 'checkpoint.pt'} (UnpicklingError); delete it to restart"
    )
