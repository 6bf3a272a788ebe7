"""One writer per run folder: an OS file lock held while a run writes its folder.

    with run_lock(folder):          # RunLockedError if another process holds it
        ...                         # train, checkpoint, write metrics

The lock is `fcntl.flock` on `<folder>/.lock`, taken without waiting. The OS drops it when the
holding process exits, however it exits (killed included), so a lock left behind never blocks a
resume: the file stays, only a live holder counts. The lock belongs to the process that took it,
not to the processes it forks: a forked child (a DataLoader worker) closes its copy of the lock's
file at once (`os.register_at_fork`), since a flock lives until the last descriptor of its file
closes, and orphaned workers of a killed run would otherwise hold it for seconds and refuse its
resume. (POSIX record locks, not inherited by fork, would be dropped whenever the holding process
closes any descriptor of the file, e.g. reading the pid back.) The file records the holder's pid for the
refusal's message. Within one process the lock is re-entrant. A process may also run under a lock
that another one holds for it: the federated tool holds its folder's lock while the ServerApp, in a
process that Flower starts, writes the folder (`holder=` the tool's pid, which the ServerApp exits
with). Where `fcntl` does not exist (Windows) runs are not locked.

The lock file also marks a folder as a run folder of ours: it stays after the run. Taking the lock
refuses a folder that is not empty and holds no `.lock` (`NotARunFolderError`), since a run writes
`config.yaml`, `log.txt` and more over what is there: a folder of the user's own files is never
overwritten. A sweep's `sweep.log` (written before its run starts) and a torchrun rank's
`log.rank<k>.txt` (its ranks k > 0 never take the lock) do not make a folder foreign; a folder
that a run wrote before runs took the lock (`config.yaml`, `log.txt` and `checkpoint.pt` together)
is a run folder too. Once the lock is held, the temporary files that a killed write left behind
are deleted (`coop.io.remove_stale_temporaries`): no other process writes the folder then.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from coop.io import remove_stale_temporaries, require_writable

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILE = ".lock"
LOCKED = "is being written by another process"  # RunLockedError's words (a sweep looks for them)
# A run folder written before runs took the lock (and left .lock behind) holds these three.
WRITTEN_BEFORE_LOCKS = {"config.yaml", "log.txt", "checkpoint.pt"}
# What may be in a folder before its first run takes the lock: the sweep's log of the run's output,
# and the log of a torchrun rank k > 0 (which writes the folder without taking the lock).
BEFORE_THE_LOCK = re.compile(r"sweep\.log|log\.rank\d+\.txt")

_HELD: dict[str, list] = {}  # resolved folder -> [open lock file, depth] held by this process
_GUARD = threading.Lock()


class RunLockedError(RuntimeError):
    """Another live process is writing the run folder (the message names it and the pid)."""


class NotARunFolderError(ValueError):
    """The folder holds files, and is not a run folder of ours (no `.lock`): it is not written."""


def is_run_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` is missing, empty, or a run folder of ours (module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        return not folder.exists()
    names = {p.name for p in folder.iterdir()}
    if LOCK_FILE in names or WRITTEN_BEFORE_LOCKS <= names:
        return True
    return all(BEFORE_THE_LOCK.fullmatch(n) for n in names)


def require_run_folder(folder: str | os.PathLike) -> Path:
    """The folder as a Path, if a run may write it: OutputError if it cannot be written (e.g. a path
    under a regular file), NotARunFolderError if it holds files that are not a run's."""
    folder = require_writable(folder, folder=True)
    if not is_run_folder(folder):
        raise NotARunFolderError(
            f"{folder} is not empty and is not a coop run folder (it has no {LOCK_FILE}); "
            "choose a new or empty folder"
        )
    return folder


def holder_pid(folder: str | os.PathLike) -> str:
    """The pid recorded in the folder's lock file ("unknown" if none is readable)."""
    try:
        text = (Path(folder) / LOCK_FILE).read_text().strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def _forget_in_child() -> None:
    """In a forked child: close its copies of the held locks' files; the parent alone holds them."""
    global _GUARD
    _GUARD = threading.Lock()  # another thread may have held it at the fork
    for entry in _HELD.values():
        if entry[0] is not None:
            entry[0].close()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _acquire(folder: Path):
    f = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 - held until released
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunLockedError(
            f"{folder} {LOCKED} (pid {holder_pid(folder)}); wait for it to finish or use another output_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def wait_for_writer(folder: str | os.PathLike) -> None:
    """Block until no process holds the folder's lock (returns at once if none does)."""
    path = Path(folder) / LOCK_FILE
    if fcntl is None or not path.is_file():  # pragma: no cover - Windows
        return
    with open(path) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # granted once the writer's exclusive lock is gone


@contextlib.contextmanager
def run_lock(folder: str | os.PathLike, holder: int | None = None) -> Iterator[None]:
    """Hold the run folder's lock for the `with` block (the folder is created).

    Args:
        folder: the run folder (`output_dir`).
        holder: the pid of a process that holds the lock on this one's behalf: if the lock is held
            and its file names `holder`, the block runs under that lock; if it is free, it is taken.

    Raises:
        RunLockedError: another live process holds the lock; nothing waits.
        OutputError, NotARunFolderError: the folder cannot be written, or is not a run folder
            (`require_run_folder`).
    """
    folder = Path(folder)
    key = str(folder.resolve())
    if key not in _HELD:  # this process does not hold it yet
        require_run_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
        else:
            try:
                _HELD[key] = [_acquire(folder), 1]
                remove_stale_temporaries(folder)  # ours alone now
            except RunLockedError:
                if holder is None or holder_pid(folder) != str(holder):
                    raise
                _HELD[key] = [None, 1]  # `holder` holds it for this process
    try:
        yield
    finally:
        with _GUARD:
            entry = _HELD.get(key)  # None in a forked child leaving its parent's block: never held
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del _HELD[key]
                    if entry[0] is not None:
                        entry[0].close()  # closing the file releases the flock
