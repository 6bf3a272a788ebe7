"""Shared dataset machinery: records, split files, the test-only flag and JSON caches.

Every reader in `coop.data.datasets` returns a `Source` (the full splits plus where its
paths are relative to); `coop.data.fewshot.fewshot_dataset` turns it into the
`FewShotDataset` that training code sees. Split-file reading and cache writing live here,
few-shot sampling in `coop.data.fewshot`, and nowhere else.

Caches are JSON with paths relative to the image directory, in CoOp's split-file item format
`[relative_path, label, classname]`, so a DATA folder can be moved or mounted elsewhere.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from coop.io import write_json

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset folder, split file or image is missing or malformed."""


@dataclass(frozen=True)
class Datum:
    """One labelled image: absolute `path`, integer `label`, and its `classname`."""

    path: str
    label: int
    classname: str


@dataclass
class FewShotDataset:
    """A dataset ready for training: `classnames[label]` names each label.

    `shots == 0` means the full training set; otherwise `train` holds `shots` images per class
    and `val` min(shots, 4) per class, sampled with `seed`. `test` is never subsampled.
    `test_only` datasets (the ImageNet variants of domain generalisation) have only `test`;
    `train` and `val` are empty, and `require_train_split` refuses them.
    """

    name: str
    classnames: list[str]
    train: list[Datum]
    val: list[Datum]
    test: list[Datum]
    image_dir: str = ""
    shots: int = 0
    seed: int = 1
    test_only: bool = False

    @property
    def num_classes(self) -> int:
        return len(self.classnames)


@dataclass
class Source:
    """What a reader returns: full splits, the folder paths are relative to, and cache places.

    `dataset_dir` is where `split_fewshot/` goes (CoOp's convention); None means the dataset
    folder is not ours to write (e.g. a pip package), so only the user cache dir is used.
    `test_only` marks a source with a test split only (its `train` and `val` are empty).
    `split_file` is the split JSON a folder was read through (`imagefolder` with
    `data.split_file`); the few-shot cache records it.
    """

    name: str
    image_dir: str
    classnames: list[str]
    train: list[Datum]
    val: list[Datum]
    test: list[Datum]
    dataset_dir: str | None = None
    test_only: bool = False
    split_file: str | None = None


def test_only_error(name: str) -> DataError:
    """The one-line error for training (or few-shot sampling) on a test-only dataset."""
    return DataError(
        f"{name} is a test-only dataset (domain generalization); "
        "train on imagenet and evaluate with eval.targets"
    )


def require_train_split(ds: FewShotDataset | Source) -> None:
    """Raise DataError if `ds` has no train split to learn from (a test-only dataset).

    Args:
        ds: a dataset from `build_dataset`, or a reader's `Source`.
    """
    if ds.test_only:
        raise test_only_error(ds.name)


def cache_root() -> Path:
    """The user cache folder: `$COOP_CACHE_DIR`, default `~/.cache/coop` (read at call time)."""
    return Path(os.environ.get("COOP_CACHE_DIR") or "~/.cache/coop").expanduser()


def require_dir(path: str | os.PathLike, what: str) -> str:
    """Return `path` as an absolute string, or raise DataError if it is not a directory.

    Args:
        path: folder to check.
        what: what the folder should be, for the message (e.g. "dtd image directory").
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isdir(path):
        raise DataError(f"{what} not found: {path}")
    return path


def require_root(root) -> str:
    """The DATA folder `root` as an absolute string; DataError if it is None or not a folder."""
    if root is None:
        raise DataError("dataset root is None: pass the DATA folder that holds the dataset")
    return require_dir(root, "dataset root")


def require_file(path: str | os.PathLike, what: str) -> str:
    """Return `path` as an absolute string, or raise DataError if it is not a file.

    Args:
        path: file to check.
        what: what the file should be, for the message.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(path):
        raise DataError(f"{what} not found: {path}")
    return path


def load_json(path: str | os.PathLike):
    """Load a JSON file, raising DataError (naming the file) if it is not valid JSON."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"malformed JSON file {path}: {e}") from e


def parse_items(items, image_dir: str, where: str) -> list[Datum]:
    """Turn split-file items `[rel_path, label, classname]` into Datums with absolute paths.

    Args:
        items: the JSON list.
        image_dir: folder the relative paths are joined to.
        where: file (and split) the items came from, for error messages.
    """
    if not isinstance(items, list):
        raise DataError(f"malformed split file {where}: expected a list of [path, label, classname]")
    out = []
    for item in items:
        ok = (
            isinstance(item, list | tuple)
            and len(item) == 3
            and isinstance(item[0], str)
            and isinstance(item[1], int)
            and not isinstance(item[1], bool)
            and isinstance(item[2], str)
        )
        if not ok:
            raise DataError(
                f"malformed split file {where}: bad item {item!r}, expected [path, label, classname]"
            )
        out.append(Datum(os.path.join(image_dir, item[0]), item[1], item[2]))
    return out


def read_split_file(path: str | os.PathLike, image_dir: str, keys=("train", "val", "test")) -> dict:
    """Read a CoOp split JSON (`{"train": [[rel_path, label, classname], ...], ...}`).

    Args:
        path: the JSON file.
        image_dir: folder the relative paths are joined to.
        keys: splits that must be present.

    Returns:
        dict split name -> list[Datum] (absolute paths), for each key in `keys`.
    """
    obj = load_json(path)
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
        raise DataError(f"malformed split file {path}: expected a JSON object with keys {list(keys)}")
    return {k: parse_items(obj[k], image_dir, f"{path} [{k}]") for k in keys}


def to_items(data: list[Datum], image_dir: str) -> list[list]:
    """Datums as split-file items `[path relative to image_dir, label, classname]`."""
    return [[os.path.relpath(d.path, image_dir), d.label, d.classname] for d in data]


def classnames_from_items(splits: dict[str, list[Datum]], where: str) -> list[str]:
    """Recover `classnames[label]` from split items, checking labels are 0..n-1 and consistent.

    Args:
        splits: split name -> items, as returned by `read_split_file`.
        where: the split file, for error messages.
    """
    lab2name: dict[int, str] = {}
    for data in splits.values():
        for d in data:
            known = lab2name.setdefault(d.label, d.classname)
            if known != d.classname:
                raise DataError(
                    f"malformed split file {where}: label {d.label} is both {known!r} and {d.classname!r}"
                )
    n = max(lab2name, default=-1) + 1
    missing = [i for i in range(n) if i not in lab2name]
    if not lab2name or missing or min(lab2name) < 0:
        raise DataError(f"malformed split file {where}: labels must cover 0..n-1 (missing {missing[:5]})")
    return [lab2name[i] for i in range(n)]


SUBSAMPLE = ("all", "base", "new")


def subsample_classes(ds: FewShotDataset, which: str = "all") -> FewShotDataset:
    """The base-to-new protocol (CoCoOp): keep the first ceil(n/2) classes ("base") or the rest ("new").

    Kept classes are relabelled from 0 in their original order; "all" returns `ds` unchanged.

    Args:
        ds: a dataset from `build_dataset` (already few-shot sampled, as CoCoOp does).
        which: "all", "base" or "new".
    """
    if which not in SUBSAMPLE:
        raise ValueError(f"subsample_classes must be one of {', '.join(SUBSAMPLE)}, got {which!r}")
    if which == "all":
        return ds
    m = math.ceil(len(ds.classnames) / 2)
    kept = range(m) if which == "base" else range(m, len(ds.classnames))
    relabel = {old: new for new, old in enumerate(kept)}

    def keep(items: list[Datum]) -> list[Datum]:
        return [Datum(d.path, relabel[d.label], d.classname) for d in items if d.label in relabel]

    names = [ds.classnames[i] for i in kept]
    return FewShotDataset(
        ds.name,
        names,
        keep(ds.train),
        keep(ds.val),
        keep(ds.test),
        ds.image_dir,
        ds.shots,
        ds.seed,
        ds.test_only,
    )


def save_cache(primary: Path | None, fallback: Path, obj, what: str) -> Path | None:
    """Write `obj` to `primary`, or to `fallback` (with a warning) if `primary` is not writable.

    A cache that cannot be written anywhere is only logged: everything it holds can be recomputed.

    Args:
        primary: preferred location (inside the dataset folder), or None to use `fallback`.
        fallback: location in the user cache dir.
        obj: JSON-serialisable content.
        what: description for log messages.

    Returns:
        The path written, or None.
    """
    if primary is not None:
        try:
            write_json(primary, obj)
            logger.info("%s cached at %s", what, primary)
            return primary
        except OSError as e:
            logger.warning("cannot write %s cache %s (%s); using %s instead", what, primary, e, fallback)
    try:
        write_json(fallback, obj)
        logger.info("%s cached at %s", what, fallback)
        return fallback
    except OSError as e:
        logger.warning("cannot write %s cache %s (%s); not caching", what, fallback, e)
        return None
