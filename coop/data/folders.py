"""Listing class folders and image files, shared by the readers that read folder trees.

Listings are sorted, so they do not depend on the file system's order, and a class folder
without images is a `DataError` naming it rather than a class that silently gets 0 images.
"""

from __future__ import annotations

import os

from coop.data.base import DataError

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})


def list_images(folder: str) -> list[str]:
    """Image file names directly inside `folder` (by extension, case-insensitive), sorted."""
    return sorted(
        e.name
        for e in os.scandir(folder)
        if e.is_file()
        and not e.name.startswith(".")
        and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS
    )


def list_class_images(folder: str, what: str) -> list[str]:
    """Like `list_images`, but a class folder without images is a DataError naming the folder.

    Args:
        folder: one class folder.
        what: the dataset (and split), for the message, e.g. "imagefolder train".
    """
    names = list_images(folder)
    if not names:
        raise DataError(f"{what} class folder has no images: {folder}")
    return names


def list_class_dirs(folder: str) -> list[str]:
    """Names of the non-hidden sub-folders of `folder`, sorted."""
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def read_wnid_classnames(path: str) -> dict[str, str]:
    """Read CoOp's ImageNet `classnames.txt` (`<wnid> <class name>` per line), in file order."""
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.strip().split(" ")
            if not parts[0]:
                continue
            if len(parts) < 2:
                raise DataError(
                    f"malformed {path} line {n}: expected '<wnid> <class name>', got {line.strip()!r}"
                )
            out[parts[0]] = " ".join(parts[1:])
    return out
