"""Atomic file writes: a reader (or a crash) never sees a half-written file; output places checked
before any work (`require_writable`), and what a killed write leaves behind (`remove_stale_temporaries`).

Files get the mode a plain `open(path, "w")` would give them (0o666 masked by the umask, e.g.
0644 under umask 022), not the 0600 of the temporary file they are written through. In a run
across ranks (torchrun, `coop.distributed`) only rank 0 writes: the other ranks compute the same
content and skip the write.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from coop import distributed

_UMASK_LOCK = threading.Lock()
# `atomic_write`'s temporary files: ".<name>.<8 characters of mkstemp>.tmp"
TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


class OutputError(ValueError):
    """An output file or folder cannot be written there (the one-line message names the path)."""


def require_writable(path: str | os.PathLike, folder: bool = False) -> Path:
    """OutputError unless `path` (a file, or with `folder` a folder) can be created or overwritten.

    Checked before any work, so that a tool never computes for minutes and then fails to save: the
    nearest existing ancestor must be a folder this process may write into (`os.access`, which also
    sees a read-only file system), and `path` itself, if it exists, a file (a folder with `folder`).

    Args:
        path: the file or folder to write.
        folder: whether `path` is a folder (created with its parents) rather than a file.
    Returns:
        `path` as a Path.
    """
    path = Path(path).expanduser()
    if path.exists():
        if folder and not path.is_dir():
            raise OutputError(f"cannot write into {path}: it is a file, not a folder")
        if not folder and path.is_dir():
            raise OutputError(f"cannot write {path}: it is a folder")
        where = path if folder else path.parent
    else:
        where = path.parent
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            raise OutputError(f"cannot write {path}: {where} is a file, not a folder")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: {where} is not writable")
    return path


def refused_unpickling(path: str | os.PathLike, error: BaseException) -> str | None:
    """One line for a file that `torch.load(weights_only=True)` refused to unpickle, naming the
    global it asked for; None if `error` is another failure. Torch's own message suggests turning
    the safety off (weights_only=False); this one never does."""
    text = str(error)
    wanted = re.search(r"GLOBAL (\S+)", text) or re.search(r"unrecognized function (\S+)", text)
    if not wanted and ("Weights only load failed" not in text or not _looks_pickled(path)):
        return None  # random bytes fail in the unpickler too: that is not a refusal
    what = f"it asks for {wanted.group(1)}" if wanted else "it holds more than tensors and plain data"
    return (
        f"{path} needs arbitrary unpickling to load ({what}); refused: only tensors and plain data "
        "are read (torch.load weights_only=True)"
    )


def _looks_pickled(path: str | os.PathLike) -> bool:
    """Whether a file starts as torch.save's zip archive or a pickle (protocol 2+) does."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that writes killed mid-way (kill -9) left in `folder` and its
    subfolders. Call it only while no other process writes there (under the run folder's lock).
    Returns the files removed."""
    removed = []
    for path in Path(folder).rglob(".*.tmp"):
        if TEMPORARY.match(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # os.umask can only be read by setting it: set and restore under a lock, so no other
    # thread of ours writes a file in between with a wrong mask
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Write via `write(tmp_path)` to a temp file in the same folder, fsync, then rename over `path`.

    Args:
        path: destination; its parent folder is created.
        write: writes the content to the temporary path it is given.
    """
    if not distributed.is_main():  # under torchrun, rank 0 alone writes (run folders, caches)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp made it 0600
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    """Write `obj` as indented JSON to `path`, atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    atomic_write(path, write)
