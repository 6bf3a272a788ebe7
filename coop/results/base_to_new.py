"""The base-to-new table as CoCoOp's Table 1 and the papers after it print it.

    from coop.results.base_to_new import base_to_new_table, format_base_to_new_markdown, with_published
    table = base_to_new_table(load_runs("runs/b2n"))
    table, notes = with_published(table, runs)        # + the paper's row and a Δ row under ours

One row per method and setting; per dataset three columns: Base (the test accuracy of the base
classes the run trained on, `metrics.json`), New (its new classes, `eval_<dataset>_new.json`) and
H, their harmonic mean; then the Average block. Base and New are mean ± std over seeds, with n.
H is the harmonic mean of the seed-averaged Base and New, and the Average's H the harmonic mean
of the averaged Base and New (the papers' convention, not the mean of the per-dataset H); being
derived from means, an H has no std. The Average is given only where every dataset of the table
has both numbers.

Columns: the row keys (`method` first), then per dataset `<ds>_base_mean`, `<ds>_base_std`,
`<ds>_new_mean`, `<ds>_new_std`, `<ds>_hm`, `<ds>_n`, then `average_base`, `average_new`,
`average_hm`.
"""

from __future__ import annotations

import logging
import math

import pandas as pd

from coop.config.checks import ConfigError
from coop.results.markdown import _cell, row_label
from coop.results.published import DATASETS_11, lookup
from coop.results.reproduce import no_counterpart, with_paper_rows
from coop.results.tables import (
    DATASET_ORDER,
    _check_keys,
    _group_value,
    _sort_key,
    harmonic_mean,
    varying_keys,
)

log = logging.getLogger(__name__)

PARTS = ("base", "new")  # the averaged columns; `hm` is derived from them
NOT_ROW_KEYS = ("method", "data.name", "data.subsample_classes")


def _hm(base: float, new: float) -> float:
    return math.nan if pd.isna(base) or pd.isna(new) else harmonic_mean(base, new)


def _average(row: dict, datasets: list[str]) -> None:
    """The Average block: the mean of the Base and New cells, H from those means."""
    for part in PARTS:
        means = [row[f"{ds}_{part}_mean"] for ds in datasets]
        row[f"average_{part}"] = math.nan if any(pd.isna(m) for m in means) else sum(means) / len(means)
    row["average_hm"] = _hm(row["average_base"], row["average_new"])


def base_to_new_table(df: pd.DataFrame, by: list[str] | None = None, ddof: int = 1) -> pd.DataFrame:
    """Base / New / H per dataset and the Average block, one row per method and setting.

    Args:
        df: a `coop.results.tables.load_runs` frame; only finished base-class runs
            (`data.subsample_classes=base`) with their new-class evaluation count.
        by: row keys besides `method` (default: the config keys that vary, except data.name).
        ddof: 1 for the sample standard deviation (NaN with one seed), 0 for the population one.
    """
    done = df[df["complete"].astype(bool)] if "complete" in df else df
    if "data.subsample_classes" in done:
        done = done[done["data.subsample_classes"] == "base"]
    else:
        done = done.iloc[:0]
    if "new_accuracy" in done:
        missing = done["new_accuracy"].isna()
        for run in done.loc[missing, "run"]:
            log.warning("%s has no eval_<dataset>_new.json: left out of the base-to-new table", run)
        done = done[~missing]
    if not len(done) or "new_accuracy" not in done:
        raise ConfigError(
            "no finished base-to-new runs (data.subsample_classes=base, evaluated on the new classes)"
        )
    keys = ["method", *[k for k in (by if by is not None else varying_keys(done)) if k not in NOT_ROW_KEYS]]
    _check_keys(keys, done)
    done = done.copy()
    for key in keys:
        done[key] = done[key].map(_group_value)
    names = set(done["data.name"])
    datasets = [d for d in DATASET_ORDER if d in names] + sorted(names - set(DATASET_ORDER))
    rows = []
    for values, group in done.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, values if isinstance(values, tuple) else (values,), strict=True))
        for ds in datasets:
            cell = group[group["data.name"] == ds]
            for part, column in zip(PARTS, ("accuracy", "new_accuracy"), strict=True):
                v = pd.to_numeric(cell[column], errors="coerce")
                row[f"{ds}_{part}_mean"] = v.mean() if len(v) else math.nan
                row[f"{ds}_{part}_std"] = v.std(ddof=ddof) if len(v) > ddof else math.nan
            row[f"{ds}_hm"] = _hm(row[f"{ds}_base_mean"], row[f"{ds}_new_mean"])
            row[f"{ds}_n"] = cell["data.seed"].nunique() if "data.seed" in cell else len(cell)
        _average(row, datasets)
        rows.append(row)
    rows.sort(key=lambda r: tuple(_sort_key(r[k]) for k in keys))
    return pd.DataFrame(rows)


def table_datasets(table: pd.DataFrame) -> list[str]:
    return [c[: -len("_hm")] for c in table.columns if c.endswith("_hm") and c != "average_hm"]


def row_keys(table: pd.DataFrame) -> list[str]:
    datasets = table_datasets(table)
    return [c for c in table.columns if not c.startswith(tuple(f"{d}_" for d in datasets + ["average"]))]


def with_published(table: pd.DataFrame, runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """`table` with the paper's row and a Δ row (ours minus the paper's) under each of our rows
    that has published base-to-new figures (`coop.results.published`, for the runs' backbone and shots; OpenAI
    weights).

    The paper's cells are given where ours has a number; its Average is its own where our columns
    are exactly its 11 datasets, else the mean of its cells (H from those means).

    Returns:
        (the table with the added rows, one note per row of `table`: the paper row's sources and
        their checks, or why it has no paper row).
    """
    datasets = table_datasets(table)

    def paper_cells(ours: pd.Series, found: tuple[str, int, str]):
        protocol, shots, model = found  # the runs' own backbone
        if protocol != "base_to_new":
            return "its runs are not base-to-new"
        method, cells, figures = ours["method"], {}, []
        for ds in datasets:
            have = pd.notna(ours[f"{ds}_base_mean"])
            base, new, hm = (
                lookup(method, "base_to_new", ds, m, shots, model) if have else None
                for m in ("accuracy", "new_accuracy", "hm")
            )
            figures += [f for f in (base, new, hm) if f is not None]
            cells |= {
                f"{ds}_base_mean": base.value if base else math.nan,
                f"{ds}_new_mean": new.value if new else math.nan,
                f"{ds}_hm": hm.value if hm else math.nan,
                **{f"{ds}_{s}": math.nan for s in ("base_std", "new_std", "n")},
            }
        _average(cells, datasets)
        if sorted(datasets) == sorted(DATASETS_11):
            for part, metric in (("base", "accuracy"), ("new", "new_accuracy"), ("hm", "hm")):
                fig = lookup(method, "base_to_new", "average", metric, shots, model)
                if fig is not None and pd.notna(ours[f"average_{part}"]):
                    cells[f"average_{part}"] = fig.value
                    figures.append(fig)
        if not figures:
            have = [ds for ds in datasets if pd.notna(ours[f"{ds}_base_mean"])]
            return no_counterpart(method, "base_to_new", shots, model, have, "accuracy")
        return cells, figures

    return with_paper_rows(table, runs, row_keys(table), paper_cells)


def format_base_to_new_markdown(table: pd.DataFrame, digits: int = 2) -> str:
    """Markdown: `Base`/`New` as `mean ± std (n=seeds)`, `H` plain, `–` where missing."""
    datasets, keys = table_datasets(table), row_keys(table)
    header = ["method"] + [f"{ds} {p}" for ds in [*datasets, "**Average**"] for p in ("Base", "New", "H")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    nan = math.nan
    for _, row in table.iterrows():
        cells = [row_label(row, keys)]
        for ds in datasets:
            n = row[f"{ds}_n"]
            cells += [_cell(row[f"{ds}_{p}_mean"], row[f"{ds}_{p}_std"], digits, n) for p in PARTS]
            cells.append(_cell(row[f"{ds}_hm"], nan, digits))
        cells += [_cell(row[f"average_{p}"], nan, digits) for p in ("base", "new", "hm")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
