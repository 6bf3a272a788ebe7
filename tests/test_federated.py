"""Federated prompt learning: real Flower simulations (tiny model, generated images) and their parts.

Each simulation starts a SuperLink, `flwr run` and Ray, which costs 25-35 s on 2 CPU cores, so one
PromptFL run (3 clients, 3 rounds) is shared by the direct-computation, run-folder and resume
tests. The other methods' simulations are in test_federated_runs.py (a file of its own, so that
pytest-xdist runs the two files' simulations side by side).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("flwr_datasets")

from conftest import REPO, TINY_CONFIG, fl_processes, make_image_folder, noting_fl_sessions  # noqa: E402

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
    "fl.local_epochs=12",  # some compute per round: margin for the resume test's kills
    "train.aug_views=2",
    "prompt.csc=true",
    "prompt.depth=2",
]


def command(folder: Path, overrides: list[str]) -> list[str]:
    # one Ray actor (~1 GB) runs the three clients in turn, whatever the machine's cores: on 2 cores
    # that starts faster than two, and with two test files' simulations side by side on a machine
    # that others use too, memory is what runs out first
    tool = [sys.executable, str(REPO / "tools" / "federated.py"), "--cpus-per-client", "1", "--num-cpus", "1"]
    return [*tool, *overrides, f"output_dir={folder}"]


def run_tool(
    folder: Path, overrides: list[str], env: dict, timeout: float = 400
) -> subprocess.CompletedProcess:
    with noting_fl_sessions(env):  # for fl_processes after the run
        return subprocess.run(
            command(folder, overrides), capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
        )


def history(folder: Path) -> list[dict]:
    path = folder / "history.csv"
    return list(csv.DictReader(path.open())) if path.is_file() else []


def ckpt_round(folder: Path) -> int:
    return int(torch.load(folder / "checkpoint.pt", weights_only=True)["round"])


@pytest.fixture(scope="module")
def promptfl_data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("fl-images"), n_train=6, n_test=4)


@pytest.fixture(scope="module")
def reference(promptfl_data, fl_env, tmp_path_factory):
    """An uninterrupted PromptFL simulation: 3 clients, 3 rounds, csc, deep prompts, 2 views."""
    folder = tmp_path_factory.mktemp("fl-reference") / "run"
    overrides = [*PROMPTFL, f"data.root={promptfl_data}"]
    proc = run_tool(folder, overrides, fl_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert fl_processes(fl_env) == {}  # the tool's exit waits for its reaper (coop.federated.reaper)
    (folder.parent / "stderr.txt").write_text(proc.stderr)  # the tool's console log
    return folder, overrides


# ---------------------------------------------------------------- simulations


def test_promptfl_run_folder(reference, fl_env):
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

    # a finished run is not repeated: no Ray start, same metrics, checkpoint untouched
    mtime = (folder / "checkpoint.pt").stat().st_mtime_ns
    again = run_tool(folder, overrides, fl_env, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["accuracy"] == metrics["accuracy"]
    assert (folder / "checkpoint.pt").stat().st_mtime_ns == mtime
    assert "finished; not training again" in again.stderr


def test_the_simulation_runs_through_flwr_run(reference):
    """Flower's current entry point (`flwr run` on a simulation SuperLink of the tool's own), no
    deprecation anywhere, and the console carries the run's log.txt lines, each once."""
    folder, _ = reference
    flower = (folder / "flower.log").read_text()
    assert "Successfully started run" in flower and "Starting Flower Simulation" in flower
    console, log = (folder.parent / "stderr.txt").read_text(), (folder / "log.txt").read_text()
    assert "DEPRECATED" not in console + log + flower
    rounds = [line for line in log.splitlines() if ": accuracy " in line]
    assert len(rounds) == ROUNDS and all(console.count(line) == 1 for line in rounds)


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


def _start(folder: Path, overrides: list[str], env: dict, capture: bool = False) -> subprocess.Popen:
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(
        command(folder, overrides),
        cwd=REPO,
        env=env,
        stdout=out,
        stderr=out,
        text=True,
        start_new_session=True,  # a group of its own, which _kill_when kills
    )


def _kill_when(proc: subprocess.Popen, ready, env: dict, timeout: float = 300) -> None:
    """SIGKILL the tool `proc` (its process group) once `ready()`; then no process of its run (which
    Flower starts in sessions of their own: the SuperExec, flwr-simulation, Ray) may be left."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before it could be killed"
        assert time.monotonic() < deadline, "timed out waiting to kill the run"
        time.sleep(0.01)
    fl_processes(env)  # notes the sessions that the run's processes lead, before they may be gone
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10  # the reaper acts on the kill at once; 10 s for a loaded machine
    while left := fl_processes(env):
        assert time.monotonic() < deadline, f"processes of the killed run are left: {left}"
        time.sleep(0.05)


def test_resume_after_sigkill_at_round_boundary_and_mid_round(reference, fl_env, tmp_path):
    ref_folder, overrides = reference
    folder = tmp_path / "run"
    # 0. killed while Ray starts (before the ServerApp has begun): nothing of the run is left
    ray_starts = lambda: any("raylet" in c for c in fl_processes(fl_env).values())  # noqa: E731
    _kill_when(_start(folder, overrides, fl_env), ray_starts, fl_env)
    assert not (folder / "checkpoint.pt").exists()
    # 1. killed as soon as round 1 is checkpointed (the boundary between rounds 1 and 2; on a loaded
    #    machine the ServerApp, in a process of Flower's, may finish round 2 before the kill reaches it)
    _kill_when(_start(folder, overrides, fl_env), lambda: (folder / "checkpoint.pt").is_file(), fl_env)
    done = ckpt_round(folder)
    assert 1 <= done < ROUNDS
    # 2. resumed, then killed while the clients of the next round train
    log = folder / "log.txt"
    started = f"round {done + 1}/{ROUNDS}: training"
    before = log.read_text().count(started)
    _kill_when(_start(folder, overrides, fl_env), lambda: log.read_text().count(started) > before, fl_env)
    assert ckpt_round(folder) == done, f"the kill was meant to land inside round {done + 1}"
    size = log.stat().st_size
    time.sleep(1.5)  # the ServerApp runs in a process that Flower starts: it must have stopped too
    assert log.stat().st_size == size and ckpt_round(folder) == done
    # 3. resumed to the end: the same prompts, history and accuracy as the uninterrupted run
    proc = run_tool(folder, overrides, fl_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = torch.load(folder / "checkpoint.pt", weights_only=True)
    ref = torch.load(ref_folder / "checkpoint.pt", weights_only=True)
    assert ours["round"] == ROUNDS and ours["finished"]
    for key in ref["prompt"]:
        assert torch.equal(ours["prompt"][key], ref["prompt"][key]), key
    assert [r["accuracy"] for r in history(folder)] == [r["accuracy"] for r in history(ref_folder)]
    a, b = (json.loads((f / "metrics.json").read_text()) for f in (folder, ref_folder))
    assert a["accuracy"] == b["accuracy"] and a["per_class_accuracy"] == b["per_class_accuracy"]
    assert "resuming" in log.read_text()
