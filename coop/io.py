"""Atomic file writes: a reader (or a crash) never sees a half-written file.

Files get the mode a plain `open(path, "w")` would give them (0o666 masked by the umask, e.g.
0644 under umask 022), not the 0600 of the temporary file they are written through. In a run
across ranks (torchrun, `coop.distributed`) only rank 0 writes: the other ranks compute the same
content and skip the write.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from coop import distributed

_UMASK_LOCK = threading.Lock()


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
