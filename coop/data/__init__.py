"""Datasets for CoOp prompt learning: readers for CoOp's DATA layout, few-shot splits, loading.

    from coop.data import build_dataset, build_transforms, ImageDataset, collate_skip_none
    ds = build_dataset("oxford_pets", "/data", shots=16, seed=1)
    train_tf, test_tf = build_transforms(224)
    train_set = ImageDataset(ds.train, train_tf)

Modules: `base` (records, split files, caches), `fewshot` (CoOp's few-shot sampling rule and
its cache), `jsonl_splits` (2SFS's released few-shot split files, `data.fewshot_source=jsonl`), `folders` (listing class folders), `datasets` (one reader per dataset, `DATASETS`,
`build_dataset`), `imagenet_variants` (the test-only ImageNet-V2/-Sketch/-A/-R readers),
`images` (image loading and transforms), `splits` (CoOp split files for custom class folders),
`doctor` (the data doctor), `descriptions` (class descriptions, `data.descriptions`), `describe`
(writing them with a local language model, `tools/describe.py`) and
`catalog` (CoOp's published split sizes and download sources).

Datasets in `TEST_ONLY_DATASETS` have a test split only (`FewShotDataset.test_only`);
`require_train_split(ds)` raises a one-line DataError for them.

The data layer, beside coop.model: may import coop.config and the root modules (coop.io).
Imported by: coop.methods, coop.train, coop.results, coop.federated, coop.interop and the tools.
"""

from coop.data.base import (
    SUBSAMPLE,
    DataError,
    Datum,
    FewShotDataset,
    require_train_split,
    subsample_classes,
)
from coop.data.datasets import DATASETS, TEST_ONLY_DATASETS, build_dataset
from coop.data.images import CLIP_MEAN, CLIP_STD, ImageDataset, Views, build_transforms, collate_skip_none

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "DATASETS",
    "DataError",
    "Datum",
    "FewShotDataset",
    "SUBSAMPLE",
    "TEST_ONLY_DATASETS",
    "ImageDataset",
    "Views",
    "build_dataset",
    "build_transforms",
    "collate_skip_none",
    "require_train_split",
    "subsample_classes",
]
