"""Tests for coop.data: CoOp's DATA layouts on tiny generated folders, few-shot caches, loading.

Run: .venv/bin/python -m pytest tests/test_data.py -q
"""

import json
import logging
import os
import shutil
from collections import Counter

import pytest
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from torch.utils.data import DataLoader

import coop.data.base as data_base
from coop.data import (
    CLIP_MEAN,
    CLIP_STD,
    DATASETS,
    DataError,
    Datum,
    ImageDataset,
    build_dataset,
    build_transforms,
    collate_skip_none,
)


def make_image(path, size=(8, 8), color=(200, 30, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = "PNG" if path.suffix.lower() == ".png" else "JPEG"
    Image.new("RGB", size, color).save(path, fmt)


def make_split_json_dataset(root, folder, images, split_name, classes, counts=(6, 3, 2), prefix=""):
    """A CoOp split-json dataset: images on disk plus split_zhou_*.json with relative paths."""
    dataset_dir = root / folder
    image_dir = dataset_dir / images if images else dataset_dir
    split = {}
    for name, n in zip(("train", "val", "test"), counts, strict=True):
        items = []
        for label, cls in enumerate(classes):
            for j in range(n):
                rel = f"{prefix}{cls}/{name}_{j:02d}.jpg"
                make_image(image_dir / rel)
                items.append([rel, label, cls])
        split[name] = items
    (dataset_dir / split_name).write_text(json.dumps(split))
    return dataset_dir, image_dir


DTD_CLASSES = ["banded", "blotchy", "braided"]


@pytest.fixture
def dtd_root(tmp_path):
    make_split_json_dataset(tmp_path, "dtd", "images", "split_zhou_DescribableTextures.json", DTD_CLASSES)
    return tmp_path


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Keep every test's user cache inside tmp_path."""
    path = tmp_path / "user_cache"
    monkeypatch.setenv("COOP_CACHE_DIR", str(path))
    return path


def test_dataset_names():
    assert set(DATASETS) == {
        "imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
        "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101", "imagefolder", "textile",
        "imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r", "multidomain", "cifar10", "cifar100",
    }  # fmt: skip
    with pytest.raises(ValueError, match="valid names: .*dtd.*textile"):
        build_dataset("svhn", "/nowhere")


def test_split_json_full(dtd_root):
    ds = build_dataset("dtd", dtd_root)
    image_dir = dtd_root / "dtd" / "images"
    assert ds.name == "dtd" and ds.classnames == DTD_CLASSES
    assert (len(ds.train), len(ds.val), len(ds.test)) == (18, 9, 6)
    d = ds.train[0]
    assert d == Datum(str(image_dir / "banded" / "train_00.jpg"), 0, "banded")
    assert all(os.path.isabs(x.path) and os.path.isfile(x.path) for x in ds.train + ds.val + ds.test)
    assert all(ds.classnames[x.label] == x.classname for x in ds.train + ds.val + ds.test)
    with pytest.raises(AttributeError):
        d.label = 3  # Datum is frozen


def test_stanford_cars_image_dir_is_dataset_dir(tmp_path):
    classes = ["2012 Volvo C30 Hatchback", "2000 AM General Hummer SUV"]
    make_split_json_dataset(
        tmp_path, "stanford_cars", "", "split_zhou_StanfordCars.json", classes, prefix="cars_"
    )
    ds = build_dataset("stanford_cars", tmp_path)
    assert ds.classnames == classes
    assert ds.test[-1].path == str(
        tmp_path / "stanford_cars" / "cars_2000 AM General Hummer SUV" / "test_01.jpg"
    )


def test_classnames_from_items_not_sorted(tmp_path):
    # label -> classname comes from the split items, whatever the folder names' order
    classes = ["zebra_fish", "apple pie"]
    make_split_json_dataset(tmp_path, "food-101", "images", "split_zhou_Food101.json", classes)
    assert build_dataset("food101", tmp_path).classnames == classes


def test_fewshot_counts_and_test_untouched(dtd_root):
    full = build_dataset("dtd", dtd_root)
    for k, val_k in ((1, 1), (2, 2), (5, 3)):  # val has 3 per class, so min(5, 4) is capped at 3
        ds = build_dataset("dtd", dtd_root, shots=k, seed=1)
        assert Counter(d.label for d in ds.train) == {0: k, 1: k, 2: k}
        assert Counter(d.label for d in ds.val) == {0: val_k, 1: val_k, 2: val_k}
        assert ds.test == full.test
        assert set(ds.train) <= set(full.train) and set(ds.val) <= set(full.val)


def test_fewshot_val_capped_at_four(tmp_path):
    make_split_json_dataset(
        tmp_path, "eurosat", "2750", "split_zhou_EuroSAT.json", ["Forest", "River"], (9, 6, 1)
    )
    ds = build_dataset("eurosat", tmp_path, shots=8, seed=3)
    assert Counter(d.label for d in ds.train) == {0: 8, 1: 8}
    assert Counter(d.label for d in ds.val) == {0: 4, 1: 4}


def test_fewshot_deterministic(dtd_root):
    cache = dtd_root / "dtd" / "split_fewshot"
    a = build_dataset("dtd", dtd_root, shots=2, seed=1)
    (cache / "shot_2-seed_1.json").unlink()  # sample again from scratch, not from the cache
    b = build_dataset("dtd", dtd_root, shots=2, seed=1)
    assert a.train == b.train and a.val == b.val
    others = [build_dataset("dtd", dtd_root, shots=2, seed=s) for s in (2, 3, 4)]
    assert any(o.train != a.train for o in others)


def test_fewshot_cache_written_relative_and_reused(dtd_root):
    path = dtd_root / "dtd" / "split_fewshot" / "shot_2-seed_7.json"
    first = build_dataset("dtd", dtd_root, shots=2, seed=7)
    assert path.is_file()
    cached = json.loads(path.read_text())
    assert all(not os.path.isabs(p) for p, _, _ in cached["train"] + cached["val"])
    assert cached["train"] == [
        [os.path.relpath(d.path, dtd_root / "dtd" / "images"), d.label, d.classname] for d in first.train
    ]
    second = build_dataset("dtd", dtd_root, shots=2, seed=7)
    assert second.train == first.train and second.val == first.val

    # the cache is what is read: a different valid subset written there comes back
    cached["train"] = [[f"{c}/train_05.jpg", i, c] for i, c in enumerate(DTD_CLASSES)] * 2
    path.write_text(json.dumps(cached))
    third = build_dataset("dtd", dtd_root, shots=2, seed=7)
    assert [os.path.basename(d.path) for d in third.train] == ["train_05.jpg"] * 6


def test_stale_fewshot_cache_is_resampled(dtd_root, caplog):
    path = dtd_root / "dtd" / "split_fewshot" / "shot_1-seed_1.json"
    first = build_dataset("dtd", dtd_root, shots=1, seed=1)
    cached = json.loads(path.read_text())
    cached["train"][0][0] = "banded/not_in_split.jpg"
    path.write_text(json.dumps(cached))
    with caplog.at_level(logging.WARNING, logger="coop.data"):
        again = build_dataset("dtd", dtd_root, shots=1, seed=1)
    assert again.train == first.train
    assert "resampling" in caplog.text


def test_fewer_than_k_warns_and_uses_all(tmp_path):
    classes = ["abyssinian", "beagle"]
    _, image_dir = make_split_json_dataset(
        tmp_path, "oxford_pets", "images", "split_zhou_OxfordPets.json", classes, (3, 2, 1)
    )
    with pytest.warns(UserWarning, match=r"class 'beagle'.*only 3 train images"):
        ds = build_dataset("oxford_pets", tmp_path, shots=4, seed=1)
    assert Counter(d.label for d in ds.train) == {0: 3, 1: 3}
    assert {d.path for d in ds.train} == {
        str(image_dir / c / f"train_{j:02d}.jpg") for c in classes for j in range(3)
    }


def test_fewshot_cache_falls_back_when_not_writable(dtd_root, cache_dir, monkeypatch, caplog):
    real_write = data_base.write_json

    def write(path, obj):
        if str(path).startswith(str(dtd_root / "dtd")):
            raise PermissionError(13, "Permission denied")
        real_write(path, obj)

    monkeypatch.setattr(data_base, "write_json", write)
    with caplog.at_level(logging.WARNING, logger="coop.data"):
        first = build_dataset("dtd", dtd_root, shots=2, seed=1)
    fallback = cache_dir / "dtd" / "split_fewshot" / "shot_2-seed_1.json"
    assert fallback.is_file() and not (dtd_root / "dtd" / "split_fewshot").exists()
    assert "cannot write" in caplog.text and str(fallback) in caplog.text
    assert build_dataset("dtd", dtd_root, shots=2, seed=1).train == first.train


@pytest.mark.parametrize(
    "remove, expected",
    [
        ("", "dataset root not found"),
        ("dtd/images", "dtd image directory not found"),
        ("dtd/split_zhou_DescribableTextures.json", "split file"),
    ],
)
def test_missing_paths_raise_data_error(dtd_root, remove, expected):
    root = dtd_root / "missing_root" if not remove else dtd_root
    target = dtd_root / remove if remove else root
    if remove:
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(DataError, match=expected) as exc:
        build_dataset("dtd", root)
    msg = str(exc.value)
    assert str(target) in msg and "\n" not in msg
    assert isinstance(exc.value, ValueError)


def test_root_none_raises(tmp_path):
    with pytest.raises(DataError, match="root"):
        build_dataset("dtd", None)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"train": []}),
        json.dumps({"train": [["a.jpg", "0", "x"]], "val": [], "test": []}),
    ],
)
def test_malformed_split_json(dtd_root, content):
    split = dtd_root / "dtd" / "split_zhou_DescribableTextures.json"
    split.write_text(content)
    with pytest.raises(DataError, match="malformed") as exc:
        build_dataset("dtd", dtd_root)
    assert str(split) in str(exc.value)


IMAGENET = [("n01443537", "goldfish"), ("n01440764", "tench"), ("n02102040", "English springer")]


@pytest.fixture
def imagenet_root(tmp_path):
    base = tmp_path / "imagenet"
    base.mkdir()
    # classnames.txt order differs from the sorted folder order on purpose
    (base / "classnames.txt").write_text("".join(f"{w} {n}\n" for w, n in IMAGENET))
    for wnid, _ in IMAGENET:
        for j in range(4):
            make_image(base / "images" / "train" / wnid / f"{wnid}_{j}.JPEG")
        for j in range(2):
            make_image(base / "images" / "val" / wnid / f"ILSVRC2012_val_{wnid}_{j}.JPEG")
    return tmp_path


def test_imagenet_labels_follow_sorted_folders(imagenet_root):
    ds = build_dataset("imagenet", imagenet_root)
    assert ds.classnames == ["tench", "goldfish", "English springer"]  # n01440764 < n01443537 < n02102040
    assert (len(ds.train), len(ds.val), len(ds.test)) == (12, 6, 6)
    assert ds.val == ds.test  # CoOp has no ImageNet val split: val is the test set
    tench = [d for d in ds.train if d.label == 0]
    assert {os.path.dirname(d.path) for d in tench} == {
        str(imagenet_root / "imagenet/images/train/n01440764")
    }
    assert all(d.classname == ds.classnames[d.label] for d in ds.train + ds.test)


def test_imagenet_listing_cached(imagenet_root):
    first = build_dataset("imagenet", imagenet_root)
    listing = imagenet_root / "imagenet" / "images_listing.json"
    assert listing.is_file()
    assert all(not os.path.isabs(p) for p, _, _ in json.loads(listing.read_text())["train"])
    make_image(imagenet_root / "imagenet/images/train/n01440764/new.JPEG")  # not listed: the cache is used
    assert build_dataset("imagenet", imagenet_root).train == first.train
    listing.unlink()
    assert len(build_dataset("imagenet", imagenet_root).train) == 13


def test_imagenet_fewshot(imagenet_root):
    ds = build_dataset("imagenet", imagenet_root, shots=2, seed=1)
    assert Counter(d.label for d in ds.train) == {0: 2, 1: 2, 2: 2}
    assert (imagenet_root / "imagenet/split_fewshot/shot_2-seed_1.json").is_file()


def test_imagenet_unknown_wnid(imagenet_root):
    make_image(imagenet_root / "imagenet/images/train/n99999999/x.JPEG")
    with pytest.raises(DataError, match="n99999999.*classnames.txt"):
        build_dataset("imagenet", imagenet_root)


VARIANTS = ["707-320", "A300B4", "Cessna 172", "DHC-1"]


@pytest.fixture
def aircraft_root(tmp_path):
    base = tmp_path / "fgvc_aircraft"
    (base / "images").mkdir(parents=True)
    (base / "variants.txt").write_text("\n".join(VARIANTS) + "\n")
    n = 0
    for split, per_class in (("train", 3), ("val", 2), ("test", 2)):
        lines = []
        for v in VARIANTS:
            for _ in range(per_class):
                make_image(base / "images" / f"{n:07d}.jpg")
                lines.append(f"{n:07d} {v}")
                n += 1
        (base / f"images_variant_{split}.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_fgvc_aircraft(aircraft_root):
    ds = build_dataset("fgvc_aircraft", aircraft_root)
    assert ds.classnames == VARIANTS
    assert (len(ds.train), len(ds.val), len(ds.test)) == (12, 8, 8)
    cessna = [d for d in ds.train if d.classname == "Cessna 172"]
    assert [d.label for d in cessna] == [2, 2, 2]
    assert cessna[0].path == str(aircraft_root / "fgvc_aircraft" / "images" / "0000006.jpg")
    few = build_dataset("fgvc_aircraft", aircraft_root, shots=1, seed=2)
    assert Counter(d.label for d in few.train) == dict.fromkeys(range(4), 1)


def test_fgvc_unknown_variant(aircraft_root):
    path = aircraft_root / "fgvc_aircraft" / "images_variant_test.txt"
    path.write_text("0000001 Spitfire Mk I\n")
    with pytest.raises(DataError, match="Spitfire Mk I") as exc:
        build_dataset("fgvc_aircraft", aircraft_root)
    assert str(path) in str(exc.value)


def make_imagefolder(root, with_val=True):
    for cls in ("dog", "cat", "bird"):
        for j in range(3):
            make_image(root / "train" / cls / f"{j}.png")
        make_image(root / "test" / cls / "t.JPG")  # upper-case extension counts
        if with_val:
            make_image(root / "val" / cls / "v.jpeg")
    (root / "train" / "dog" / "notes.txt").write_text("not an image")


def test_imagefolder_with_val(tmp_path):
    make_imagefolder(tmp_path)
    ds = build_dataset("imagefolder", tmp_path)
    assert ds.classnames == ["bird", "cat", "dog"]
    assert (len(ds.train), len(ds.val), len(ds.test)) == (9, 3, 3)
    assert all(
        d.classname == ds.classnames[d.label] and d.path.endswith((".png", ".jpeg", ".JPG"))
        for d in ds.train + ds.val + ds.test
    )
    few = build_dataset("imagefolder", tmp_path, shots=2, seed=1)
    assert Counter(d.label for d in few.train) == {0: 2, 1: 2, 2: 2}
    assert Counter(d.label for d in few.val) == {0: 1, 1: 1, 2: 1}
    assert (tmp_path / "split_fewshot" / "shot_2-seed_1.json").is_file()


def test_imagefolder_without_val(tmp_path):
    make_imagefolder(tmp_path, with_val=False)
    ds = build_dataset("imagefolder", tmp_path, shots=1, seed=1)
    assert ds.val == [] and len(ds.train) == 3 and len(ds.test) == 3


def test_imagefolder_test_class_not_in_train(tmp_path):
    make_imagefolder(tmp_path)
    make_image(tmp_path / "test" / "horse" / "h.jpg")
    with pytest.raises(DataError, match="'horse'"):
        build_dataset("imagefolder", tmp_path)


def test_textile_split(cache_dir):
    ds = build_dataset("textile", None)
    assert ds.classnames == ["nominal", "local defect", "global defect"]
    sizes = {split: Counter(d.label for d in getattr(ds, split)) for split in ("train", "val", "test")}
    assert sizes == {
        "train": {0: 500, 1: 250, 2: 250},
        "val": {0: 200, 1: 100, 2: 100},
        "test": {0: 300, 1: 150, 2: 150},
    }
    paths = [{d.path for d in getattr(ds, s)} for s in ("train", "val", "test")]
    assert not (paths[0] & paths[1] or paths[0] & paths[2] or paths[1] & paths[2])
    assert sum(map(len, paths)) == 2000
    assert build_dataset("textile", "ignored").test == ds.test  # fixed split

    few = build_dataset("textile", None, shots=4, seed=2)
    assert Counter(d.label for d in few.train) == {0: 4, 1: 4, 2: 4}
    assert few.test == ds.test
    cached = json.loads((cache_dir / "textile" / "split_fewshot" / "shot_4-seed_2.json").read_text())
    assert {p.split("/")[0] for p, _, _ in cached["train"]} == {"nominal", "local", "global"}


@pytest.fixture
def bad_images(tmp_path):
    good = tmp_path / "good.png"
    make_image(good, size=(16, 12))
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"this is not an image")
    big = tmp_path / "big.jpg"
    Image.effect_noise((64, 64), 50).convert("RGB").save(big, "JPEG")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    missing = tmp_path / "missing.jpg"
    return [Datum(str(p), i, "x") for i, p in enumerate((good, garbage, truncated, missing))]


def test_corrupt_images_raise(bad_images):
    _, test_tf = build_transforms(8)
    ds = ImageDataset(bad_images, test_tf)
    img, label, idx = ds[0]
    assert img.shape == (3, 8, 8) and (label, idx) == (0, 0)
    for i in (1, 2, 3):
        with pytest.raises(DataError, match="cannot read image") as exc:
            ds[i]
        assert bad_images[i].path in str(exc.value) and "\n" not in str(exc.value)


def test_skip_corrupt_and_collate(bad_images, caplog):
    _, test_tf = build_transforms(8)
    ds = ImageDataset(bad_images, test_tf, skip_corrupt=True)
    with caplog.at_level(logging.WARNING, logger="coop.data"):
        items = [ds[i] for i in range(4)]
    assert items[1:] == [None, None, None]
    assert bad_images[2].path in caplog.text
    images, labels, idx = collate_skip_none(items)
    assert images.shape == (1, 3, 8, 8) and labels.tolist() == [0] and idx.tolist() == [0]
    assert collate_skip_none(items[1:]) is None
    loader = DataLoader(ds, batch_size=4, collate_fn=collate_skip_none)
    (batch,) = list(loader)
    assert batch[0].shape == (1, 3, 8, 8)


def test_transforms():
    assert CLIP_MEAN == tuple(OPENAI_DATASET_MEAN) and CLIP_STD == tuple(OPENAI_DATASET_STD)
    train_tf, test_tf = build_transforms(32, CLIP_MEAN, CLIP_STD)
    img = Image.new("RGB", (64, 48), (255, 255, 255))
    out = test_tf(img)
    assert out.shape == (3, 32, 32)
    white = (1 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    torch.testing.assert_close(out[:, 16, 16], white, rtol=1e-4, atol=1e-4)
    assert train_tf(img).shape == (3, 32, 32)
    names = [type(t).__name__ for t in train_tf.transforms]
    assert names == ["RandomResizedCrop", "RandomHorizontalFlip", "ToTensor", "Normalize"]
    assert train_tf.transforms[0].scale == (0.08, 1.0)
    assert test_tf.transforms[0].size == 32  # shorter side, aspect kept
    _, rect_tf = build_transforms((24, 32))
    assert rect_tf(img).shape == (3, 24, 32)
