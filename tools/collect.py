"""Collect finished runs into a table: mean ± std over seeds per setting.

    python tools/collect.py runs/position                       # group by the keys that vary
    python tools/collect.py runs/position --by data.shots prompt.position
    python tools/collect.py runs/ --table datasets              # the papers' layout
    python tools/collect.py runs/latent_domains --table domains # leave-one-domain-out
    python tools/collect.py runs/base_to_new --table datasets --published   # beside the papers
    python tools/collect.py runs/b2n --table base_to_new --published       # CoCoOp's Table 1 layout
    python tools/collect.py runs/fedpgp --table personal       # personalised federated metrics

Reads every `metrics.json` (with its `config.yaml`) under ROOT and groups the finished runs by
`--by` (default: the config keys whose values differ between runs, except data.seed and the keys
that cannot change a result: device, output_dir, data.root, data.num_workers,
train.eval_batch_size, train.cache_features).

--table settings (default): one row per setting with the number of seeds; writes `results.csv`
and `results.md`. Base-to-new runs get `new_accuracy`, `hm` (harmonic mean of the seed-averaged
base and new accuracies, as CoCoOp reports it) and `hm_per_seed` (mean of per-seed HMs).

--table datasets: one row per method and setting, one column per dataset (transfer targets from
`eval_<dataset>.json` included), then the Average of complete rows; cells are mean ± std over
seeds with the number of seeds; writes `results_datasets.csv` and `results_datasets.md`.

--published (with --table datasets): under each of our rows that has a published counterpart
(coop/results/published.py: ViT-B/16 runs with OpenAI weights; the protocol is read from the runs), the
paper's row and a Δ row (ours minus the paper's), same columns, and one line per paper row naming
its sources and how many of its figures were checked against the paper; for each row without a
paper row, one line saying why.

--table base_to_new: base-to-new runs (data.subsample_classes=base): one row per method and
setting; per dataset Base, New (mean ± std over seeds, n) and H (their harmonic mean), then the
Average block, whose H is the harmonic mean of the averaged Base and New (the papers' convention,
not the mean of the per-dataset H); writes `results_base_to_new.csv` and `results_base_to_new.md`.
With --published, the paper's row and a Δ row under each of ours, as for --table datasets.

--table domains: leave-one-domain-out runs (data.target_domain set, e.g. federated runs on
multi-domain data): one row per method and setting, one column per target domain (the accuracy
on the held-out domain, mean ± std over seeds, n), then the Average over the target domains of
complete rows; writes `results_domains.csv` and `results_domains.md`.

--table test_time: test-time passes (tools/tta.py, docs/test_time.md): one row per test-time
method and host, one column per dataset (mean ± std over seeds, n), then the OOD average (ImageNet-V2,
-Sketch, -A, -R) and the 10-dataset average; --published adds the papers' averages (ViT-B/16) as
rows; writes `results_test_time.csv` and `results_test_time.md`.

--table personal: personalised federated runs (fl.method=fedotp or fedpgp): one row per setting,
the final-round value and the mean of the last 5 rounds of Local, Base, Novel, HM (of the three),
HM(Base, Novel) and the global accuracy (docs/federated.md), each mean ± std over seeds; writes
`results_personal.csv` and `results_personal.md`.

Files go into ROOT, or --out. Runs without `metrics.json` are listed as incomplete, never dropped
silently. Exit 1 when no run finished.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.io import require_writable  # noqa: E402
from coop.results import base_to_new, tta_table  # noqa: E402
from coop.results.markdown import format_dataset_markdown, format_markdown  # noqa: E402
from coop.results.reproduce import with_published  # noqa: E402
from coop.results.tables import (  # noqa: E402
    PERSONAL_METRICS,
    dataset_table,
    domain_table,
    incomplete_runs,
    load_runs,
    summarize,
    varying_keys,
)

log = logging.getLogger("coop.collect")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="folder holding run folders (searched recursively)")
    ap.add_argument("--by", nargs="+", metavar="KEY", help="grouping config keys (default: those that vary)")
    ap.add_argument(
        "--table",
        choices=("settings", "datasets", "base_to_new", "domains", "personal", "test_time"),
        default="settings",
        help="table layout",
    )
    ap.add_argument(
        "--metric", default="accuracy", help="cell metric of --table datasets/domains (default accuracy)"
    )
    ap.add_argument("--out", help="folder for the table files (default: ROOT)")
    ap.add_argument(
        "--ddof", type=int, default=1, choices=(0, 1), help="std: 1 = sample (default), 0 = population"
    )
    ap.add_argument(
        "--published",
        action="store_true",
        help="--table datasets or base_to_new: add the papers' rows and Δ rows; test_time: the papers' rows",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.published and args.table not in ("datasets", "base_to_new", "test_time"):
        ap.error("--published needs --table datasets, base_to_new or test_time")
    setup_logging(args.verbose)

    root = Path(args.root)
    out = require_writable(args.out or root, folder=True)  # before the runs are read
    runs = load_runs(root)
    incomplete = incomplete_runs(runs)
    if incomplete:
        print(f"{len(incomplete)} incomplete run(s) (no metrics.json):")
        for run in incomplete:
            print(f"  {run}")
    if not runs["complete"].any():
        print(f"no finished runs under {root}", file=sys.stderr)
        return 1
    n_done = int(runs["complete"].sum())
    if args.table == "datasets":
        table = dataset_table(runs, args.metric, args.by, ddof=args.ddof)
        notes = []
        if args.published:
            table, notes = with_published(table, runs, args.metric)
        markdown = format_dataset_markdown(table)
        if notes:
            markdown += "\n\nPaper rows:\n" + "".join(f"- {n}\n" for n in notes).rstrip("\n")
        intro = f"{n_done} finished run(s); {args.metric}, mean ± std over seeds (n = seeds)"
        stem = "results_datasets"
    elif args.table == "base_to_new":
        table = base_to_new.base_to_new_table(runs, args.by, ddof=args.ddof)
        notes = []
        if args.published:
            table, notes = base_to_new.with_published(table, runs)
        markdown = base_to_new.format_base_to_new_markdown(table)
        if notes:
            markdown += "\n\nPaper rows:\n" + "".join(f"- {n}\n" for n in notes).rstrip("\n")
        intro = (
            f"{n_done} finished run(s); Base and New accuracy, mean ± std over seeds (n = seeds); "
            "H = harmonic mean of the mean Base and New"
        )
        stem = "results_base_to_new"
    elif args.table == "domains":
        table = domain_table(runs, args.metric, args.by, ddof=args.ddof)
        markdown = format_dataset_markdown(table)
        intro = f"{n_done} finished run(s); {args.metric} on each held-out target domain, mean ± std over seeds (n = seeds)"
        stem = "results_domains"
    elif args.table == "test_time":
        table = tta_table.tta_table(runs, args.metric, args.by, ddof=args.ddof)
        if args.published:
            table = tta_table.with_published(table)
        markdown = tta_table.format_tta_markdown(table)
        if args.published:
            markdown += "\n\nPaper rows: ViT-B/16 averages as quoted in issue 38 (not re-checked here)."
        intro = f"{n_done} finished run(s); {args.metric} of the test-time passes, mean ± std over seeds (n = seeds)"
        stem = "results_test_time"
    elif args.table == "personal":
        done = runs[runs["complete"]]
        if not any(m in done.columns and done[m].notna().any() for m in PERSONAL_METRICS):
            print(
                f"error: the {n_done} finished run(s) under {root} have no personal metrics "
                "(local_accuracy, ...): --table personal is for federated FedOTP and FedPGP runs",
                file=sys.stderr,
            )
            return 2
        by = args.by if args.by is not None else varying_keys(runs)
        table = summarize(runs, by, metrics=PERSONAL_METRICS, ddof=args.ddof)
        markdown = format_markdown(table)
        intro = f"{n_done} finished run(s), personalised metrics (final round and last-5 mean), mean ± std over seeds"
        stem = "results_personal"
    else:
        by = args.by if args.by is not None else varying_keys(runs)
        table = summarize(runs, by, ddof=args.ddof)
        markdown = format_markdown(table)
        intro = f"{n_done} finished run(s), grouped by {', '.join(by) or 'dataset and model'}"
        stem = "results"
    print(f"{intro}:\n")
    print(markdown)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / f"{stem}.csv", index=False)
    text = f"# Results: {root}\n\n{intro}.\n\n{markdown}\n"
    if incomplete:
        text += "\n## Incomplete runs (no metrics.json)\n\n" + "".join(f"- {r}\n" for r in incomplete)
    (out / f"{stem}.md").write_text(text)
    print(f"\nwrote {out / f'{stem}.csv'} and {out / f'{stem}.md'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
