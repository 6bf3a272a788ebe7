"""Few-shot subsets drawn exactly as CoOp draws them, and cached with what they were drawn from.

    ds = fewshot_dataset(source, shots=16, seed=1)   # source: a reader's `Source`

The rule is Dassl's `generate_fewshot_dataset`, so a seed picks the same images as CoOp for
every dataset read from a split file (the nine `split_zhou_*.json` datasets, FGVC-Aircraft):

- one `random.Random(seed)` stream. CoOp calls `random.seed(seed)` before building the trainer,
  and building the dataset is the first thing that draws from Python's global stream;
- the items of a split grouped by label, labels in order of first appearance in the split,
  items in split order (Dassl's `split_dataset_by_label`, a defaultdict);
- per label, `random.sample(items, K)`; a label with fewer than K items keeps them all, in
  split order, and draws nothing from the stream (Dassl's `repeat=False`);
- train first, then val with min(K, 4) per label from the same stream;
- the subset is the per-label samples concatenated in that label order.

The subset is cached as JSON together with the sampler version, the class list, a hash of
the full train and val splits (items and their order) and, for a folder read through a split
file (`data.split_file`), that file's path. A cache whose record differs from the
current data is never used: it is resampled, with one warning line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import warnings
from collections import defaultdict
from pathlib import Path

from coop.data.base import (
    DataError,
    Datum,
    FewShotDataset,
    Source,
    cache_root,
    read_split_file,
    require_train_split,
    save_cache,
    to_items,
)

logger = logging.getLogger(__name__)

VAL_SHOTS_MAX = 4  # CoOp validates on min(K, 4) images per class
FEWSHOT_DIR = "split_fewshot"  # CoOp's cache folder, inside the dataset folder
# Bump whenever the same (data, shots, seed) would draw different images, so old caches are
# resampled. 1: per-class sorted paths, label order (caches without a "sampler" key); 2: CoOp's rule.
SAMPLER_VERSION = 2


def sample_per_class(
    data: list[Datum], k: int, rng: random.Random, classnames: list[str], split: str
) -> list[Datum]:
    """Draw `k` items per label with `rng`, as Dassl's `generate_fewshot_dataset` does.

    Labels are visited in order of first appearance in `data` and items keep their order in
    `data`; a label with fewer than `k` items keeps them all (with a warning) and draws nothing.

    Args:
        data: items to sample from, in split-file order.
        k: items per class.
        rng: a seeded `random.Random`, shared across calls so train and val draws differ.
        classnames: all class names; classes absent from `data` are warned about too.
        split: split name for warnings.
    """
    by_label: dict[int, list[Datum]] = defaultdict(list)  # insertion order = first appearance
    for d in data:
        by_label[d.label].append(d)
    out = []
    for group in by_label.values():
        out.extend(rng.sample(group, k) if len(group) >= k else group)
    for label, name in enumerate(classnames):
        n = len(by_label.get(label, ()))
        if n < k:
            warnings.warn(
                f"class {name!r} (label {label}) has only {n} {split} images, fewer than {k}; using all",
                stacklevel=5,  # the caller of build_dataset
            )
    return out


def draw_fewshot(src: Source, shots: int, seed: int) -> tuple[list[Datum], list[Datum]]:
    """CoOp's few-shot (train, val) of `src`: `shots` and min(`shots`, 4) per class, one seeded stream."""
    rng = random.Random(seed)  # the stream random.seed(seed) gives CoOp's dataset constructor
    train = sample_per_class(src.train, shots, rng, src.classnames, "train")
    val_shots = min(shots, VAL_SHOTS_MAX)
    val = sample_per_class(src.val, val_shots, rng, src.classnames, "val") if src.val else []
    return train, val


def image_relpath(path: str, image_dir: str) -> str:
    """`path` relative to `image_dir`: a prefix cut for a path under it, since os.path.relpath costs
    seconds on ImageNet's 1.28M paths."""
    prefix = os.path.join(image_dir, "")
    return path[len(prefix) :] if path.startswith(prefix) else os.path.relpath(path, image_dir)


def split_digest(src: Source) -> str:
    """SHA-256 of the full train and val splits (relative path, label, class name; in order)."""

    def rel(path: str) -> str:
        return image_relpath(path, src.image_dir)

    h = hashlib.sha256()
    for split in (src.train, src.val):
        # NUL cannot occur in a path; each split ends with a record separator of its own
        h.update("".join([f"{rel(d.path)}\0{d.label}\0{d.classname}\n" for d in split]).encode())
        h.update(b"\x1e")
    return h.hexdigest()


def _read_cache(path: Path, src: Source, record: dict) -> tuple[dict | None, str | None]:
    """(cached splits, None), or (None, why it is stale), or (None, None) when there is no file."""
    if not path.is_file():
        return None, None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable: {e}"
    if not isinstance(obj, dict) or "sampler" not in obj:
        return None, "written by an older version"
    for key, value in record.items():
        if obj.get(key) != value:
            return None, f"its {key} does not match the current one"
    try:
        cached = read_split_file(path, src.image_dir, keys=("train", "val"))
    except DataError as e:
        return None, str(e)
    for split, full in (("train", src.train), ("val", src.val)):
        known = {(d.path, d.label, d.classname) for d in full}
        if any((d.path, d.label, d.classname) not in known for d in cached[split]):
            return None, f"it lists {split} items that are not in the {split} split"
    return cached, None


def fewshot_dataset(src: Source, shots: int = 0, seed: int = 1) -> FewShotDataset:
    """Subsample `src` to `shots` images per class (train) and min(shots, 4) (val), cached.

    The subset is cached at `<dataset_dir>/split_fewshot/shot_{K}-seed_{S}.json` and read back
    from there; if that folder cannot be written (or the source has no `dataset_dir`) the cache
    goes to `$COOP_CACHE_DIR/<name>/split_fewshot/` instead.

    Args:
        src: full splits from a reader.
        shots: images per class; 0 keeps everything.
        seed: the sampling seed (CoOp's `SEED`).

    Raises:
        DataError: `shots > 0` on a test-only source, an empty train split, or an empty test split.
    """
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    if shots > 0:
        require_train_split(src)
    for split in ("test",) if src.test_only else ("train", "test"):
        if not getattr(src, split):
            raise DataError(f"{src.name} has no images in its {split} split (under {src.image_dir})")
    if shots == 0:
        return FewShotDataset(
            src.name, src.classnames, src.train, src.val, src.test, src.image_dir, 0, seed, src.test_only
        )

    record = {
        "dataset": src.name,
        "shots": shots,
        "seed": seed,
        "sampler": SAMPLER_VERSION,
        "classnames": list(src.classnames),
        "split_sha256": split_digest(src),
    }
    fname = f"shot_{shots}-seed_{seed}.json"
    if src.split_file is not None:  # one cache per split file of a folder (data.split_file)
        record["split_file"] = src.split_file
        fname = f"shot_{shots}-seed_{seed}-{Path(src.split_file).stem}.json"
    fallback = cache_root() / src.name / FEWSHOT_DIR / fname
    primary = Path(src.dataset_dir) / FEWSHOT_DIR / fname if src.dataset_dir else None
    stale = None
    for path in (primary, fallback):
        cached, why = _read_cache(path, src, record) if path is not None else (None, None)
        if cached is not None:
            logger.info("few-shot split of %s read from %s", src.name, path)
            train, val = cached["train"], cached["val"]
            break
        if why and stale is None:
            stale = (path, why)
    else:
        if stale:
            logger.warning("few-shot cache %s is stale (%s); resampling", *stale)
        train, val = draw_fewshot(src, shots, seed)
        obj = {**record, "train": to_items(train, src.image_dir), "val": to_items(val, src.image_dir)}
        save_cache(primary, fallback, obj, "few-shot split")
    return FewShotDataset(src.name, src.classnames, train, val, src.test, src.image_dir, shots, seed)
