"""The data doctor: check a CoOp DATA folder and say what to do about every problem.

    python tools/check_data.py DATA                              # the 11 datasets + 4 ImageNet variants
    python tools/check_data.py DATA --dataset dtd eurosat --full # decode every image
    python tools/check_data.py FOLDER --dataset imagefolder [--split-file split.json]
    python tools/check_data.py DATA --dataset cifar10 cifar100   # torchvision's CIFAR folders

Per dataset: the folder and split (or class-list) files where the readers look, whether the
split parses, the counts of classes and images per split against CoOp's published split sizes,
images the split lists that are missing, and images that do not decode (a sample of --sample
images, or all with --full, with a progress bar). Prints a table, one row per dataset (ok /
problems), then one line per problem saying which file to fetch, from where CoOp's DATASETS.md
says to get it, and where to put it.

Read-only: nothing is written into DATA. Exit 0 only when every dataset asked for (all 15
without --dataset) is usable, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.data.doctor import CHECKABLE, COOP_DATASETS, check_dataset, format_reports  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="the DATA folder (for --dataset imagefolder: the dataset folder)")
    ap.add_argument(
        "--dataset", nargs="+", choices=CHECKABLE, metavar="NAME", help="datasets to check (default: all 15)"
    )
    ap.add_argument("--full", action="store_true", help="decode every image, not a sample")
    ap.add_argument(
        "--sample", type=int, default=50, help="images decoded per dataset without --full (default 50)"
    )
    ap.add_argument("--split-file", help="imagefolder: the split JSON to read the folder through")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)
    if not Path(args.data).is_dir():
        raise FileNotFoundError(f"DATA folder not found: {args.data}")
    names = args.dataset or list(COOP_DATASETS)
    sample = None if args.full else args.sample
    reports = [
        check_dataset(n, args.data, sample, args.split_file if n == "imagefolder" else None) for n in names
    ]
    print(format_reports(reports))
    usable = sum(r.ok for r in reports)
    print(f"\n{usable} of {len(reports)} dataset(s) usable under {args.data}")
    return 0 if usable == len(reports) else 1


if __name__ == "__main__":
    run_cli(main)
