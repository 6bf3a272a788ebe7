"""Dataset readers for CoOp's DATA folder layout, and `build_dataset`.

Each reader takes the DATA root and returns a `Source` with the full splits; `DATASETS` maps
names to readers (a plain dict, no registry). Usage:

    from coop.data import build_dataset
    ds = build_dataset("dtd", "/data", shots=16, seed=1)
    ds.classnames[ds.train[0].label]

Layouts are CoOp's (its Dassl readers), so an existing DATA folder works unchanged:
nine datasets ship CoOp's `split_zhou_*.json`; ImageNet and FGVC-Aircraft are read from their
own files; `imagefolder` is a generic `train/ val/ test/` class-folder tree, or any folder read
through a CoOp split file (`coop.data.splits`, `tools/make_split.py`); `textile` is the
simulated textile-defect set bundled with the `conformal-clip-data` package. The test-only
ImageNet variants of domain generalisation (`TEST_ONLY_DATASETS`) are read by
`coop.data.imagenet_variants`.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from functools import partial
from pathlib import Path

import conformal_clip_data as ccd

from coop.data.base import (
    DataError,
    Datum,
    FewShotDataset,
    Source,
    cache_root,
    classnames_from_items,
    load_json,
    parse_items,
    read_split_file,
    require_dir,
    require_file,
    require_root,
    save_cache,
    test_only_error,
)
from coop.data.cifar import CIFAR_FOLDERS, read_cifar
from coop.data.fewshot import fewshot_dataset
from coop.data.folders import list_class_dirs, list_class_images, list_images, read_wnid_classnames
from coop.data.imagenet_variants import IMAGENET_VARIANTS, TEST_ONLY_DATASETS, read_imagenet_variant
from coop.data.jsonl_splits import jsonl_fewshot_dataset
from coop.data.multidomain import read_multidomain

logger = logging.getLogger(__name__)

# name -> (dataset folder under root, image folder under it ("" = itself), split file under it)
SPLIT_JSON_LAYOUTS = {
    "caltech101": ("caltech-101", "101_ObjectCategories", "split_zhou_Caltech101.json"),
    "oxford_pets": ("oxford_pets", "images", "split_zhou_OxfordPets.json"),
    "stanford_cars": ("stanford_cars", "", "split_zhou_StanfordCars.json"),
    "oxford_flowers": ("oxford_flowers", "jpg", "split_zhou_OxfordFlowers.json"),
    "food101": ("food-101", "images", "split_zhou_Food101.json"),
    "sun397": ("sun397", "SUN397", "split_zhou_SUN397.json"),
    "dtd": ("dtd", "images", "split_zhou_DescribableTextures.json"),
    "eurosat": ("eurosat", "2750", "split_zhou_EuroSAT.json"),
    "ucf101": ("ucf101", "UCF-101-midframes", "split_zhou_UCF101.json"),
}

# The two datasets read from their own files: (dataset folder, image folder, class-list file);
# FGVC-Aircraft's split lists are FGVC_LISTS.format(split=...) beside its variants.txt.
IMAGENET_LAYOUT = ("imagenet", "images", "classnames.txt")
FGVC_LAYOUT = ("fgvc_aircraft", "images", "variants.txt")
FGVC_LISTS = "images_variant_{split}.txt"
IMAGENET_FOLDERS = ("train", "val")  # under images/: ImageNet's train and val (= our test) sets

TEXTILE_CLASSNAMES = ["nominal", "local defect", "global defect"]
TEXTILE_FRACTIONS = (0.5, 0.2)  # train, val; the remaining 30% is test
IMAGENET_LISTING = "images_listing.json"


def read_split_json_dataset(root, name: str) -> Source:
    """Read one of the nine datasets CoOp ships a `split_zhou_*.json` for.

    Args:
        root: the DATA folder.
        name: key of `SPLIT_JSON_LAYOUTS`.
    """
    folder, images, split = SPLIT_JSON_LAYOUTS[name]
    dataset_dir = require_dir(os.path.join(require_root(root), folder), f"{name} dataset directory")
    image_dir = require_dir(os.path.join(dataset_dir, images), f"{name} image directory")
    split_file = require_file(os.path.join(dataset_dir, split), f"{name} split file {split}")
    splits = read_split_file(split_file, image_dir)
    classnames = classnames_from_items(splits, split_file)
    return Source(name, image_dir, classnames, splits["train"], splits["val"], splits["test"], dataset_dir)


def _list_imagenet(image_dir: str, classnames_file: str) -> dict:
    """List ImageNet train/val folders as CoOp does: label = index in sorted train folders."""
    wnid2name = read_wnid_classnames(classnames_file)
    train_dir, val_dir = (
        require_dir(os.path.join(image_dir, f), f"imagenet {f} directory") for f in IMAGENET_FOLDERS
    )
    wnids = list_class_dirs(train_dir)
    for wnid in wnids:
        if wnid not in wnid2name:
            raise DataError(f"imagenet class folder {wnid} is not listed in {classnames_file}")
    label = {w: i for i, w in enumerate(wnids)}
    classnames = [wnid2name[w] for w in wnids]
    splits = {}
    for split, folder in (("train", train_dir), ("test", val_dir)):
        items = []
        for wnid in list_class_dirs(folder):
            if wnid not in label:
                raise DataError(f"imagenet class folder {os.path.join(folder, wnid)} has no train folder")
            rel = os.path.relpath(os.path.join(folder, wnid), image_dir)
            name = classnames[label[wnid]]
            files = list_class_images(os.path.join(folder, wnid), f"imagenet {split}")
            items += [[os.path.join(rel, f), label[wnid], name] for f in files]
        splits[split] = items
    return {"image_dir": image_dir, "classnames": classnames, "wnids": wnids, **splits}


def read_imagenet(root, write_cache: bool = True) -> Source:
    """Read ImageNet: `imagenet/classnames.txt` + `imagenet/images/{train,val}/<wnid>/*`.

    As in CoOp, ImageNet's official val images are the test split, and, since there is no
    held-out split, `val` is the test split too. Listing 1.28M files is slow, so the listing
    is cached as `imagenet/images_listing.json` (or in the user cache dir); delete it after
    changing the image folders.

    Args:
        root: the DATA folder.
        write_cache: False lists the folders without caching the listing (read-only DATA).
    """
    folder, images, classes = IMAGENET_LAYOUT
    dataset_dir = require_dir(os.path.join(require_root(root), folder), "imagenet dataset directory")
    image_dir = require_dir(os.path.join(dataset_dir, images), "imagenet image directory")
    classnames_file = require_file(os.path.join(dataset_dir, classes), f"imagenet {classes}")
    primary = Path(dataset_dir) / IMAGENET_LISTING
    fallback = cache_root() / "imagenet" / IMAGENET_LISTING
    listing, where = None, None
    for path in (primary, fallback):
        if path.is_file():
            obj = load_json(path)
            # the user cache dir is shared by all DATA roots: only trust a listing of this one
            if path == primary or (isinstance(obj, dict) and obj.get("image_dir") == image_dir):
                listing, where = obj, str(path)
                break
    if listing is None:
        logger.info("listing imagenet images under %s%s", image_dir, " (cached afterwards)" * write_cache)
        listing, where = _list_imagenet(image_dir, classnames_file), image_dir
        if write_cache:
            save_cache(primary, fallback, listing, "imagenet listing")
    classnames = listing.get("classnames") if isinstance(listing, dict) else None
    if not isinstance(classnames, list) or any(k not in listing for k in ("train", "test")):
        raise DataError(
            f"malformed imagenet listing {where}: expected keys classnames/train/test; delete it to rebuild"
        )
    splits = {k: parse_items(listing[k], image_dir, f"{where} [{k}]") for k in ("train", "test")}
    return Source(
        "imagenet", image_dir, classnames, splits["train"], splits["test"], splits["test"], dataset_dir
    )


def read_fgvc_aircraft(root) -> Source:
    """Read FGVC-Aircraft: `variants.txt` (label = line index) and `images_variant_{split}.txt`.

    Args:
        root: the DATA folder.
    """
    folder, images, classes = FGVC_LAYOUT
    dataset_dir = require_dir(os.path.join(require_root(root), folder), "fgvc_aircraft dataset directory")
    image_dir = require_dir(os.path.join(dataset_dir, images), "fgvc_aircraft image directory")
    variants = require_file(os.path.join(dataset_dir, classes), f"fgvc_aircraft {classes}")
    with open(variants) as f:
        classnames = [line.strip() for line in f if line.strip()]
    label = {c: i for i, c in enumerate(classnames)}
    splits = {}
    for split in ("train", "val", "test"):
        path = require_file(
            os.path.join(dataset_dir, FGVC_LISTS.format(split=split)), f"fgvc_aircraft {split} list"
        )
        items = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                parts = line.strip().split(" ")
                if not parts[0]:
                    continue
                name = " ".join(parts[1:])
                if name not in label:
                    raise DataError(f"malformed {path} line {n}: variant {name!r} is not in {variants}")
                items.append(Datum(os.path.join(image_dir, parts[0] + ".jpg"), label[name], name))
        splits[split] = items
    return Source(
        "fgvc_aircraft", image_dir, classnames, splits["train"], splits["val"], splits["test"], dataset_dir
    )


def read_imagefolder(root, split_file=None) -> Source:
    """Read a generic class-folder tree: `root/{train,test}/<class>/*` and optional `root/val/`.

    Labels are the sorted class-folder names of `train`, and the class name is the folder name.
    Without `root/val`, val is empty. Few-shot caches go to `root/split_fewshot/`.

    With `split_file` (`data.split_file`, e.g. written by `tools/make_split.py`), the splits are
    that CoOp split JSON's instead, its paths relative to `root`; few-shot caches then go beside
    the split file (`<its folder>/split_fewshot/`), one per split file.

    Args:
        root: folder holding `train/` and `test/` (and optionally `val/`), or the folder the
            split file's paths are relative to.
        split_file: optional CoOp split JSON (`train`, `val`, `test` lists).
    """
    root = require_root(root)
    if split_file is not None:
        path = require_file(split_file, "imagefolder split file (data.split_file)")
        splits = read_split_file(path, root)
        classnames = classnames_from_items(splits, path)
        train, val, test = splits["train"], splits["val"], splits["test"]
        return Source(
            "imagefolder", root, classnames, train, val, test, os.path.dirname(path), split_file=path
        )
    train_dir = require_dir(os.path.join(root, "train"), "imagefolder train directory")
    test_dir = require_dir(os.path.join(root, "test"), "imagefolder test directory")
    val_dir = os.path.join(root, "val")
    classnames = list_class_dirs(train_dir)
    if not classnames:
        raise DataError(f"imagefolder train directory has no class folders: {train_dir}")
    label = {c: i for i, c in enumerate(classnames)}
    splits = {"val": []}
    for split, folder in (("train", train_dir), ("val", val_dir), ("test", test_dir)):
        if split == "val" and not os.path.isdir(val_dir):
            continue
        items = []
        for c in list_class_dirs(folder):
            if c not in label:
                raise DataError(f"imagefolder class {c!r} in {folder} has no folder in {train_dir}")
            files = list_class_images(os.path.join(folder, c), f"imagefolder {split}")
            items += [Datum(os.path.join(folder, c, f), label[c], c) for f in files]
        splits[split] = items
    return Source("imagefolder", root, classnames, splits["train"], splits["val"], splits["test"], root)


def textile_split(n: int) -> tuple[int, int]:
    """Sizes (train, val) of the fixed textile split for a class of `n` images; test is the rest."""
    n_train = int(n * TEXTILE_FRACTIONS[0])
    return n_train, int(n * TEXTILE_FRACTIONS[1])


def read_textile(root=None) -> Source:
    """Read the simulated textile-defect images bundled with `conformal-clip-data`.

    Classes are `nominal`, `local defect`, `global defect` (labels 0, 1, 2; 1000/500/500 images).
    Fixed split, per class: sort file names, shuffle with `random.Random(0)` (a fresh one per
    class), then the first 50% is train, the next 20% val, the last 30% test (500/200/300 for
    nominal, 250/100/150 per defect class; 1000/400/600 in all). Few-shot caches go to the
    user cache dir, never into the installed package.

    Args:
        root: ignored (the images live in the installed package).
    """
    dirs = [str(ccd.nominal_dir()), str(ccd.local_dir()), str(ccd.global_dir())]
    image_dir = os.path.commonpath(dirs)
    splits = {"train": [], "val": [], "test": []}
    for label, (name, folder) in enumerate(zip(TEXTILE_CLASSNAMES, dirs, strict=True)):
        files = list_images(require_dir(folder, f"textile {name} image directory"))
        random.Random(0).shuffle(files)
        n_train, n_val = textile_split(len(files))
        data = [Datum(os.path.join(folder, f), label, name) for f in files]
        splits["train"] += data[:n_train]
        splits["val"] += data[n_train : n_train + n_val]
        splits["test"] += data[n_train + n_val :]
    return Source(
        "textile", image_dir, list(TEXTILE_CLASSNAMES), splits["train"], splits["val"], splits["test"], None
    )


DATASETS: dict[str, Callable[..., Source]] = {
    "imagenet": read_imagenet,
    **{name: partial(read_split_json_dataset, name=name) for name in SPLIT_JSON_LAYOUTS},
    "fgvc_aircraft": read_fgvc_aircraft,
    "imagefolder": read_imagefolder,
    "textile": read_textile,
    "multidomain": read_multidomain,
    **{name: partial(read_imagenet_variant, name=name) for name in IMAGENET_VARIANTS},
    **{name: partial(read_cifar, name=name) for name in CIFAR_FOLDERS},  # torchvision's folders
}


FEWSHOT_SOURCES = ("sample", "jsonl")  # data.fewshot_source


def build_dataset(
    name: str, root=None, shots: int = 0, seed: int = 1, split_file=None, fewshot_source: str = "sample"
) -> FewShotDataset:
    """Read dataset `name` from the DATA folder `root`, subsampled to `shots` per class.

    Args:
        name: one of `DATASETS`.
        root: the DATA folder (CoOp layout); for `imagefolder` the folder holding train/ and
            test/; ignored for `textile`.
        shots: training images per class (val gets min(shots, 4)); 0 = all images.
        seed: sampling seed; the subset is cached as `split_fewshot/shot_{K}-seed_{S}.json`
            (with "jsonl": the seed of the files read).
        split_file: `imagefolder` only: read `root` through this CoOp split JSON
            (`read_imagefolder`).
        fewshot_source: "sample" draws the subset as CoOp does (`coop.data.fewshot`); "jsonl" reads
            2SFS's released split files from the dataset folder (`coop.data.jsonl_splits`).

    Returns:
        FewShotDataset with `classnames` and `train`/`val`/`test` lists of `Datum`; for the
        datasets in `TEST_ONLY_DATASETS`, only `test` (and `test_only=True`).

    Raises:
        DataError: a missing or malformed folder or file, an empty split, or `shots > 0` on a
            test-only dataset.
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(sorted(DATASETS))}")
    if shots < 0:
        raise DataError(f"shots must be >= 0, got {shots}")
    if shots > 0 and name in TEST_ONLY_DATASETS:
        raise test_only_error(name)  # before listing tens of thousands of images
    if split_file is not None and name != "imagefolder":
        raise DataError(f"a split file ({split_file}) is read by the imagefolder dataset only, not {name!r}")
    if fewshot_source not in FEWSHOT_SOURCES:
        raise DataError(
            f"data.fewshot_source must be one of {', '.join(FEWSHOT_SOURCES)}, got {fewshot_source!r}"
        )
    src = DATASETS[name](root) if split_file is None else read_imagefolder(root, split_file)
    if fewshot_source == "jsonl":
        ds = jsonl_fewshot_dataset(src, shots, seed)
    else:
        ds = fewshot_dataset(src, shots, seed)
    logger.info(
        "%s: %d classes, %d train / %d val / %d test images (shots=%d, seed=%d)",
        name,
        ds.num_classes,
        len(ds.train),
        len(ds.val),
        len(ds.test),
        shots,
        seed,
    )
    return ds
