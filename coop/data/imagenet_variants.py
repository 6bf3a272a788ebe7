"""Test-only ImageNet variants for domain generalisation: ImageNet-V2, -Sketch, -A and -R.

CoOp learns prompts on ImageNet and evaluates them on these four datasets, which have a test
split only. Folders (under the DATA root) and labels follow CoOp's readers:

| name | images | labels |
|---|---|---|
| `imagenetv2` | `imagenetv2/imagenetv2-matched-frequency-format-val/<i>/` | i = line i of classnames.txt |
| `imagenet_sketch` | `imagenet-sketch/images/<wnid>/` | sorted wnid folders (all 1000) |
| `imagenet_a` | `imagenet-adversarial/imagenet-a/<wnid>/` | sorted wnid folders (the 200 present) |
| `imagenet_r` | `imagenet-rendition/imagenet-r/<wnid>/` | sorted wnid folders (the 200 present) |

Each dataset folder holds its own `classnames.txt` (`<wnid> <class name>` for the 1000 ImageNet
classes, as in `imagenet/`); class names come from it. Their `Source` has `test_only=True`, so
`build_dataset(name, root, shots>0)` and `require_train_split` refuse them with a DataError.

    ds = build_dataset("imagenet_a", "/data")    # ds.test, ds.classnames (200), ds.test_only
"""

from __future__ import annotations

import os
from typing import NamedTuple

from coop.data.base import DataError, Datum, Source, require_dir, require_file, require_root
from coop.data.folders import list_class_dirs, list_class_images, read_wnid_classnames


class VariantLayout(NamedTuple):
    folder: str  # dataset folder under the DATA root, holding classnames.txt
    images: str  # image folder under it, one sub-folder per class
    by_index: bool  # class folders named 0..n-1 after classnames.txt lines (V2), else wnids


IMAGENET_VARIANTS = {
    "imagenetv2": VariantLayout("imagenetv2", "imagenetv2-matched-frequency-format-val", True),
    "imagenet_sketch": VariantLayout("imagenet-sketch", "images", False),
    "imagenet_a": VariantLayout("imagenet-adversarial", "imagenet-a", False),
    "imagenet_r": VariantLayout("imagenet-rendition", "imagenet-r", False),
}
TEST_ONLY_DATASETS = tuple(IMAGENET_VARIANTS)
CLASSNAMES_FILE = "classnames.txt"  # in each variant's folder: a copy of imagenet/classnames.txt


def _class_folders(name: str, image_dir: str, wnid2name: dict[str, str], by_index: bool, where: str):
    """(class folder names, class names) in label order."""
    present = list_class_dirs(image_dir)
    if by_index:
        folders = [str(i) for i in range(len(wnid2name))]
        extra = sorted(set(present) - set(folders))
        if extra:
            raise DataError(
                f"{name} folder {os.path.join(image_dir, extra[0])} is not a class index "
                f"0..{len(folders) - 1} of {where}"
            )
        for f in folders:
            require_dir(os.path.join(image_dir, f), f"{name} class folder")
        return folders, list(wnid2name.values())
    if not present:
        raise DataError(f"{name} image directory has no class folders: {image_dir}")
    for wnid in present:
        if wnid not in wnid2name:
            raise DataError(f"{name} class folder {os.path.join(image_dir, wnid)} is not listed in {where}")
    return present, [wnid2name[w] for w in present]


def read_imagenet_variant(root, name: str) -> Source:
    """Read one of `IMAGENET_VARIANTS` (a test split only) from the DATA folder `root`.

    Args:
        root: the DATA folder.
        name: key of `IMAGENET_VARIANTS`.
    """
    layout = IMAGENET_VARIANTS[name]
    dataset_dir = require_dir(os.path.join(require_root(root), layout.folder), f"{name} dataset directory")
    image_dir = require_dir(os.path.join(dataset_dir, layout.images), f"{name} image directory")
    classnames_file = require_file(os.path.join(dataset_dir, CLASSNAMES_FILE), f"{name} {CLASSNAMES_FILE}")
    wnid2name = read_wnid_classnames(classnames_file)
    folders, classnames = _class_folders(name, image_dir, wnid2name, layout.by_index, classnames_file)
    test = []
    for label, folder in enumerate(folders):
        class_dir = os.path.join(image_dir, folder)
        test += [
            Datum(os.path.join(class_dir, f), label, classnames[label])
            for f in list_class_images(class_dir, name)
        ]
    return Source(name, image_dir, classnames, [], [], test, dataset_dir, test_only=True)
