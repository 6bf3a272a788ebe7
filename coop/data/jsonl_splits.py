"""Released few-shot splits in 2SFS's `.jsonl` format (`data.fewshot_source=jsonl`).

    ds = jsonl_fewshot_dataset(src, shots=16, seed=1)   # src: a reader's `Source`; a FewShotDataset

2SFS (FarinaMatteo/rethinking_fewshot_vlms) releases the exact K-shot splits it trained on, put in
each dataset's folder by its `scripts/download_splits.sh` and read by its dataset classes:

    <dataset folder>/split_fewshot/shot_{K}-seed_{S}_train.jsonl
    <dataset folder>/split_fewshot/shot_{K}-seed_{S}_val.jsonl      (none for ImageNet)

one JSON object per line, `{"_impath": ..., "_label": ..., "_domain": ..., "_classname": ...}`
(its `load_jsonl` and `dict2datum`). `_impath` was written on the authors' machine, so it is
matched to this DATA folder by its path inside the dataset's image folder: the longest tail of its
components that is the path, relative to the reader's image folder, of an image of the reader's
train split (for a `_train` file; of its val split for a `_val` file) ("/home/x/data/dtd/images/banded/banded_0002.jpg" is "banded/banded_0002.jpg"
of dtd's `images/`). The shots are exactly the listed images, in the file's order, with the
reader's labels; an entry that does not resolve, or whose `_label` is not the reader's label of
that image, is a one-line DataError naming the file, the line and the path. Without a val file
(ImageNet) the val images are CoOp's draw (`coop.data.fewshot.draw_fewshot`), with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from coop.data.base import DataError, Datum, FewShotDataset, Source, require_train_split
from coop.data.fewshot import FEWSHOT_DIR, draw_fewshot, image_relpath

logger = logging.getLogger(__name__)

JSONL_NAME = "shot_{shots}-seed_{seed}_{split}.jsonl"
JSONL_FILE = re.compile(r"shot_\d+-seed_\d+_(train|val)\.jsonl")  # any (shots, seed)


def jsonl_path(dataset_dir: str, shots: int, seed: int, split: str) -> Path:
    """Where 2SFS's `split` ("train" or "val") file of (shots, seed) sits in a dataset folder."""
    return Path(dataset_dir) / FEWSHOT_DIR / JSONL_NAME.format(shots=shots, seed=seed, split=split)


def image_index(items: list[Datum], image_dir: str) -> dict[str, Datum]:
    """`items` by their path relative to `image_dir` ('/'-separated)."""
    return {image_relpath(d.path, image_dir).replace(os.sep, "/"): d for d in items}


def split_of(path: str | Path) -> str:
    """ "train" or "val": the split a 2SFS file's name says it lists."""
    return "val" if str(path).endswith("_val.jsonl") else "train"


def resolve(impath: str, index: dict[str, Datum]) -> Datum | None:
    """The image of `index` whose relative path is the longest tail of `impath`'s components, or None."""
    parts = [p for p in impath.replace("\\", "/").split("/") if p]
    for k in range(len(parts)):
        found = index.get("/".join(parts[k:]))
        if found is not None:
            return found
    return None


def read_jsonl_split(path: Path, src: Source) -> list[Datum]:
    """The images a 2SFS split file lists, in its order, resolved against the split of `src` that its
    name says (`split_of`: a train file's shots are train images, a val file's val images).

    Raises:
        DataError: in one line naming `path` and the line: a line that is not an object with a string
            `_impath` and an integer `_label`, a path that does not resolve, or another label.
    """
    split = split_of(path)
    index = image_index(getattr(src, split), src.image_dir)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.fewshot_source=jsonl: cannot read {path} ({e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"data.fewshot_source=jsonl: {path} line {n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where} is not JSON ({e})") from None
        ok = isinstance(item, dict) and isinstance(item.get("_impath"), str)
        label = item.get("_label") if ok else None
        if not ok or not isinstance(label, int) or isinstance(label, bool):
            raise DataError(f"{where} is not an object with a string _impath and an integer _label")
        found = resolve(item["_impath"], index)
        if found is None:
            raise DataError(
                f"{where}: {item['_impath']} is no image of {src.name}'s {split} split under {src.image_dir}"
            )
        if found.label != label:
            raise DataError(
                f"{where}: {item['_impath']} has _label {label}, but {src.name} labels {found.path} {found.label}"
            )
        out.append(found)
    if not out:
        raise DataError(f"data.fewshot_source=jsonl: {path} lists no images")
    return out


def jsonl_fewshot_dataset(src: Source, shots: int, seed: int) -> FewShotDataset:
    """`src` with the few-shot train and val images of 2SFS's files for (shots, seed) in its dataset
    folder (`split_fewshot/`, CoOp's folder, where 2SFS's script puts them); nothing is cached.

    Raises:
        DataError: `shots` < 1, a test-only source, no dataset folder, no train file, or a file
            that does not resolve (`read_jsonl_split`).
    """
    if shots < 1:
        raise DataError(
            f"data.fewshot_source=jsonl reads a K-shot split: data.shots must be >= 1, got {shots}"
        )
    require_train_split(src)
    if src.dataset_dir is None:
        raise DataError(f"data.fewshot_source=jsonl: {src.name} has no dataset folder to hold {FEWSHOT_DIR}/")
    train_path, val_path = (jsonl_path(src.dataset_dir, shots, seed, s) for s in ("train", "val"))
    if not train_path.is_file():
        raise DataError(f"data.fewshot_source=jsonl: {train_path} does not exist")
    train = read_jsonl_split(train_path, src)
    if val_path.is_file():
        val = read_jsonl_split(val_path, src)
    else:
        logger.warning("%s does not exist: the val images are CoOp's draw of min(K, 4) per class", val_path)
        val = draw_fewshot(src, shots, seed)[1]
    logger.info("few-shot split of %s read from %s", src.name, train_path)
    return FewShotDataset(src.name, src.classnames, train, val, src.test, src.image_dir, shots, seed)
