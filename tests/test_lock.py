"""One writer per run folder (`coop.lock`): a live holder refuses a second process in one line
naming the folder and its pid; a lock left by a killed process never blocks a resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO, tiny_args

sys.path.insert(0, str(REPO / "tools"))
import _cli  # noqa: E402

from coop.lock import LOCK_FILE, RunLockedError, run_lock  # noqa: E402

HOLD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("lock", sys.argv[2])  # coop.lock alone: no torch import
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
with lock.run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def hold_lock(folder):
    """A child process that takes the folder's lock and sleeps; returns once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), str(REPO / "coop" / "lock.py")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_live_holder_refuses_and_killed_holder_does_not_block(tmp_path):
    folder = tmp_path / "run"
    proc = hold_lock(folder)
    try:
        with pytest.raises(RunLockedError) as e, run_lock(folder):
            pass
        message = str(e.value)
        assert "\n" not in message and str(folder) in message and f"pid {proc.pid}" in message
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (folder / LOCK_FILE).read_text().strip() == str(proc.pid)  # the stale lock file stays
    with run_lock(folder):  # ... and does not block
        assert (folder / LOCK_FILE).read_text().strip() == str(os.getpid())
        with run_lock(folder):  # re-entrant in one process
            pass


def test_a_process_runs_under_the_lock_its_holder_holds_for_it(tmp_path):
    """The federated ServerApp runs in a process that Flower starts, under its tool's lock: named as
    the holder, the live holder lets it in; any other holder still refuses."""
    folder = tmp_path / "run"
    proc = hold_lock(folder)
    try:
        with run_lock(folder, holder=proc.pid):
            assert (folder / LOCK_FILE).read_text().strip() == str(proc.pid)  # not taken over
        with pytest.raises(RunLockedError), run_lock(folder, holder=proc.pid + 1):
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with run_lock(folder, holder=proc.pid):  # the holder is gone: the lock is free and taken
        assert (folder / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_second_train_run_refuses_before_writing(tmp_path, image_folder):
    """train_run on a folder that another live process writes: RunLockedError (a one-line
    bad-input error of the tools), nothing trained or written."""
    from coop.config import load_config
    from coop.runner import train_run

    out = tmp_path / "run"
    proc = hold_lock(out)
    try:
        with pytest.raises(RunLockedError, match=f"pid {proc.pid}") as e:
            train_run(load_config(None, tiny_args(image_folder, out)))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert isinstance(e.value, _cli.bad_input_errors())  # tools print it as one line, exit 2
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


def test_sweep_point_on_a_locked_run_fails_in_one_line(tmp_path, image_folder):
    """A sweep worker that picks a run another process is writing fails that point at once (the
    sweep's own worker loop and a real tools/train.py)."""
    from coop import sweep as sweep_lib

    keys = [k for k in tiny_args(image_folder, tmp_path / "unused") if not k.startswith("output_dir=")]
    (run,) = sweep_lib.plan(sweep_lib.load_grid(None, keys), tmp_path / "runs")
    proc = hold_lock(run.folder)
    try:
        cmd = sweep_lib.train_command(run, REPO / "tools" / "train.py", None)
        sweep_lib.run_processes([run], [cmd], jobs=1, gpus=[], echo=False)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert run.returncode == 2
    # the sweep records the failure with the tail of that one line
    assert run.error.startswith("exit code 2: ")
    assert run.error.endswith(f"seed1 is being written by another process (pid {proc.pid}); "
                              "wait for it to finish or use another output_dir")  # fmt: skip
    assert (
        (run.folder / "sweep.log").read_text().strip().splitlines()[-1].startswith(f"error: {run.folder} is")
    )
    assert not (run.folder / "metrics.json").exists()
