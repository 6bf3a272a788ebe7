"""Datasets for CoOp prompt learning: readers for CoOp's DATA layout, few-shot splits, loading.

    from coop.data import build_dataset, build_transforms, ImageDataset, collate_skip_none
    ds = build_dataset("oxford_pets", "/data", shots=16, seed=1)
    train_tf, test_tf = build_transforms(224)
    train_set = ImageDataset(ds.train, train_tf)

Modules: `base` (records, split files, few-shot sampling and caches), `datasets` (one reader
per dataset, `DATASETS`, `build_dataset`), `images` (image loading and transforms).
"""

from coop.data.base import SUBSAMPLE, DataError, Datum, FewShotDataset, subsample_classes
from coop.data.datasets import DATASETS, build_dataset
from coop.data.images import CLIP_MEAN, CLIP_STD, ImageDataset, build_transforms, collate_skip_none

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "DATASETS",
    "DataError",
    "Datum",
    "FewShotDataset",
    "SUBSAMPLE",
    "ImageDataset",
    "build_dataset",
    "build_transforms",
    "collate_skip_none",
    "subsample_classes",
]
