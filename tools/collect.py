"""Collect finished runs into a table: mean ± std over seeds per setting.

    python tools/collect.py runs/position                       # group by the keys that vary
    python tools/collect.py runs/position --by data.shots prompt.position

Reads every `metrics.json` (with its `config.yaml`) under ROOT, groups the finished runs by
`--by` (default: the config keys whose values differ between runs, except data.seed and
output_dir) and prints one row per setting with the number of seeds. Writes `results.csv`
(numbers) and `results.md` (Markdown, plus the list of incomplete runs) into ROOT. Runs without
`metrics.json` are listed as incomplete, never dropped silently. Exit 1 when no run finished.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.results import format_markdown, incomplete_runs, load_runs, summarize, varying_keys  # noqa: E402

log = logging.getLogger("coop.collect")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="folder holding run folders (searched recursively)")
    ap.add_argument("--by", nargs="+", metavar="KEY", help="grouping config keys (default: those that vary)")
    ap.add_argument(
        "--ddof", type=int, default=1, choices=(0, 1), help="std: 1 = sample (default), 0 = population"
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)

    root = Path(args.root)
    runs = load_runs(root)
    incomplete = incomplete_runs(runs)
    if incomplete:
        print(f"{len(incomplete)} incomplete run(s) (no metrics.json):")
        for run in incomplete:
            print(f"  {run}")
    if not runs["complete"].any():
        print(f"no finished runs under {root}", file=sys.stderr)
        return 1
    by = args.by if args.by is not None else varying_keys(runs)
    table = summarize(runs, by, ddof=args.ddof)
    markdown = format_markdown(table)
    n_done = int(runs["complete"].sum())
    print(f"{n_done} finished run(s), grouped by {', '.join(by) or 'dataset and model'}:\n")
    print(markdown)
    table.to_csv(root / "results.csv", index=False)
    text = f"# Results: {root}\n\n{n_done} finished runs; mean ± std over seeds.\n\n{markdown}\n"
    if incomplete:
        text += "\n## Incomplete runs (no metrics.json)\n\n" + "".join(f"- {r}\n" for r in incomplete)
    (root / "results.md").write_text(text)
    print(f"\nwrote {root / 'results.csv'} and {root / 'results.md'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
