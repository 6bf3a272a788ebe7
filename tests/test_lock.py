"""One writer per run folder (`coop.train.lock`): a live holder refuses a second process in one line
naming the folder and its pid; a lock left by a killed process never blocks a resume."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, fork_tool, run_tool_in_process, tiny_args

sys.path.insert(0, str(REPO / "tools"))
import _cli  # noqa: E402

from coop.train.lock import LOCK_FILE, RunLockedError, run_lock  # noqa: E402

HOLD = """
import fcntl, os, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])  # coop.train.lock's protocol, without importing coop (torch): flock on .lock
folder.mkdir(parents=True, exist_ok=True)
f = open(folder / ".lock", "a+")
fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
f.seek(0); f.truncate(); f.write(f"{os.getpid()}\\n"); f.flush()
print("held", flush=True)
time.sleep(120)
"""


def hold_lock(folder):
    """A child process that takes the folder's lock and sleeps; returns once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
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
    from coop.config.load import load_config
    from coop.train.runner import train_run

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


def test_a_sweep_point_that_another_process_writes_takes_the_folders_outcome(tmp_path, image_folder):
    """Two sweeps on one root: the worker whose run another process is writing (the sweep's own
    worker loop and a real tools/train.py, refused in one line) waits for that writer, then reads
    the outcome from the run folder: finished there means finished, not a failure."""
    import threading
    import time

    from coop.train import sweep as sweep_lib
    from coop.train.grid import load_grid

    keys = [k for k in tiny_args(image_folder, tmp_path / "unused") if not k.startswith("output_dir=")]
    (run,) = sweep_lib.plan(load_grid(None, keys), tmp_path / "runs")
    proc = hold_lock(run.folder)
    log_file = run.folder / "sweep.log"

    def other_sweep_finishes():  # once our train.py was refused, the writer finishes the run
        while "error:" not in (log_file.read_text() if log_file.is_file() else ""):
            time.sleep(0.05)
        (run.folder / "metrics.json").write_text("{}")
        proc.send_signal(signal.SIGKILL)

    other = threading.Thread(target=other_sweep_finishes, daemon=True)
    other.start()
    try:
        cmd = sweep_lib.train_command(run, REPO / "tools" / "train.py", None)
        sweep_lib.run_processes([run], [cmd], jobs=1, gpus=[], echo=False)
    finally:
        other.join(timeout=300)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert log_file.read_text().strip().splitlines()[-1].startswith(f"error: {run.folder} is being written")
    assert (run.returncode, run.error) == (0, "")


def test_a_sweep_point_whose_other_writer_stopped_is_a_failure_naming_the_refusal(tmp_path):
    """The writer released the folder without metrics.json: the point failed; the message is this
    command's own last line, never another sweep's line in the shared sweep.log."""
    from coop.train import sweep as sweep_lib

    run = sweep_lib.Run([], {}, tmp_path / "run")
    run.folder.mkdir()
    (run.folder / "sweep.log").write_text("error: a line of the other sweep\n")
    refusal = f"error: {run.folder} is being written by another process (pid 7); wait for it to finish"
    sweep_lib.finish_run(run, 2, output=f"starting\n{refusal}\n".encode())
    assert run.returncode == 2
    assert run.error == f"another process was writing it and stopped before it finished ({refusal})"
    sweep_lib.finish_run(run, 1, output=b"Traceback ...\nValueError: boom\n")
    assert (run.returncode, run.error) == (1, "exit code 1: ValueError: boom")


def forked_children(pid: int) -> list[int]:
    """The live processes that `pid` forked (its DataLoader workers, for a training run): children
    running the same executable, so a helper program it ran (`ldconfig`, say) is left out."""
    found, exe = [], os.path.realpath(f"/proc/{pid}/exe")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
            same_program = os.path.realpath(stat.parent / "exe") == exe
        except OSError:
            continue
        if fields[1] == str(pid) and fields[0] != "Z" and same_program:
            found.append(int(stat.parent.name))
    return found


def open_files(pid: int) -> set[str]:
    """The files `pid` has open (empty once it has exited)."""
    targets = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                targets.add(os.readlink(fd))
    return targets


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads processes from /proc")
def test_a_rerun_right_after_sigkill_of_a_run_with_loader_workers_resumes(tmp_path, image_folder):
    """kill -9 of a run while its DataLoader workers live, and the same command at once: the
    orphaned workers (forked with the lock's file open) must not hold the folder's lock, so the
    rerun is not refused but resumes and finishes.

    An orphaned worker exits as soon as it notices its parent is gone, which on a fast machine can
    be before the rerun starts; so the run and its workers are stopped (SIGSTOP: alive, every
    descriptor kept) the moment a worker appears, each worker running on only until fork's handler
    has dropped its copy of the lock's descriptor, and the kill comes to the stopped run."""
    import time

    out = tmp_path / "run"
    args = tiny_args(image_folder, out, **{"data.num_workers": 2, "train.epochs": 2})
    run = fork_tool([sys.executable, str(REPO / "tools" / "train.py"), *args])  # a process of its own
    lock = str((out / LOCK_FILE).resolve())
    deadline, workers = time.time() + 300, []
    try:
        while not workers and time.time() < deadline:
            if os.waitpid(run, os.WNOHANG)[0]:
                run = None  # it ended (and is reaped) without our seeing a loader worker
                break
            workers = forked_children(run)  # the loader workers that compute the image features
            time.sleep(0.002)
        assert workers, "the run had no loader workers"
        for pid in (run, *workers):
            os.kill(pid, signal.SIGSTOP)
        handlers_deadline = time.time() + 30
        while (holding := [w for w in workers if lock in open_files(w)]) and time.time() < handlers_deadline:
            for w in holding:  # forked a moment ago: let it run fork's handlers
                os.kill(w, signal.SIGCONT)
            time.sleep(0.005)
            for w in holding:
                os.kill(w, signal.SIGSTOP)
        assert not holding, "a loader worker kept the lock's descriptor"
        os.kill(run, signal.SIGKILL)
        os.waitpid(run, 0)
        run = None
        assert all(alive(w) for w in workers)
        res = run_tool_in_process(REPO / "tools" / "train.py", args)
        assert res.returncode == 0, res.stderr[-2000:]
        assert (out / "metrics.json").is_file()
    finally:
        if run is not None:
            os.kill(run, signal.SIGKILL)
            os.waitpid(run, 0)
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


def test_a_forked_child_does_not_hold_the_lock(tmp_path):
    """A process forked under the lock (as a DataLoader worker is) holds no copy of it: once the
    parent leaves its block, the folder is free while the child still lives."""
    import fcntl

    folder = tmp_path / "run"
    (ready, started), (wait, go) = os.pipe(), os.pipe()
    with run_lock(folder):
        pid = os.fork()
        if pid == 0:  # the child (fork's handlers have run): say so, wait for the parent, exit
            os.write(started, b"x")
            os.read(wait, 1)
            os._exit(0)
        os.read(ready, 1)
    try:
        with open(folder / LOCK_FILE) as f:  # another holder takes it while the child lives
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.write(go, b"x")
        os.waitpid(pid, 0)
        for fd in (ready, started, wait, go):
            os.close(fd)


def test_a_forked_tool_killed_while_drawing_a_bar_leaves_this_process_free_to_draw(tmp_path):
    """`fork_tool`'s child takes tqdm's write lock (a bar being drawn) and is SIGKILLed holding it:
    this process can still take the lock (tqdm's default one holds a semaphore shared across fork)."""
    import threading
    import time

    import tqdm

    lock, drawn = tqdm.tqdm.get_lock(), threading.Event()  # this process has drawn bars before
    held = tmp_path / "held"
    code = "import sys, time, tqdm\ntqdm.tqdm.get_lock().acquire()\nopen(sys.argv[1], 'w').close()\ntime.sleep(60)"
    pid = fork_tool([sys.executable, "-c", code, str(held)])
    deadline = time.monotonic() + 60
    while not held.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert held.exists(), "the forked child never took the lock"

    def draw() -> None:
        with lock:
            drawn.set()

    threading.Thread(target=draw, daemon=True).start()  # a thread: a lock left taken blocks for good
    assert drawn.wait(10), "a killed child left tqdm's write lock taken"
