"""Atomic file writes: a reader (or a crash) never sees a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Write via `write(tmp_path)` to a temp file in the same folder, fsync, then rename over `path`.

    Args:
        path: destination; its parent folder is created.
        write: writes the content to the temporary path it is given.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
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
