"""CIFAR-10 and CIFAR-100 (the CIFAR protocols of FedOTP and FedPGP), read by torchvision from the
python-version folders in the DATA folder; nothing is downloaded:

    DATA/cifar-10-batches-py/   data_batch_1..5, test_batch, batches.meta    (cifar-10-python.tar.gz)
    DATA/cifar-100-python/      train, test, meta                             (cifar-100-python.tar.gz)

`torchvision.datasets.CIFAR10`/`CIFAR100(root=DATA, download=False)` read the arrays (and check the
files' MD5 sums). Our pipeline reads images from files, so the first read writes every image once
as a PNG under `<folder>/png/{train,test}/<label>/<index>.png` (each split into a temporary folder,
then renamed: concurrent readers never see half a split) and lists them in index order. Splits:
train = the 50,000 training images, test = the 10,000 test images, no val (the originals test on
the test split). Class names come from the meta file (CIFAR-100's fine labels, e.g.
"aquarium_fish"; prompts read `_` as a space).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from coop.data.base import DataError, Datum, Source, require_dir, require_root

CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
PNG_DIR = "png"


def _torchvision_class(name: str):
    from torchvision.datasets import CIFAR10, CIFAR100

    return CIFAR10 if name == "cifar10" else CIFAR100


def cifar_files(name: str) -> list[str]:
    """The files of the python-version folder that torchvision reads (its own lists)."""
    cls = _torchvision_class(name)
    return [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]


def _torchvision_split(root: str, name: str, train: bool):
    cls = _torchvision_class(name)
    try:
        return cls(root, train=train, download=False)
    except RuntimeError as e:  # "Dataset not found or corrupted"
        raise DataError(
            f"{name}: torchvision cannot read {os.path.join(root, CIFAR_FOLDERS[name])} ({e}); extract "
            f"the python version ({CIFAR_FOLDERS[name]}/) into the DATA folder"
        ) from None


def _write_pngs(split, target: str) -> None:
    """Every image of a torchvision split as <target>/<label>/<index>.png, atomically."""
    from PIL import Image

    parent = os.path.dirname(target)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        for i, (pixels, label) in enumerate(zip(split.data, split.targets, strict=True)):
            folder = os.path.join(tmp, str(label))
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep its copy
            if not os.path.isdir(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_cifar(root, name: str, write: bool = True) -> Source:
    """CIFAR-10 or CIFAR-100 (`name`) from the DATA folder `root` (module docstring).

    Args:
        root: the DATA folder.
        name: "cifar10" or "cifar100".
        write: write the PNGs if they are not there yet (False: list them only, for the data doctor).

    Raises:
        DataError: the python-version folder is missing or torchvision refuses its files.
    """
    root = require_root(root)
    folder = require_dir(os.path.join(root, CIFAR_FOLDERS[name]), f"{name} folder ({CIFAR_FOLDERS[name]})")
    png = os.path.join(folder, PNG_DIR)
    if write:
        os.makedirs(png, exist_ok=True)
    splits, classnames = {}, None
    for split, train in (("train", True), ("test", False)):
        target = os.path.join(png, split)
        data = _torchvision_split(root, name, train)
        classnames = list(data.classes)
        if write and not os.path.isdir(target):
            _write_pngs(data, target)
        splits[split] = [
            Datum(os.path.join(target, str(y), f"{i}.png"), int(y), classnames[y])
            for i, y in enumerate(data.targets)
        ]
    return Source(name, png, classnames, splits["train"], [], splits["test"], dataset_dir=folder)
