"""The suite's one real Flower simulation: tools/federated.py as a user runs it, through `flwr run`
on a SuperLink of its own, Ray running the clients, its Ray actor and then the tool SIGKILLed, and
the same command resumed to the end. Each launch costs a SuperLink, `flwr run` and Ray (30-50 s on
2 CPU cores), so this one run carries every check of Flower's processes; the federated logic runs
in one process elsewhere (tests/local_grid.py, test_federated.py, test_personal_fl.py)."""

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

from conftest import REPO, fl_processes, make_image_folder, noting_fl_sessions  # noqa: E402
from local_grid import LocalGrid, run_inprocess  # noqa: E402
from test_personal_fl import BASE, client_personal  # noqa: E402


def command(folder: Path, overrides: list[str]) -> list[str]:
    # one Ray actor (~1 GB) runs the clients in turn, whatever the machine's cores: on 2 cores that
    # starts faster than two, and on a machine that others use too, memory is what runs out first
    tool = [sys.executable, str(REPO / "tools" / "federated.py"), "--cpus-per-client", "1", "--num-cpus", "1"]
    return [*tool, *overrides, f"output_dir={folder}"]


def _start(folder: Path, overrides: list[str], env: dict, console: Path) -> subprocess.Popen:
    with console.open("w") as out:  # a file, not a pipe: what the tool wrote stays after a SIGKILL
        return subprocess.Popen(
            command(folder, overrides),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a group of its own, which _kill_when kills
        )


def _wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _kill(proc: subprocess.Popen, env: dict) -> dict[int, str]:
    """SIGKILL the tool `proc` (its process group); then no process of its run (which Flower starts
    in sessions of their own: the SuperExec, flwr-simulation, Ray) may be left. Returns the run's
    processes at the kill."""
    running = fl_processes(env)  # also notes the sessions that they lead, before they may be gone
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10  # the reaper acts on the kill at once; 10 s for a loaded machine
    while left := fl_processes(env):
        assert time.monotonic() < deadline, f"processes of the killed run are left: {left}"
        time.sleep(0.05)
    return running


def read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def rows(folder: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k != "time_s"} for r in csv.DictReader((folder / "history.csv").open())
    ]


def ckpt_round(folder: Path) -> int:
    return int(torch.load(folder / "checkpoint.pt", weights_only=True)["round"])


def test_a_simulation_killed_and_resumed_equals_the_in_process_run(fl_env, tmp_path, monkeypatch):
    """FedOTP (QUERY, TRAIN and EVALUATE messages; personal tensors in state files that Ray's actors
    write), 2 clients, 3 rounds, fl.fraction=0.5 after round 1:

    1. inside round 1 the Ray actor that runs the clients is SIGKILLed (what Ray's memory monitor or
       the OOM killer do): the client whose message it ran, or was sent next, fails for the round,
       with one line naming the actor on the console and in log.txt (Flower's traceback and Ray's
       text go to flower.log), and a new actor runs the rest (`coop.federated.ray_pool`);
    2. once round 2 trains, the tool is SIGKILLed: no process of its run is left (the reaper:
       SuperLink, SuperExec, flwr-simulation, Ray's raylet and actor), and log.txt stops growing;
    3. the same command resumes to the end through `flwr run` (no deprecation anywhere; the console
       carries the run's new log.txt lines, each once) and leaves no process behind.

    The result equals the run on the in-process grid in which that client fails round 1: global and
    personal tensors, history, metrics and the failure's line."""
    root = make_image_folder(tmp_path / "four", classes=("r", "g", "b", "y"), n_train=5, n_test=3)
    overrides = [
        *BASE,
        f"data.root={root}",
        "fl.method=fedotp",
        "fl.rounds=3",
        "fl.fraction=0.5",
        "prompt.n_ctx=4",
    ]
    folder, console = tmp_path / "ray", tmp_path / "console1.txt"
    log, flower = folder / "log.txt", folder / "flower.log"

    proc = _start(folder, overrides, fl_env, console)
    with noting_fl_sessions(fl_env):
        _wait_for(proc, lambda: "round 1/3: training" in read(log), "round 1")
        [actor] = [pid for pid, cmd in fl_processes(fl_env).items() if cmd.startswith("ray::ClientAppActor")]
        os.kill(actor, signal.SIGKILL)
        error = f"its Ray actor (pid {actor}) died (SYSTEM_ERROR); a new actor takes its place"
        lost = f"failed: {error}"
        _wait_for(proc, lambda: "round 2/3: training" in read(log) and lost in read(console), "round 2")
        running = _kill(proc, fl_env)
    commands = list(running.values())
    assert any("raylet" in c for c in commands) and any(c.startswith("ray::ClientAppActor") for c in commands)
    assert actor not in running  # a new actor took its place
    assert ckpt_round(folder) in (1, 2) and not (folder / "metrics.json").exists()
    size = log.stat().st_size
    time.sleep(1.5)  # the ServerApp runs in a process that Flower starts: it must have stopped too
    assert log.stat().st_size == size
    first = read(console)
    for text in (first, read(log)):  # the console and log.txt: that one line, none of Ray's
        assert text.count(lost) == 1, text[-3000:]
        assert "Traceback" not in text and "ray.exceptions" not in text
    flower_log = read(flower)  # Flower's traceback and Ray's text stay there
    assert "Traceback" in flower_log and f"Exception ActorLost occurred. Message: {error}" in flower_log

    with noting_fl_sessions(fl_env):  # for fl_processes after the run
        resumed = subprocess.run(
            command(folder, overrides), capture_output=True, text=True, cwd=REPO, env=fl_env, timeout=600
        )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert fl_processes(fl_env) == {}  # the tool's exit waits for its reaper (coop.federated.reaper)
    new_lines = read(log)[size:]
    assert "resuming" in new_lines
    rounds = [line for line in new_lines.splitlines() if ": accuracy " in line]
    assert rounds and all(resumed.stderr.count(line) == 1 for line in rounds)
    flower_log = read(flower)  # both launches went through `flwr run`
    assert flower_log.count("Successfully started run") == 2 and "Starting Flower Simulation" in flower_log
    assert "DEPRECATED" not in first + resumed.stderr + read(log) + flower_log

    metrics = json.loads((folder / "metrics.json").read_text())
    [failure] = metrics["client_failures"]
    assert failure["round"] == 1 and failure["error"] == error
    monkeypatch.setenv("COOP_CACHE_DIR", fl_env["COOP_CACHE_DIR"])
    errors = {(1, failure["client"]): failure["error"]}
    run_inprocess(tmp_path / "local", overrides, LocalGrid(2, errors=errors))
    ray, ref = (torch.load(tmp_path / f / "checkpoint.pt", weights_only=True) for f in ("ray", "local"))
    assert set(ray["prompt"]) == {"global.ctx"}
    assert torch.equal(ray["prompt"]["global.ctx"], ref["prompt"]["global.ctx"])
    assert ray["strategy"]["personal_round"] == ref["strategy"]["personal_round"]
    for k in (0, 1):  # from each run's client state files (the Ray actors wrote theirs)
        ours, theirs = (client_personal(tmp_path / f, k) for f in ("ray", "local"))
        assert set(ours) == {"local.ctx"} and torch.equal(ours["local.ctx"], theirs["local.ctx"])
    assert rows(folder) == rows(tmp_path / "local")  # the failed client, sampling, bytes, accuracies
    assert [r["failed"] for r in rows(folder)] == [str(failure["client"]), "", ""]
    assert metrics == json.loads((tmp_path / "local" / "metrics.json").read_text())
