"""The simulation's reaper: when the tool that started a run ends, however it ends, every process
of the run ends too.

    with reaped(marker):          # in the tool; the run's processes get RUN_VAR=marker
        ...                       # start and run them
    # here (or when the tool dies) the reaper has killed them all

`reaped` starts `python -I -S coop/federated/reaper.py MARKER`, whose stdin is a pipe whose other
end the tool holds.

Every process of a run carries the environment variable `COOP_FL_RUN=MARKER` (`RUN_VAR`), which
`coop.federated.simulation.simulate` sets for the SuperLink and `flwr run`, and which their
descendants inherit: the SuperExec, `flwr-simulation`, Ray's GCS, raylet, agents and actors; and
the SuperExec leads a session that holds all the processes under it (`scan`). The reaper waits
for EOF on its stdin, noting the sessions that marked processes lead every 0.5 s (the leader's pid
and start time); EOF comes when the tool closes the pipe at the end of the run or when the kernel
closes it because the tool died (SIGKILL included); then it SIGKILLs every process that carries the
marker or is in one of those sessions, until none is left, and exits. A session id is the leader's
pid, which Linux hands out again once no process is left in the session: a noted session whose id
another process leads now (another start time) is not the run's, and is spared.

It is a process of its own, in a session of its own, because nothing inside the run can do this:
- Flower starts the SuperExec in a new session: neither the tool's process group nor
  PR_SET_PDEATHSIG (the tool's children only) reaches it, `flwr-simulation` or Ray's processes.
- Flower's guards are threads: the SuperExec and `flwr-simulation` each poll their parent and
  `signal.raise_signal(SIGINT)` when it is gone; the signal goes to the polling thread, and
  `flwr-simulation`'s main thread, blocked in a thread join for the whole run, never handles it.
- A watcher thread of our own in `flwr-simulation` (the ServerApp watched the tool's pid through a
  pidfd) cannot act before the ServerApp has started (a tool killed while Ray starts), nor once
  `flwr-simulation` heads for its own exit after the ServerApp returned or failed: Python stops
  daemon threads when it finalizes, so a process whose exit hangs or crawls (Ray's shutdown on a
  machine short of memory) keeps running with Ray's processes, which die only with it. Measured
  on a loaded machine: after normal ends, `flwr-simulation` and the actor (2.3 GB) still ran 2-10 s
  after the tool had exited; in the report that led to this, 920 MB ran on for 35 minutes.

Standard library only: it runs as a script, without importing coop or torch (`-S`: no site-packages).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping

RUN_VAR = "COOP_FL_RUN"


def _stat(pid: str) -> tuple[bytes, int, int]:
    """(state, session id, start time in clock ticks after boot) of a process: fields 3, 6 and 22 of
    /proc/<pid>/stat, counted after the command name (which may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return fields[0], int(fields[3]), int(fields[19])


def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot), None if there is none."""
    try:
        return _stat(str(pid))[2]
    except (OSError, ValueError, IndexError):
        return None


def scan(
    marker: str, var: str = RUN_VAR, sessions: Mapping[int, int] | None = None
) -> tuple[list[int], dict[int, int]]:
    """(the pids of the run's live processes, the run's sessions: {session id: its leader's start time}).

    A process is the run's if its environment holds var=marker or it is in one of `sessions` (noted by
    an earlier scan). The environment alone misses some: Ray's workers and agents set their process
    title (`ray::DashboardAgent`), which overwrites the start of the memory that /proc/<pid>/environ
    shows, and with it, depending on where Ray put it, the marker. They stay in the session of the
    SuperExec, which Flower starts as a session leader, marked. A noted session stays the run's while
    its leader is the process noted (the same start time) or has exited (Linux gives its pid to no new
    process while any process is in the session); once another process has that pid, the session id
    was reused by someone else, and the session is dropped. The run's sessions returned are those
    still the run's and those that marked processes lead now. (Linux /proc; zombies are not in the pids.)
    """
    entry, procs = f"{var}={marker}".encode(), {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:  # no procfs: nothing found
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            state, sid, start = _stat(name)
        except (OSError, ValueError, IndexError):  # gone
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                marked = entry in f.read().split(b"\0")
        except OSError:  # gone, or another user's (it still leads its session, if it does)
            marked = False
        procs[int(name)] = (state, sid, start, marked)
    ours = {sid: t for sid, t in (sessions or {}).items() if sid not in procs or procs[sid][2] == t}
    ours.update((pid, start) for pid, (_, sid, start, marked) in procs.items() if marked and sid == pid)
    pids = [
        pid for pid, (state, sid, _, marked) in procs.items() if state != b"Z" and (marked or sid in ours)
    ]
    return pids, ours


def end_run(marker: str, sessions: Mapping[int, int] | None = None, timeout: float = 20.0) -> int:
    """SIGKILL every process of the run (`scan`) until two scans in a row find none; returns how
    many were killed. A process that forks while it is being killed is found by the next scan."""
    killed, empty, deadline = set(), 0, time.monotonic() + timeout
    while empty < 2 and time.monotonic() < deadline:
        pids, sessions = scan(marker, sessions=sessions)
        empty = 0 if pids else empty + 1
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.05)
    return len(killed)


@contextlib.contextmanager
def reaped(marker: str) -> Iterator[None]:
    """Start the reaper of the run whose processes carry `marker`; when the block ends (or this
    process dies, which closes the pipe) it ends them all, and the block's end waits for it."""
    read, write = os.pipe()  # not inherited by the run's processes: only the reaper holds the read end
    env = {k: v for k, v in os.environ.items() if k != RUN_VAR}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), marker], stdin=read, env=env,
        start_new_session=True,
    )  # fmt: skip  # its own session: a signal to the tool's group (Ctrl-C, a test's kill) spares it
    os.close(read)
    try:
        yield
    finally:
        os.close(write)  # EOF: the reaper kills every process of the run
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:  # it was killed itself: do its work here
            end_run(marker)


def main() -> int:
    marker = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the tool, which closes the pipe
    sessions: dict[int, int] = {}  # noted while the run goes: their leaders may be gone at its end
    while True:  # until EOF: the tool closed the pipe or died
        if select.select([0], [], [], 0.5)[0] and not os.read(0, 4096):
            break
        sessions = scan(marker, sessions=sessions)[1]
    end_run(marker, sessions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
