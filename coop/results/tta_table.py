"""The test-time table (`tools/collect.py --table test_time`): one row per test-time method and host,
one column per dataset, then the two averages the papers report.

    table = tta_table(load_runs("runs/test_time"))    # coop.results.tables.load_runs
    table = with_published(table)                           # + the papers' rows
    print(format_tta_markdown(table))

A test-time pass (`tools/tta.py`, docs/test_time.md) is a run whose metrics.json has `tta_method`.
Its row keys are `tta_method`, the host `method`, `init` and any other config key that varies
(e.g. `tta.views`); each cell is the mean ± std over seeds (view seeds, and for an online method
the stream's order seeds). `ood_average` is the mean over ImageNet-V2, -Sketch, -A and -R,
`cross_average` over the 10 cross-dataset sets, each given only where every one of its datasets has
a value.

The published rows are ViT-B/16 figures as quoted in issue 38 of this repository (TPT, TDA, DPE,
BoostAdapter and ZERO papers, and their CLIP baseline with the template ensemble); they were not
re-checked against the papers here.
"""

from __future__ import annotations

import pandas as pd

from coop.config.checks import ConfigError
from coop.results.markdown import _cell, setting_label
from coop.results.tables import _check_keys, _group_value, _per_dataset, _wide, varying_keys

OOD = ("imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")
CROSS = (
    "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
    "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101",
)  # fmt: skip
AVERAGES = {"ood_average": OOD, "cross_average": CROSS}
# ViT-B/16: (OOD average, 10-dataset average), None where the paper gives none
PUBLISHED = {
    "CLIP, template ensemble": (57.20, 64.59),
    "tpt": (60.81, 65.10),
    "tda": (63.89, 67.53),
    "dpe": (64.43, 69.40),
    "boostadapter": (None, 68.68),
    "zero": (None, 64.21),
}
ROW_KEYS = ("tta_method", "method", "init")


def tta_table(df: pd.DataFrame, metric: str = "accuracy", by: list[str] | None = None, ddof: int = 1):
    """One row per test-time setting, `<dataset>_mean/_std/_n` per dataset in the papers' order
    (ImageNet, the four shifted sets, the 10 cross-dataset sets, then others), `ood_average` and
    `cross_average` (module docstring)."""
    done = df[df["complete"].astype(bool)] if "complete" in df else df
    done = done[done["tta_method"].notna()] if "tta_method" in done else done.iloc[:0]
    if not len(done):
        raise ConfigError("no finished test-time passes (metrics.json with tta_method) under this root")
    long = _per_dataset(done, metric)
    if not len(long):
        raise ConfigError(f"metric '{metric}' is in none of the finished passes' metrics files")
    extra = [k for k in (by if by is not None else varying_keys(done)) if k not in (*ROW_KEYS, "data.name")]
    keys = [*ROW_KEYS, *[k for k in extra if not k.startswith("tta.method")]]
    _check_keys(keys, done)
    for key in keys:
        long[key] = long[key].map(_group_value)
    names = set(long["dataset"])
    order = ("imagenet", *OOD, *CROSS)
    columns = [d for d in order if d in names] + sorted(names - set(order))
    table = _wide(long, keys, columns, ddof).drop(columns="average")
    for name, sets in AVERAGES.items():
        means = [table.get(f"{d}_mean") for d in sets]
        table[name] = (
            sum(means) / len(sets) if all(m is not None for m in means) else float("nan")
        )  # NaN where a dataset is missing in a row (pandas propagates it)
    return table


def with_published(table: pd.DataFrame) -> pd.DataFrame:
    """The table with the papers' rows below ours (`tta_method` "<name>: paper"; only the averages)."""
    rows = [
        {"tta_method": f"{name}: paper", "ood_average": ood, "cross_average": cross}
        for name, (ood, cross) in PUBLISHED.items()
    ]
    return pd.concat([table, pd.DataFrame(rows)], ignore_index=True)


def format_tta_markdown(table: pd.DataFrame, digits: int = 2) -> str:
    """A Markdown table of `tta_table`: `mean ± std (n=seeds)` cells, `–` if missing; each row
    named "<tta method> (host=<method>, init=<init>, ...)"."""
    datasets = [c[: -len("_mean")] for c in table.columns if c.endswith("_mean")]
    keys = [c for c in table.columns if not c.endswith(("_mean", "_std", "_n")) and c not in AVERAGES]
    header = ["test-time method", *datasets, "**OOD average**", "**10-dataset average**"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in table.iterrows():
        shown = [k for k in keys[1:] if pd.notna(row[k]) and row[k] != "null"]  # no init: not shown
        settings = {("host" if k == "method" else k): row[k] for k in shown}
        label = setting_label(list(settings), tuple(settings.values()))
        cells = [f"{row[keys[0]]} ({label})" if label else str(row[keys[0]])]
        cells += [_cell(row[f"{d}_mean"], row[f"{d}_std"], digits, row[f"{d}_n"]) for d in datasets]
        cells += [_cell(row[a], float("nan"), digits) for a in AVERAGES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
