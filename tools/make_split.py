"""Write a CoOp split file for a folder of class sub-folders (a custom dataset).

    python tools/make_split.py FOLDER --out split.json [--val 0.2 --test 0.3 --seed 1]
    python tools/train.py data.name=imagefolder data.root=FOLDER data.split_file=split.json

FOLDER holds one sub-folder per class (`FOLDER/<class>/*.jpg`). Each class is split on its own
(stratified): `--test` and `--val` of its images (rounded, at least one each) go to test and val,
the rest to train; which ones is deterministic in `--seed`. The output is CoOp's split format
(`train`/`val`/`test` lists of `[path relative to FOLDER, label, class name]`), so every
protocol, base-to-new included, runs on it through `data.split_file`. An empty class, or one too
small for the requested split, is a one-line error. Nothing is written into FOLDER.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.data.splits import make_split  # noqa: E402
from coop.io import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="folder of class sub-folders")
    ap.add_argument("--out", required=True, help="the split JSON to write")
    ap.add_argument("--val", type=float, default=0.2, help="fraction of each class for val (default 0.2)")
    ap.add_argument("--test", type=float, default=0.3, help="fraction of each class for test (default 0.3)")
    ap.add_argument("--seed", type=int, default=1, help="shuffling seed (default 1)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)
    split = make_split(args.folder, val=args.val, test=args.test, seed=args.seed)
    write_json(args.out, split)
    n_classes = len({item[1] for item in split["train"]})
    sizes = ", ".join(f"{len(split[s])} {s}" for s in ("train", "val", "test"))
    smallest = min(Counter(item[1] for item in split["train"]).values())
    print(f"wrote {args.out}: {n_classes} classes, {sizes} (at least {smallest} train images per class)")
    return 0


if __name__ == "__main__":
    run_cli(main)
