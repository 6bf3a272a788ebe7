"""CIFAR-10/100 readers on torchvision's python-version folders (generated here: tiny arrays in the
same pickles, torchvision's MD5 check patched out), the PNGs they write once, and the data doctor."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from PIL import Image

from coop.data import build_dataset
from coop.data.doctor import check_dataset

NAMES = ["airplane", "automobile", "bird"]


def make_cifar10(root, per_batch: int = 4, n_test: int = 5):
    """DATA/cifar-10-batches-py/ with 5 train batches of `per_batch` images and a test batch."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    gen = np.random.RandomState(0)
    arrays = {}
    for name, n in [*((f"data_batch_{i}", per_batch) for i in range(1, 6)), ("test_batch", n_test)]:
        data = gen.randint(0, 256, size=(n, 3 * 32 * 32), dtype=np.uint8)
        labels = [int(y) for y in gen.randint(len(NAMES), size=n)]
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels}, f)
        arrays[name] = (data, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": NAMES}, f)
    return arrays


@pytest.fixture
def cifar10(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)  # our files are not the real ones
    return tmp_path, make_cifar10(tmp_path)


def test_cifar10_reads_torchvisions_folder_and_writes_pngs_once(cifar10):
    root, arrays = cifar10
    ds = build_dataset("cifar10", root)
    assert ds.classnames == NAMES and not ds.val
    train_labels = sum((arrays[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert [d.label for d in ds.train] == train_labels and [d.label for d in ds.test] == arrays["test_batch"][
        1
    ]
    data, _ = arrays["test_batch"]
    for i in (0, 4):  # the PNG holds the array's pixels exactly (CHW rows -> HWC)
        png = np.asarray(Image.open(ds.test[i].path))
        assert np.array_equal(png, data[i].reshape(3, 32, 32).transpose(1, 2, 0))
    assert ds.train[3].classname == NAMES[ds.train[3].label]
    mtimes = {d.path: os.path.getmtime(d.path) for d in ds.train}
    again = build_dataset("cifar10", root, shots=1, seed=1)  # read again: the PNGs are not rewritten
    assert {p: os.path.getmtime(p) for p in mtimes} == mtimes and len(again.train) == len(set(train_labels))


def test_data_doctor_knows_the_cifar_layout_and_writes_nothing(cifar10, tmp_path_factory):
    root, _ = cifar10
    report = check_dataset("cifar10", root)
    assert report.ok, report.problems
    assert report.counts == {"classes": 3, "train": 20, "val": 0, "test": 5}
    assert not (root / "cifar-10-batches-py" / "png").exists()
    empty = tmp_path_factory.mktemp("empty")
    missing = check_dataset("cifar100", empty)
    assert not missing.ok and "cifar-100-python.tar.gz" in missing.problems[0][1]
