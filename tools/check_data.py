"""The data doctor: check a CoOp DATA folder and say what to do about every problem.

    python tools/check_data.py DATA                              # the 11 datasets + 4 ImageNet variants
    python tools/check_data.py DATA --dataset dtd eurosat --full # decode every image
    python tools/check_data.py FOLDER --dataset imagefolder [--split-file split.json]
    python tools/check_data.py DATA --dataset cifar10 cifar100   # torchvision's CIFAR folders
    python tools/check_data.py DATA --dataset dtd --descriptions dtd.json [--model ViT-B-16]

Per dataset: the folder and split (or class-list) files where the readers look, whether the
split parses, the counts of classes and images per split against CoOp's published split sizes,
images the split lists that are missing, and images that do not decode (a sample of --sample
images, or all with --full, with a progress bar). Prints a table, one row per dataset, then one
line per finding saying which file to fetch, from where CoOp's DATASETS.md says to get it, and
where to put it.

2SFS's released few-shot split files in a dataset's split_fewshot/ (data.fewshot_source=jsonl)
are checked too: every entry must be an image of the split it lists (train or val), with its label.

With --descriptions (one dataset): the description file (`data.descriptions`) against the
dataset's classes, one line per class without sentences (an error: a run refuses it) and per class
with sentences longer than the context of --model's tokenizer, in tokens (a warning: a run
truncates them).

Errors make a dataset unusable (a run would fail or silently lose images: missing or corrupt
files, a missing or empty split). Differences leave it usable ("usable, differs from CoOp's
split"): it reads, but its sizes differ from CoOp's published split, so results are not
comparable with the papers. Repeat --dataset or give several names: they add up.

Read-only: nothing is written into DATA. Exit 0 when every dataset asked for (all 15 without
--dataset) is usable, 1 otherwise; with --strict, a difference also exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.data.doctor import CHECKABLE, COOP_DATASETS, check_dataset, format_reports  # noqa: E402
from coop.model.tokenizer import load_tokenizer, prompt_tokenizer  # noqa: E402
from coop.model.weights import resolve_model_name  # noqa: E402


def token_counter(model: str, directory: str | None):
    """(a sentence -> its tokens with the start and end tokens, the context length) of `model`'s
    tokenizer (or the one saved in `directory`)."""
    tok = prompt_tokenizer(load_tokenizer(resolve_model_name(model), directory))
    return (lambda text: len(tok.encode(text)) + tok.n_special), tok.context_length


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="the DATA folder (for --dataset imagefolder: the dataset folder)")
    ap.add_argument(
        "--dataset",
        nargs="+",
        action="extend",  # --dataset a --dataset b checks both
        choices=CHECKABLE,
        metavar="NAME",
        help="datasets to check, repeatable (default: all 15)",
    )
    ap.add_argument(
        "--strict", action="store_true", help="also fail (exit 1) on differences from CoOp's split"
    )
    ap.add_argument("--full", action="store_true", help="decode every image, not a sample")
    ap.add_argument(
        "--sample", type=int, default=50, help="images decoded per dataset without --full (default 50)"
    )
    ap.add_argument("--split-file", help="imagefolder: the split JSON to read the folder through")
    ap.add_argument("--descriptions", help="a description file (data.descriptions) to check; one --dataset")
    ap.add_argument(
        "--model",
        default="ViT-B-16",
        help="whose tokenizer counts the descriptions' tokens (default ViT-B-16)",
    )
    ap.add_argument("--tokenizer", help="--model's tokenizer saved in this folder (model.tokenizer)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)
    if not Path(args.data).is_dir():
        raise FileNotFoundError(f"DATA folder not found: {args.data}")
    names = list(dict.fromkeys(args.dataset or COOP_DATASETS))  # each once, in the order asked
    if args.descriptions is not None and len(names) != 1:
        ap.error(f"--descriptions {args.descriptions} describes one dataset: name it with --dataset")
    tokens = token_counter(args.model, args.tokenizer) if args.descriptions is not None else None
    sample = None if args.full else args.sample
    reports = [
        check_dataset(
            n, args.data, sample, args.split_file if n == "imagefolder" else None, args.descriptions, tokens
        )
        for n in names
    ]
    print(format_reports(reports))
    usable = sum(r.usable for r in reports)
    differ = sum(r.usable and not r.ok for r in reports)
    line = f"\n{usable} of {len(reports)} dataset(s) usable under {args.data}"
    if differ:
        line += f"; {differ} of them differ from CoOp's split sizes (not comparable with the papers)"
    print(line)
    failed = usable < len(reports) or (args.strict and differ > 0)
    return 1 if failed else 0


if __name__ == "__main__":
    run_cli(main)
