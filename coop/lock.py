"""One writer per run folder: an OS file lock held while a run writes its folder.

    with run_lock(folder):          # RunLockedError if another process holds it
        ...                         # train, checkpoint, write metrics

The lock is `fcntl.flock` on `<folder>/.lock`, taken without waiting. The OS drops it when the
holding process exits, however it exits (killed included), so a lock left behind never blocks a
resume: the file stays, only a live holder counts. The file records the holder's pid for the
refusal's message. Within one process the lock is re-entrant. A process may also run under a lock
that another one holds for it: the federated tool holds its folder's lock while the ServerApp, in a
process that Flower starts, writes the folder (`holder=` the tool's pid, which the ServerApp exits
with). Where `fcntl` does not exist (Windows) runs are not locked.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILE = ".lock"

_HELD: dict[str, list] = {}  # resolved folder -> [open lock file, depth] held by this process
_GUARD = threading.Lock()


class RunLockedError(RuntimeError):
    """Another live process is writing the run folder (the message names it and the pid)."""


def holder_pid(folder: str | os.PathLike) -> str:
    """The pid recorded in the folder's lock file ("unknown" if none is readable)."""
    try:
        text = (Path(folder) / LOCK_FILE).read_text().strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def _acquire(folder: Path):
    f = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 - held until released
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunLockedError(
            f"{folder} is being written by another process (pid {holder_pid(folder)}); "
            "wait for it to finish or use another output_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@contextlib.contextmanager
def run_lock(folder: str | os.PathLike, holder: int | None = None) -> Iterator[None]:
    """Hold the run folder's lock for the `with` block (the folder is created).

    Args:
        folder: the run folder (`output_dir`).
        holder: the pid of a process that holds the lock on this one's behalf: if the lock is held
            and its file names `holder`, the block runs under that lock; if it is free, it is taken.

    Raises:
        RunLockedError: another live process holds the lock; nothing waits.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    key = str(folder.resolve())
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
        else:
            try:
                _HELD[key] = [_acquire(folder), 1]
            except RunLockedError:
                if holder is None or holder_pid(folder) != str(holder):
                    raise
                _HELD[key] = [None, 1]  # `holder` holds it for this process
    try:
        yield
    finally:
        with _GUARD:
            entry = _HELD[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[key]
                if entry[0] is not None:
                    entry[0].close()  # closing the file releases the flock
