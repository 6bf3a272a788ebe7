"""Federated simulations of the other methods (tools/federated.py, tiny model, generated images):
latent-domain prompts with a failing client, FedOTP (killed and resumed) and FedPGP against the
in-process grid, and a client failure under fl.on_client_failure=stop. Apart from
test_federated.py so that pytest-xdist runs the two files' simulations side by side."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("flwr_datasets")

from conftest import fl_processes, make_image_folder  # noqa: E402
from test_federated import BASE, _kill_when, _start, ckpt_round, history, run_tool  # noqa: E402

from coop.federated import task  # noqa: E402


def read(path) -> str:
    return path.read_text() if path.is_file() else ""


def test_latent_domains_on_multidomain_data_with_a_failing_client(fl_env, tmp_path):
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
    proc = run_tool(folder, overrides, fl_env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    ds = task.load_data(OmegaConf.load(folder / "config.yaml"))
    bad = next(i for i, d in enumerate(ds.train) if d.path.endswith(bad_file))
    part = json.loads((folder / "partition.json").read_text())
    culprit = next(c for c, idx in enumerate(part["clients"]) if bad in idx)
    assert all(set(counts) <= {"photo", "stripes"} for counts in part["domain_counts"])

    rows = history(folder)
    assert [(r["failed"], r["clients"], r["sampled"]) for r in rows] == [(str(culprit), "2", "3")] * 2
    metrics = json.loads((folder / "metrics.json").read_text())
    assert [(f["round"], f["client"]) for f in metrics["client_failures"]] == [(1, culprit), (2, culprit)]
    assert all("3.png" in f["error"] and f["error"].startswith(f"client {culprit}: DataError") for f in
               metrics["client_failures"])  # fmt: skip
    assert f"round 1: client {culprit} failed" in (folder / "log.txt").read_text()

    assert metrics["method"] == "latent_domains" and metrics["target_domain"] == "sketch"
    assert metrics["per_domain_accuracy"] == {"sketch": pytest.approx(metrics["accuracy"], abs=1e-3)}
    assert metrics["n_test"] == 18 and len(metrics["domain_usage"]) == 2 and sum(metrics["domain_usage"]) > 0
    prompt = torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]
    assert {"global.deep_ctx", "domain0.deep_ctx", "domain1.deep_ctx", "query"} <= set(prompt)


PERSONAL_METHODS = {  # extra overrides, global keys, personal keys, killed inside round 2
    "fedotp": (["fl.method=fedotp"], {"global.ctx"}, {"local.ctx"}, True),
    "fedpgp": (
        ["fl.method=fedpgp", "fedpgp.rank=2", "data.subsample_classes=base"],
        {"sigma"},
        {"U", "V"},
        False,
    ),
}


@pytest.mark.parametrize("method", list(PERSONAL_METHODS))
def test_personal_simulation_equals_the_in_process_grid(fl_env, tmp_path, monkeypatch, method):
    """FedOTP and FedPGP (base-to-novel) through the simulation (tools/federated.py), FedOTP killed
    with SIGKILL inside round 2 (its clients may have written their round-2 state files already) and
    resumed: the same global and personal tensors and personalised metrics as the uninterrupted run
    on test_personal_fl's in-process grid. (FedPGP's resume runs the same client-state code; its
    crashes are tested in process, test_personal_fl.py, to keep the suite's time.)"""
    from flwr.supercore.task_identity import TaskIdentity
    from test_personal_fl import BASE as PERSONAL
    from test_personal_fl import LocalGrid, client_personal, run_inprocess

    extra, global_keys, personal_keys, kill = PERSONAL_METHODS[method]
    root = make_image_folder(tmp_path / "four", classes=("r", "g", "b", "y"), n_train=5, n_test=3)
    overrides = [*PERSONAL, f"data.root={root}", *extra, "fl.rounds=3", "fl.fraction=0.5", "prompt.n_ctx=4"]
    folder = tmp_path / "ray"
    log = folder / "log.txt"
    if kill:
        _kill_when(_start(folder, overrides, fl_env), lambda: "round 2/3: training" in read(log), fl_env)
        assert ckpt_round(folder) in (1, 2) and not (folder / "metrics.json").exists()
    proc = run_tool(folder, overrides, fl_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("resuming" in read(log)) == kill
    monkeypatch.setenv("COOP_CACHE_DIR", fl_env["COOP_CACHE_DIR"])
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)
    metrics = run_inprocess(tmp_path / "local", overrides, LocalGrid(2))
    ray, local = (torch.load(tmp_path / f / "checkpoint.pt", weights_only=True) for f in ("ray", "local"))
    assert set(ray["prompt"]) == global_keys
    for key in global_keys:
        assert torch.equal(ray["prompt"][key], local["prompt"][key]), key
    assert ray["strategy"]["personal_round"] == local["strategy"]["personal_round"]
    for k in (0, 1):  # from each run's client state files (the Ray actors wrote theirs)
        ours, theirs = (client_personal(tmp_path / f, k) for f in ("ray", "local"))
        assert set(ours) == personal_keys and all(torch.equal(ours[p], theirs[p]) for p in personal_keys)
    ours = json.loads((folder / "metrics.json").read_text())
    assert ours["method"] == method and ours["local_per_client"] == metrics["local_per_client"]
    assert {k: v for k, v in ours.items() if "accuracy" in k or k.startswith("hm")} == {
        k: v for k, v in metrics.items() if "accuracy" in k or k.startswith("hm")
    }
    assert [r["sampled"] for r in history(folder)] == ["2", "1", "1"]
    fields = ("local_accuracy", "base_accuracy", "novel_accuracy", "global_accuracy")
    assert [[r[f] for f in fields] for r in history(folder)] == [
        [r[f] for f in fields] for r in history(tmp_path / "local")
    ]


def test_a_client_failure_with_stop_is_one_line_from_the_serverapps_process(fl_env, tmp_path):
    """The ServerApp runs in a process that Flower starts; its FederatedError still reaches the
    tool's console as one line (exit 1), and the checkpoint of the last complete round stays."""
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
    proc = run_tool(folder, overrides, fl_env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert fl_processes(fl_env) == {}  # a failed ServerApp leaves no process of its run either
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: round 1: client ") and str(bad) in last
    assert last.endswith("fl.on_client_failure=stop, the checkpoint keeps round 0")
    assert not (folder / "checkpoint.pt").exists() and not (folder / "metrics.json").exists()


def test_a_lost_ray_actor_fails_one_client_and_is_replaced(fl_env, tmp_path):
    """SIGKILL of the Ray actor that runs the clients (what Ray's memory monitor or the OOM killer do
    on a machine short of memory): the first client whose message it was running, or is sent next,
    fails for that round, with one line naming it and the actor; a new actor runs the other
    clients, and the run finishes (coop.federated.ray_pool)."""
    import signal
    import time

    root = make_image_folder(tmp_path / "images", n_train=6, n_test=4)
    folder = tmp_path / "run"
    log = folder / "log.txt"
    overrides = [*BASE, "data.name=imagefolder", f"data.root={root}", "fl.rounds=2", "fl.local_epochs=4"]
    proc = _start(folder, overrides, fl_env, capture=True)
    deadline = time.monotonic() + 300
    while "round 1/2: training" not in read(log):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    [actor] = [pid for pid, cmd in fl_processes(fl_env).items() if cmd.startswith("ray::ClientAppActor")]
    os.kill(actor, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]

    metrics = json.loads((folder / "metrics.json").read_text())
    [lost] = metrics["client_failures"]
    assert lost["error"] == f"its Ray actor (pid {actor}) died (SYSTEM_ERROR); a new actor takes its place"
    rows = history(folder)
    assert [(r["round"], r["clients"], r["sampled"], r["failed"]) for r in rows] == [
        (str(r), "2" if r == lost["round"] else "3", "3", str(lost["client"]) if r == lost["round"] else "")
        for r in (1, 2)
    ]
    line = f"round {lost['round']}: client {lost['client']} failed: {lost['error']}"
    for text in (stderr, read(log)):  # the console and log.txt: that one line, none of Ray's
        assert text.count(line) == 1 and "Traceback" not in text and "ray.exceptions" not in text
    flower = read(folder / "flower.log")  # Flower's traceback and Ray's text stay there
    assert "Traceback" in flower and f"Exception ActorLost occurred. Message: {lost['error']}" in flower
    assert fl_processes(fl_env) == {}
