"""Multi-domain image folders (PACS, Office-Home, VLCS, DomainNet): `root/<domain>/<class>/*`.

    src = read_multidomain("/data/pacs")                             # every domain, in-domain split
    src = read_multidomain("/data/pacs", target_domain="sketch")      # leave-one-domain-out
    ds = build_multidomain("/data/pacs", "sketch", shots=16, seed=1)  # few-shot, cached

Domains are the sorted sub-folders of `root`; classes are the sorted union of the class folders
over all domains (a class may be missing from some domain), and the class name is the folder
name. The split is fixed: per (domain, class), file names are sorted, shuffled with
`random.Random(0)`, and the first `n // 10` images are val, the next `n // 5` test and the rest
train (about 70/10/20).

- Without a target domain, train, val and test are the union over all domains of those parts.
- With `target_domain=t`, the test split is every image of domain t, and train and val come
  from the other (source) domains only: their train and test parts are train, their val part
  is val. No image of t is ever trained on.

A datum's domain is the first folder of its path under `root` (`domain_of`). Few-shot subsets of
a leave-one-domain-out source are cached under `root/.heldout-<t>/split_fewshot/` (a hidden
folder, so it is never read as a domain), apart from the in-domain ones in `root/split_fewshot/`.
"""

from __future__ import annotations

import os
import random

from coop.data.base import DataError, Datum, FewShotDataset, Source, require_dir, require_root
from coop.data.fewshot import FEWSHOT_DIR, fewshot_dataset
from coop.data.folders import list_class_dirs, list_images

NAME = "multidomain"
SPLIT_SEED = 0


def split_sizes(n: int) -> tuple[int, int]:
    """(val, test) sizes of a (domain, class) folder of `n` images; train is the rest."""
    return n // 10, n // 5


def list_domains(root: str) -> list[str]:
    """The domain folders of a multi-domain root, sorted; `split_fewshot` and hidden ones excluded."""
    domains = [d for d in list_class_dirs(root) if d != FEWSHOT_DIR]
    if not domains:
        raise DataError(f"multidomain root has no domain folders (expected root/<domain>/<class>/*): {root}")
    return domains


def domain_of(datum: Datum, image_dir: str) -> str:
    """The domain of a datum read from the multi-domain folder `image_dir`."""
    return os.path.relpath(datum.path, image_dir).split(os.sep)[0]


def read_multidomain(root, target_domain: str | None = None) -> Source:
    """Read `root/<domain>/<class>/*` with the fixed split above.

    Args:
        root: the folder holding one sub-folder per domain.
        target_domain: a domain to hold out as the test split (leave-one-domain-out), or None.

    Raises:
        DataError: a missing root, no domains, a domain without classes, an empty class folder
            or an unknown `target_domain`.
    """
    root = require_root(root)
    domains = list_domains(root)
    if target_domain is not None and target_domain not in domains:
        raise DataError(
            f"data.target_domain={target_domain!r} is not a domain of {root} (domains: {', '.join(domains)})"
        )
    per_domain = {}
    for domain in domains:
        classes = list_class_dirs(os.path.join(root, domain))
        if not classes:
            raise DataError(f"multidomain domain folder has no class folders: {os.path.join(root, domain)}")
        per_domain[domain] = classes
    classnames = sorted({c for classes in per_domain.values() for c in classes})
    label = {c: i for i, c in enumerate(classnames)}
    splits = {"train": [], "val": [], "test": []}
    for domain in domains:
        for c in per_domain[domain]:
            folder = os.path.join(root, domain, c)
            files = list_images(folder)
            if not files:
                raise DataError(f"multidomain class folder has no images: {folder}")
            random.Random(SPLIT_SEED).shuffle(files)
            data = [Datum(os.path.join(folder, f), label[c], c) for f in files]
            n_val, n_test = split_sizes(len(data))
            val, test, train = data[:n_val], data[n_val : n_val + n_test], data[n_val + n_test :]
            if target_domain is None:
                splits["train"] += train
                splits["val"] += val
                splits["test"] += test
            elif domain == target_domain:
                splits["test"] += data
            else:
                splits["train"] += train + test
                splits["val"] += val
    dataset_dir = root if target_domain is None else os.path.join(root, f".heldout-{target_domain}")
    return Source(NAME, root, classnames, splits["train"], splits["val"], splits["test"], dataset_dir)


def build_multidomain(
    root, target_domain: str | None = None, shots: int = 0, seed: int = 1
) -> FewShotDataset:
    """`read_multidomain` subsampled to `shots` images per class (0 = all), cached as usual.

    Args:
        root: the multi-domain folder.
        target_domain: the held-out test domain, or None for the in-domain split.
        shots: training images per class over all source domains together; val gets min(shots, 4).
        seed: the sampling seed.
    """
    require_dir(require_root(root), "multidomain root")
    return fewshot_dataset(read_multidomain(root, target_domain), shots, seed)
