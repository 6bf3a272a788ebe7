"""Custom datasets in CoOp's split format: a folder of class sub-folders -> a split JSON file.

    split = make_split("/data/my_set", val=0.2, test=0.3, seed=1)
    write_json("my_set_split.json", split)
    # then: data.name=imagefolder data.root=/data/my_set data.split_file=my_set_split.json

The file has CoOp's format (`split_zhou_*.json`): `{"train": [...], "val": [...], "test": [...]}`,
each item `[path relative to the folder, label, class name]`. Labels are the sorted class-folder
names' indices and the class name is the folder name, as `imagefolder` reads a train/test tree.

The split is stratified: every class is divided on its own, `round(n * test)` test images,
`round(n * val)` val images (at least one each when the fraction is above 0) and the rest train.
Which images go where is deterministic in `seed` and the class name alone (a `random.Random`
seeded by both shuffles the sorted file names), so adding a class does not move the images of
the others. A class folder without images, or with too few for the requested split, is a
one-line `DataError` naming it. The few-shot cache folder (`split_fewshot/`) is never a class.
"""

from __future__ import annotations

import math
import os
import random

from coop.data.base import DataError, require_dir
from coop.data.fewshot import FEWSHOT_DIR
from coop.data.folders import list_class_dirs, list_images

SPLITS = ("train", "val", "test")


def split_sizes(n: int, val: float, test: float) -> tuple[int, int, int]:
    """(train, val, test) sizes for a class of `n` images; a fraction above 0 gets at least 1."""

    def part(fraction: float) -> int:
        return max(1, math.floor(n * fraction + 0.5)) if fraction > 0 else 0

    n_val, n_test = part(val), part(test)
    return n - n_val - n_test, n_val, n_test


def check_fractions(val: float, test: float) -> None:
    """DataError unless 0 <= val, 0 < test and val + test < 1 (some images must train)."""
    if not (0 <= val < 1 and 0 < test < 1 and val + test < 1):
        raise DataError(
            f"split fractions must satisfy 0 <= val, 0 < test, val + test < 1; got val={val}, test={test}"
        )


def make_split(folder, val: float = 0.2, test: float = 0.3, seed: int = 1) -> dict[str, list[list]]:
    """A stratified CoOp split of `folder/<class>/*` images.

    Args:
        folder: the folder holding one sub-folder per class.
        val: fraction of each class for the val split (0 for none).
        test: fraction of each class for the test split.
        seed: the shuffling seed.

    Returns:
        {"train": items, "val": items, "test": items}, items `[relative path, label, class]`
        sorted by path within each class, classes in label order.

    Raises:
        DataError: a missing folder, no class folders, a class without images, or a class too
            small for every split to get an image.
    """
    check_fractions(val, test)
    folder = require_dir(folder, "dataset folder")
    classes = [c for c in list_class_dirs(folder) if c != FEWSHOT_DIR]
    if not classes:
        raise DataError(f"dataset folder has no class sub-folders: {folder}")
    out: dict[str, list[list]] = {s: [] for s in SPLITS}
    for label, name in enumerate(classes):
        files = list_images(os.path.join(folder, name))
        if not files:
            raise DataError(f"class {name!r} has no images: {os.path.join(folder, name)}")
        n_train, n_val, n_test = split_sizes(len(files), val, test)
        if n_train < 1:
            raise DataError(
                f"class {name!r} has {len(files)} image(s), too few for val={val} test={test} "
                f"(each split needs one per class): {os.path.join(folder, name)}"
            )
        random.Random(f"{seed}/{name}").shuffle(files)  # str seeds are stable across processes
        parts = {
            "test": files[:n_test],
            "val": files[n_test : n_test + n_val],
            "train": files[n_test + n_val :],
        }
        for split, names in parts.items():
            out[split] += [[f"{name}/{f}", label, name] for f in sorted(names)]
    return out
