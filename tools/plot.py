"""Figures from finished runs: accuracy vs shots, vs deep-prompt depth, end vs middle, per round.

    python tools/plot.py runs/position [--out figures/] [--metric accuracy]

Writes into ROOT (or --out) only the figures the runs have data for:
  acc_vs_shots.png   metric vs data.shots, one line per other varying setting (position, csc,
                     n_ctx, ...), error bars = std over seeds, one panel per dataset;
  acc_vs_depth.png   metric vs prompt.depth, the same way;
  end_vs_middle.png  bars per dataset (and other setting): each class-token position at the
                     largest shot count that every position reached;
  acc_vs_round.png   federated runs (history.csv with a `round` column): metric per round, one
                     line per setting (the varying keys but the seed), mean with a ± std band
                     over seeds, one panel per dataset (and target domain, when it varies).
Prints which files were written (exit 1 when none could be).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.results.plots import FIGURES, write_figures  # noqa: E402
from coop.results.tables import load_runs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="folder holding run folders (searched recursively)")
    ap.add_argument("--out", help="folder for the PNG files (default: ROOT)")
    ap.add_argument("--metric", default="accuracy", help="metrics.json key to plot (default accuracy)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)

    runs = load_runs(args.root)
    done = runs[runs["complete"]] if len(runs) else runs
    if not len(done):
        print(f"no finished runs under {args.root}", file=sys.stderr)
        return 1
    if args.metric not in done:
        print(f"error: metric '{args.metric}' is not in the runs' metrics.json files", file=sys.stderr)
        return 2
    written = write_figures(runs, args.out or args.root, args.metric, root=args.root)
    for name in FIGURES:
        path = Path(args.out or args.root) / name
        print(
            f"{'wrote  ' if path in written else 'skipped'} {path}"
            + ("" if path in written else " (no data)")
        )
    return 0 if written else 1


if __name__ == "__main__":
    run_cli(main)
