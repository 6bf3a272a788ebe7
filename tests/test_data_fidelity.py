"""Fidelity of coop.data to CoOp: its few-shot draw, cache staleness, empty folders, file modes,
and the test-only ImageNet variants of domain generalisation, on tiny generated folders.

Run: .venv/bin/python -m pytest tests/test_data_fidelity.py -q
"""

import json
import logging
import os
import random
import shutil
import stat
from collections import Counter
from itertools import zip_longest

import pytest
from PIL import Image

import coop.io
from coop.data import (
    DATASETS,
    TEST_ONLY_DATASETS,
    DataError,
    build_dataset,
    require_train_split,
    subsample_classes,
)
from coop.data.fewshot import SAMPLER_VERSION, fewshot_dataset
from coop.data.imagenet_variants import read_imagenet_variant
from coop.io import write_json


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "user_cache"
    monkeypatch.setenv("COOP_CACHE_DIR", str(path))
    return path


def png(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (10, 120, 30)).save(path, "PNG")


def write_pets(root, split: dict) -> None:
    """An oxford_pets DATA folder from split items; every listed image exists."""
    base = root / "oxford_pets"
    for items in split.values():
        for rel, _, _ in items:
            png(base / "images" / rel)
    (base / "split_zhou_OxfordPets.json").write_text(json.dumps(split))


# Labels deliberately appear out of order (2, 0, 1) and file names are not sorted within a class;
# "beagle" has fewer items than K = 3, in the middle of the label order.
NAMES = ["abyssinian", "beagle", "chihuahua"]


def pets_split(n_classes=3):
    """Split items of the first `n_classes` of NAMES, labels interleaved round-robin."""

    def items(files_per_label, order):
        order = [lab for lab in order if lab < n_classes]
        rounds = zip_longest(*[[(lab, f) for f in files_per_label[lab]] for lab in order])
        return [[f"{NAMES[lab]}/{f}.png", lab, NAMES[lab]] for r in rounds for lab, f in filter(None, r)]

    train = {0: ["t9", "t2", "t5", "t1", "t7"], 1: ["t4", "t0"], 2: ["t8", "t3", "t6", "t0", "t5", "t1"]}
    val = {0: ["v3", "v1", "v2"], 1: ["v0", "v9", "v4", "v1", "v6"], 2: ["v5", "v2"]}
    return {"train": items(train, (2, 0, 1)), "val": items(val, (1, 2, 0)), "test": items(val, (0, 1, 2))}


def coop_draw(split, k, seed):
    """Dassl's generate_fewshot_dataset on the global stream after CoOp's random.seed(seed)."""
    state = random.getstate()
    try:
        random.seed(seed)
        out = []
        for items, kk in ((split["train"], k), (split["val"], min(k, 4))):
            groups = {}
            for item in items:
                groups.setdefault(item[1], []).append(item)
            picked = []
            for group in groups.values():
                picked += random.sample(group, kk) if len(group) >= kk else group
            out.append(picked)
        return out
    finally:
        random.setstate(state)


def as_items(ds, data):
    return [[os.path.relpath(d.path, ds.image_dir), d.label, d.classname] for d in data]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fewshot_draw_is_coops(tmp_path, seed):
    split = pets_split()
    write_pets(tmp_path, split)
    with pytest.warns(UserWarning) as short:
        ds = build_dataset("oxford_pets", tmp_path, shots=3, seed=seed)
    assert sorted(str(w.message).split(" has")[0] for w in short) == [
        "class 'beagle' (label 1)",  # 2 train images
        "class 'chihuahua' (label 2)",  # 2 val images
    ]
    train, val = coop_draw(split, 3, seed)
    assert as_items(ds, ds.train) == train and as_items(ds, ds.val) == val
    # labels in order of first appearance, the short class kept whole in split order
    assert [d.label for d in ds.train] == [2, 2, 2, 0, 0, 0, 1, 1]
    assert [os.path.basename(d.path) for d in ds.train if d.label == 1] == ["t4.png", "t0.png"]


def test_fewshot_draw_pinned(tmp_path):
    # random.seed(1); random.sample(5 items, 2) picks indices [1, 0], then of 3 items [1, 0];
    # the items keep their split order (not sorted by name)
    split = {
        "train": [[f"a/{c}.png", 0, "a"] for c in "edcba"],
        "val": [[f"a/{c}.png", 0, "a"] for c in "hgf"],
        "test": [["a/f.png", 0, "a"]],
    }
    write_pets(tmp_path, split)
    ds = build_dataset("oxford_pets", tmp_path, shots=2, seed=1)
    assert [os.path.basename(d.path) for d in ds.train + ds.val] == ["d.png", "e.png", "g.png", "h.png"]
    assert coop_draw(split, 2, 1) == [as_items(ds, ds.train), as_items(ds, ds.val)]


def test_fewshot_cache_records_its_inputs(tmp_path):
    write_pets(tmp_path, pets_split())
    with pytest.warns(UserWarning):
        build_dataset("oxford_pets", tmp_path, shots=3, seed=1)
    cached = json.loads((tmp_path / "oxford_pets/split_fewshot/shot_3-seed_1.json").read_text())
    assert cached["sampler"] == SAMPLER_VERSION >= 2
    assert cached["classnames"] == NAMES and len(cached["split_sha256"]) == 64


def stale_lines(caplog):
    return [r for r in caplog.records if "stale" in r.getMessage() and "resampling" in r.getMessage()]


def test_added_class_is_resampled(tmp_path, caplog):
    write_pets(tmp_path, pets_split(n_classes=2))
    build_dataset("oxford_pets", tmp_path, shots=2, seed=1)
    three = pets_split(n_classes=3)
    write_pets(tmp_path, three)
    with caplog.at_level(logging.INFO, logger="coop.data"):
        ds = build_dataset("oxford_pets", tmp_path, shots=2, seed=1)
    assert Counter(d.label for d in ds.train) == {0: 2, 1: 2, 2: 2}
    assert as_items(ds, ds.train) == coop_draw(three, 2, 1)[0]
    assert len(stale_lines(caplog)) == 1 and "classnames" in stale_lines(caplog)[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coop.data"):
        again = build_dataset("oxford_pets", tmp_path, shots=2, seed=1)  # the new cache is used
    assert again.train == ds.train and not stale_lines(caplog) and "read from" in caplog.text


def test_reordered_split_is_resampled(tmp_path, caplog):
    split = pets_split()
    write_pets(tmp_path, split)
    with pytest.warns(UserWarning):
        build_dataset("oxford_pets", tmp_path, shots=3, seed=1)
    split["train"] = split["train"][::-1]  # same items and classes, another order: another draw
    write_pets(tmp_path, split)
    with caplog.at_level(logging.WARNING, logger="coop.data"), pytest.warns(UserWarning):
        ds = build_dataset("oxford_pets", tmp_path, shots=3, seed=1)
    assert as_items(ds, ds.train) == coop_draw(split, 3, 1)[0]
    assert "split_sha256" in stale_lines(caplog)[0].getMessage()


def test_old_format_cache_is_resampled(tmp_path, caplog):
    split = pets_split()
    write_pets(tmp_path, split)
    path = tmp_path / "oxford_pets/split_fewshot/shot_1-seed_1.json"
    # what the previous sampler wrote: valid items, no sampler/classnames/hash record
    old = {"train": [split["train"][i] for i in (0, 6, 11)], "val": [], "dataset": "oxford_pets"}
    old.update(shots=1, seed=1)
    write_json(path, old)
    with caplog.at_level(logging.WARNING, logger="coop.data"):
        ds = build_dataset("oxford_pets", tmp_path, shots=1, seed=1)
    train, val = coop_draw(split, 1, 1)
    assert as_items(ds, ds.train) == train and as_items(ds, ds.val) == val
    assert len(stale_lines(caplog)) == 1 and "older version" in caplog.text
    assert json.loads(path.read_text())["sampler"] == SAMPLER_VERSION


def make_imagefolder(root):
    for split in ("train", "test"):
        for cls in ("cat", "dog"):
            png(root / split / cls / "0.png")


@pytest.mark.parametrize("split", ["train", "test"])
def test_empty_class_folder_imagefolder(tmp_path, split):
    make_imagefolder(tmp_path)
    empty = tmp_path / split / "dog"
    (empty / "0.png").unlink()
    (empty / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match="no images") as exc:
        build_dataset("imagefolder", tmp_path)
    assert str(empty) in str(exc.value) and "\n" not in str(exc.value)


def test_empty_class_folder_imagenet(tmp_path):
    base = tmp_path / "imagenet"
    png(base / "images/train/n01440764/a.JPEG")
    png(base / "images/val/n01440764/b.JPEG")
    (base / "images/train/n01443537").mkdir()
    (base / "classnames.txt").write_text("n01440764 tench\nn01443537 goldfish\n")
    with pytest.raises(DataError, match="no images") as exc:
        build_dataset("imagenet", tmp_path)
    assert str(base / "images/train/n01443537") in str(exc.value) and "\n" not in str(exc.value)


def test_empty_train_split(tmp_path):
    split = pets_split()
    split["train"] = []
    write_pets(tmp_path, split)
    for shots in (0, 2):
        with pytest.raises(DataError, match="oxford_pets has no images in its train split") as exc:
            build_dataset("oxford_pets", tmp_path, shots=shots)
        assert "\n" not in str(exc.value)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_written_files_follow_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "a" / "x.json", {"k": 1})
        write_pets(tmp_path, pets_split())
        with pytest.warns(UserWarning):
            build_dataset("oxford_pets", tmp_path, shots=3, seed=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "x.json").stat().st_mode) == mode
    cache = tmp_path / "oxford_pets/split_fewshot/shot_3-seed_1.json"
    assert stat.S_IMODE(cache.stat().st_mode) == mode


def test_umask_without_proc(monkeypatch):
    def no_proc(*args, **kwargs):
        raise OSError("no /proc")

    monkeypatch.setattr(coop.io, "open", no_proc, raising=False)
    old = os.umask(0o027)
    try:
        assert coop.io.current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # left as it was
    finally:
        os.umask(old)


# classnames.txt lists wnids deliberately NOT sorted: V2's labels follow the file's lines, the
# others' labels follow the sorted wnid folders.
WNIDS = [("n03000000", "gamma ray"), ("n01000000", "alpha fish"), ("n02000000", "beta bird"),
         ("n05000000", "epsilon"), ("n04000000", "delta wing")]  # fmt: skip
SUBSET = ["n04000000", "n01000000", "n03000000"]  # the "200" classes of -A and -R


@pytest.fixture
def dg_root(tmp_path):
    listing = "".join(f"{w} {n}\n" for w, n in WNIDS)
    trees = {
        "imagenetv2/imagenetv2-matched-frequency-format-val": [str(i) for i in range(len(WNIDS))],
        "imagenet-sketch/images": [w for w, _ in WNIDS],
        "imagenet-adversarial/imagenet-a": SUBSET,
        "imagenet-rendition/imagenet-r": SUBSET,
    }
    for images, folders in trees.items():
        dataset_dir = tmp_path / images.split("/")[0]
        for j, folder in enumerate(folders):
            for i in range(j % 2 + 1):  # 1 or 2 images per class
                png(tmp_path / images / folder / f"{folder}_{i}.png")
        (dataset_dir / "classnames.txt").write_text(listing)
    for readme in ("imagenet-adversarial/imagenet-a", "imagenet-rendition/imagenet-r"):
        (tmp_path / readme / "README.txt").write_text("not a class")
    return tmp_path


def test_test_only_names():
    assert set(TEST_ONLY_DATASETS) == {"imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r"}
    assert set(TEST_ONLY_DATASETS) <= set(DATASETS)


def test_imagenetv2_labels_are_folder_indices(dg_root):
    ds = build_dataset("imagenetv2", dg_root)
    assert ds.test_only and ds.train == [] and ds.val == []
    assert ds.classnames == [n for _, n in WNIDS]
    assert [(os.path.basename(os.path.dirname(d.path)), d.label, d.classname) for d in ds.test] == [
        (str(i), i, n) for i, (_, n) in enumerate(WNIDS) for _ in range(i % 2 + 1)
    ]


@pytest.mark.parametrize(
    "name, folders",
    [("imagenet_sketch", sorted(w for w, _ in WNIDS)), ("imagenet_a", sorted(SUBSET)),
     ("imagenet_r", sorted(SUBSET))],
)  # fmt: skip
def test_wnid_variants_label_sorted_folders(dg_root, name, folders):
    ds = build_dataset(name, dg_root)
    names = dict(WNIDS)
    assert ds.test_only and ds.train == [] and ds.val == []
    assert ds.classnames == [names[w] for w in folders]
    assert {(os.path.basename(os.path.dirname(d.path)), d.label, d.classname) for d in ds.test} == {
        (w, i, names[w]) for i, w in enumerate(folders)
    }
    assert all(os.path.isfile(d.path) for d in ds.test)


@pytest.mark.parametrize("name", ["imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r"])
def test_test_only_refuses_training(dg_root, name):
    msg = f"{name} is a test-only dataset (domain generalization); train on imagenet and evaluate with eval.targets"
    with pytest.raises(DataError) as exc:
        build_dataset(name, dg_root, shots=16, seed=1)
    assert str(exc.value) == msg
    with pytest.raises(DataError, match="test-only"):
        build_dataset(name, dg_root / "nowhere", shots=1)  # refused before reading anything
    with pytest.raises(DataError, match="test-only"):
        fewshot_dataset(read_imagenet_variant(dg_root, name), shots=1)
    ds = build_dataset(name, dg_root)
    with pytest.raises(DataError) as exc:
        require_train_split(ds)
    assert str(exc.value) == msg
    with pytest.raises(DataError, match="test-only"):
        require_train_split(subsample_classes(ds, "base"))
    write_pets(dg_root, pets_split())
    trainable = build_dataset("oxford_pets", dg_root)
    assert not trainable.test_only
    require_train_split(trainable)


def test_dg_reader_errors(dg_root):
    v2 = dg_root / "imagenetv2/imagenetv2-matched-frequency-format-val"
    os.rename(v2 / "3", v2 / "9")
    with pytest.raises(DataError, match="is not a class index 0..4") as exc:
        build_dataset("imagenetv2", dg_root)
    assert str(v2 / "9") in str(exc.value)
    shutil.rmtree(v2 / "9")
    with pytest.raises(DataError, match="imagenetv2 class folder not found") as exc:
        build_dataset("imagenetv2", dg_root)
    assert str(v2 / "3") in str(exc.value)
    png(dg_root / "imagenet-sketch/images/n09999999/a.png")
    with pytest.raises(DataError, match="n09999999.*not listed in.*classnames.txt"):
        build_dataset("imagenet_sketch", dg_root)
    empty = dg_root / "imagenet-rendition/imagenet-r/n01000000"
    for f in empty.iterdir():
        f.unlink()
    with pytest.raises(DataError, match="no images") as exc:
        build_dataset("imagenet_r", dg_root)
    assert str(empty) in str(exc.value) and "\n" not in str(exc.value)
