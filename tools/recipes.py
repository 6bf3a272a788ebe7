"""Print every method's resolved recipe per dataset: optimizer, lr, schedule, length, batch, shots
and the method's own keys, as the code resolves them (`coop.results.recipe_table`).

    python tools/recipes.py                                  # every method, every dataset
    python tools/recipes.py --method tcp --dataset imagenet  # one cell
    python tools/recipes.py --method tcp,mmrl --dataset imagenet,sun397,dtd
    python tools/recipes.py --method maple+dept              # DePT on a host has its own recipe
    python tools/recipes.py --config configs/mmrl/vit_b16_few_shot.yaml   # a file's recipe
    python tools/recipes.py --method mmrl train.lr=0.002     # with key=value overrides
    python tools/recipes.py --write docs/recipes.md          # regenerate the manual's table

Output is markdown: per method, the values every dataset shares, then a row per dataset for the
keys that differ. Exit 2 with one line for an unknown method, dataset, file or key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli  # noqa: E402

from coop.config.checks import ConfigError
from coop.data import DATASETS  # noqa: E402
from coop.results.recipe_table import RECIPE_METHODS, recipe_document, recipe_markdown  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    ap.add_argument("--method", metavar="M[,M...]", help=f"comma-separated, of {', '.join(RECIPE_METHODS)}")
    ap.add_argument(
        "--dataset", metavar="D[,D...]", help="comma-separated (default: CoOp's 11 and any other)"
    )
    ap.add_argument("--config", help="resolve under this config file (its method unless --method)")
    ap.add_argument("--write", metavar="PATH", help="write the whole table (docs/recipes.md) to PATH")
    args = ap.parse_args(argv)
    if args.write:
        if args.method or args.dataset or args.config or args.overrides:
            ap.error("--write writes every method on every dataset; drop the other options")
        Path(args.write).write_text(recipe_document())
        print(f"wrote {args.write}")
        return 0
    datasets = args.dataset.split(",") if args.dataset else None
    for dataset in datasets or ():
        if dataset not in DATASETS:
            raise ConfigError(f"dataset {dataset!r} is not one of {', '.join(DATASETS)}")
    methods = args.method.split(",") if args.method else None
    if methods is None and (args.config or args.overrides):
        methods = [None]  # the method the file or overrides choose
    print(recipe_markdown(methods, datasets, args.config, tuple(args.overrides)), end="")
    return 0


if __name__ == "__main__":
    run_cli(main)
