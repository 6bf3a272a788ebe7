"""Result tables from run folders: every `metrics.json` (with its `config.yaml`) under a root.

    from coop.results.tables import dataset_table, domain_table, load_runs, summarize, varying_keys
    runs = load_runs("runs/position")                 # one row per run folder
    table = summarize(runs, by=varying_keys(runs))    # mean / std over seeds per setting
    wide = dataset_table(runs)                        # one column per dataset, as in the papers
    lodo = domain_table(runs)                         # one column per held-out target domain

Entry points: `tools/collect.py` (tables); `coop.results.plots` draws figures from these tables. A run
folder is any folder holding `metrics.json`, `config.yaml`, `checkpoint.pt` or `sweep.log`; one
without `metrics.json` is incomplete and is kept (flag `complete`) so that tools can list it.
Numbers come from the metrics files only (`metrics.json`, and `eval_<dataset>.json` written by
`tools/eval.py`; read by `coop.results.run_files`), never from logs.

Seeds of one setting are pooled over every key of `coop.config.load.RESULT_FREE_KEYS` (device,
workers, data root, ...): those keys cannot change a result, so they never split a row.
Base-to-new: `hm` is the harmonic mean of the seed-averaged base and new accuracies (CoCoOp's
convention); `hm_per_seed` is the mean (and std) of the per-seed harmonic means.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pandas as pd

from coop.config.checks import ConfigError
from coop.config.load import RESULT_FREE_KEYS
from coop.config.schema import DEFAULTS
from coop.data import TEST_ONLY_DATASETS
from coop.results.run_files import eval_targets, read_config, read_metrics

log = logging.getLogger(__name__)

RUN_FILES = ("metrics.json", "config.yaml", "checkpoint.pt", "sweep.log")  # sweep.log: failed at start
# The last three: base-to-new runs. `hm` is derived per setting from the means (see summarize).
METRICS = ("accuracy", "macro_f1", "new_accuracy", "hm", "hm_per_seed")
# Personalised federated runs (FedOTP, FedPGP; coop.federated.personal): final round and the mean
# of the last 5 rounds per metric; `--table personal` averages them over seeds.
PERSONAL_METRICS = tuple(
    f"{m}{suffix}"
    for m in ("local_accuracy", "base_accuracy", "novel_accuracy", "hm", "hm_base_novel", "global_accuracy")
    for suffix in ("", "_last5_mean")
)
IGNORED_KEYS = frozenset({"data.seed"} | RESULT_FREE_KEYS)  # never grouping keys by default
KEY_ORDER = ("method", "data.name", "model.name", "model.pretrained", "data.shots")  # leading columns
DEFAULT_METHOD = "coop"  # runs whose config predates the `method` key
# Config keys outside any section (device, output_dir, method).
TOP_LEVEL_KEYS = frozenset(k for k, v in DEFAULTS.items() if not isinstance(v, dict))
# Column order of the per-dataset table: CoOp's 11 datasets as its paper lists them, then the
# ImageNet variants of the domain-generalisation table; other datasets follow alphabetically.
DATASET_ORDER = (
    "imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
    "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101", *TEST_ONLY_DATASETS,
)  # fmt: skip


def load_runs(root: str | os.PathLike) -> pd.DataFrame:
    """One row per run folder under `root`: config keys (dotted), metrics, `run`, `complete`.

    Args:
        root: folder searched recursively for run folders.
    Returns:
        DataFrame with columns `run` (path relative to root), `complete` (metrics.json present),
        every config key (e.g. `prompt.position`; `method` is "coop" when the config has none,
        "<host>+dept" with `dept.enabled`),
        every metrics.json key (e.g. `accuracy`) and, for finished runs, `eval_targets`: the
        run's `eval_<dataset>.json` files as {dataset: {metric: value}}. Empty when no run
        folder is found.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results root not found: {root}")
    folders = sorted({p.parent for name in RUN_FILES for p in root.rglob(name) if ".submitit" not in p.parts})
    rows = []
    for folder in folders:
        row = {"run": folder.relative_to(root).as_posix() or ".", "complete": False}
        row.update(read_config(folder))
        row.setdefault("method", DEFAULT_METHOD)
        if row.get("prompt.position") == "mid":  # an alias
            row["prompt.position"] = "middle"
        metrics = folder / "metrics.json"
        if metrics.is_file():
            values = read_metrics(metrics)
            if values is None:
                log.warning("unreadable %s: run counted as incomplete", metrics)
            else:
                row.update(values)
                row["complete"] = True
                row.update(_base_to_new(folder, row))
                row["eval_targets"] = eval_targets(folder)
        if row.get("dept.enabled") is True:  # DePT on a host: its own row, e.g. "maple+dept"
            row["method"] = f"{row['method']}+dept"
        rows.append(row)
    df = pd.DataFrame(rows)
    return df if len(df) else pd.DataFrame(columns=["run", "complete"])


def _base_to_new(folder: Path, row: dict) -> dict:
    """For a base-class run evaluated on the new classes: new-class accuracy and this seed's HM."""
    if row.get("data.subsample_classes") != "base":
        return {}
    path = folder / f"eval_{row.get('data.name')}_new.json"
    try:
        new = float(json.loads(path.read_text())["accuracy"])
    except (OSError, KeyError, ValueError, TypeError):
        return {}
    return {"new_accuracy": new, "hm_per_seed": harmonic_mean(float(row["accuracy"]), new)}


def harmonic_mean(base: float, new: float) -> float:
    """The base-to-new protocol's headline number: 2 b n / (b + n) (0 when both are 0)."""
    return 2 * base * new / (base + new) if base + new else 0.0


def config_keys(df: pd.DataFrame) -> list[str]:
    """The config columns of a `load_runs` frame (dotted names, plus `method`/`output_dir`/`device`)."""
    return [c for c in df.columns if "." in c or c in TOP_LEVEL_KEYS]


def _check_keys(keys: list[str], done: pd.DataFrame) -> None:
    """A ConfigError naming the first grouping key that is not a column of `done`."""
    missing = [k for k in keys if k not in done.columns]
    if missing:
        known = ", ".join(sorted(config_keys(done)))
        raise ConfigError(f"unknown grouping key '{missing[0]}' (known: {known})")


def _hashable(v):
    """None for None/NaN, a tuple for a list value (e.g. eval.targets), else the value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return tuple(v) if isinstance(v, list | tuple) else v


def _group_value(v):
    """A groupable cell: "null" for None/NaN (they group together), lists as tuples."""
    v = _hashable(v)
    return "null" if v is None else v


def varying_keys(df: pd.DataFrame, exclude=IGNORED_KEYS) -> list[str]:
    """Config keys whose values differ between the complete runs (the default grouping keys).

    Args:
        df: a `load_runs` frame.
        exclude: keys never returned (by default data.seed and the keys that cannot change a
            result, `coop.config.load.RESULT_FREE_KEYS`: device, output_dir, data.root, ...).
    """
    done = df[df["complete"]] if "complete" in df else df
    keys = []
    for key in config_keys(df):
        if key in exclude:
            continue
        if len({_hashable(v) for v in done[key]}) > 1:
            keys.append(key)
    first = [k for k in KEY_ORDER if k in keys]
    return first + [k for k in keys if k not in first]


def summarize(df: pd.DataFrame, by: list[str], metrics=METRICS, ddof: int = 1) -> pd.DataFrame:
    """Mean and standard deviation over seeds of each metric, per setting.

    Args:
        df: a `load_runs` frame; incomplete runs are left out.
        by: grouping keys (config columns); an empty list gives one row per dataset and model.
        metrics: metric columns to aggregate (those present in `df`). `hm` is derived, not
            averaged: the harmonic mean of the mean base accuracy and the mean new-class
            accuracy over the runs that have both (CoCoOp's convention; its std is NaN).
            `hm_per_seed` averages each run's own harmonic mean.
        ddof: 1 for the sample standard deviation (NaN with one seed), 0 for the population one.
    Returns:
        One row per setting: the `by` columns, `n_seeds` (distinct seeds), `n_runs` (only when
        some setting has more runs than seeds, i.e. `by` pools settings), `seeds`, and
        `<metric>_mean`, `<metric>_std` for each metric (over runs).
    """
    done = df[df["complete"]].copy() if "complete" in df else df.copy()
    by = list(by) or [k for k in ("data.name", "model.name") if k in done]
    _check_keys(by, done)
    has_hm = {"accuracy", "new_accuracy"} <= set(done.columns) and "hm" not in done.columns
    requested, metrics = metrics, [m for m in metrics if m in done.columns or (m == "hm" and has_hm)]
    if not metrics:
        raise ConfigError(f"no metric columns ({', '.join(requested)}) in the finished runs")
    for key in by:
        done[key] = done[key].map(_group_value)
    pooled = [k for k in varying_keys(done) if k not in by]
    if pooled:
        log.warning("each row pools runs that differ in %s (not grouped by)", ", ".join(pooled))
    rows = []
    for values, group in done.groupby(by, sort=False, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        seeds = group["data.seed"].tolist() if "data.seed" in group else []
        row = dict(zip(by, values, strict=True))
        row["n_seeds"] = len(set(seeds)) if seeds else len(group)
        row["n_runs"] = len(group)
        row["seeds"] = ",".join(str(s) for s in sorted(set(seeds)))
        for m in metrics:
            if m == "hm" and has_hm:
                row["hm_mean"], row["hm_std"] = _hm_of_means(group), float("nan")
                continue
            col = pd.to_numeric(group[m], errors="coerce")
            row[f"{m}_mean"] = col.mean()
            row[f"{m}_std"] = col.std(ddof=ddof) if len(col) > ddof else float("nan")
        rows.append(row)
    rows.sort(key=lambda r: tuple(_sort_key(r[k]) for k in by))
    table = pd.DataFrame(rows)
    if (table["n_runs"] == table["n_seeds"]).all():
        table = table.drop(columns="n_runs")  # one run per seed, as in a plain sweep
    return table


def _hm_of_means(group: pd.DataFrame) -> float:
    """Harmonic mean of the seed-averaged base and new accuracies, over runs that have both."""
    base = pd.to_numeric(group["accuracy"], errors="coerce")
    new = pd.to_numeric(group["new_accuracy"], errors="coerce")
    paired = base.notna() & new.notna()
    if not paired.any():
        return float("nan")
    return harmonic_mean(float(base[paired].mean()), float(new[paired].mean()))


def _sort_key(v):
    """Numbers in numeric order, before strings/booleans (mixed columns such as n_ctx 4 / null)."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def _show(v) -> str:
    """A config value for a table: 0.0 -> "0" (pandas turns int columns with gaps into floats)."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _places(values: pd.Series, digits: int) -> int:
    """Metrics in [0, 1] (e.g. a macro-F1 fraction) get two more digits than percentages."""
    return digits + 2 if values.abs().max() <= 1 else digits


def _cell(mean, std, places: int, n=None) -> str:
    """`mean ± std`, `mean` when there is no std, `–` when missing; `(n=K)` when n is given."""
    if pd.isna(mean):
        return "–"
    text = f"{mean:.{places}f}" if pd.isna(std) else f"{mean:.{places}f} ± {std:.{places}f}"
    return text if n is None or pd.isna(n) else f"{text} (n={int(n)})"


def format_markdown(table: pd.DataFrame, digits: int = 2) -> str:
    """A Markdown table with `mean ± std` cells for each metric."""
    metrics = [c[: -len("_mean")] for c in table.columns if c.endswith("_mean")]
    keys = [c for c in table.columns if not c.endswith(("_mean", "_std")) and c != "seeds"]
    header = keys + metrics
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    places = {m: _places(table[f"{m}_mean"], digits) for m in metrics}
    for _, row in table.iterrows():
        cells = [_show(row[k]) for k in keys]
        cells += [_cell(row[f"{m}_mean"], row[f"{m}_std"], places[m]) for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def incomplete_runs(df: pd.DataFrame) -> list[str]:
    """Relative folders of the runs without metrics.json."""
    return df.loc[~df["complete"].astype(bool), "run"].tolist() if len(df) else []


SHORT_NAMES = {"data.name": "dataset", "model.name": "model", "model.pretrained": "weights"}


def setting_label(keys: list[str], values) -> str:
    """ "shots=4, position=end" for keys ["data.shots", "prompt.position"] and values (4, "end");
    `data.name` and `model.name` show as dataset= and model= (`SHORT_NAMES`)."""
    values = values if isinstance(values, tuple) else (values,)
    names = [SHORT_NAMES.get(k, k.split(".")[-1]) for k in keys]
    return ", ".join(f"{n}={_show(v)}" for n, v in zip(names, values, strict=True))


def row_label(row: pd.Series, keys: list[str]) -> str:
    """ "coop (shots=4, position=end)": a table row (row keys `keys`, `method` first) as the Markdown
    tables name it."""
    settings = setting_label(keys[1:], tuple(row[k] for k in keys[1:]))
    return f"{row['method']} ({settings})" if settings else str(row["method"])


# ---------------------------------------------------------------- one column per dataset


def _per_dataset(done: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Long format: one row per (finished run, dataset it was tested on), the value in `value`.

    A run counts for its own dataset (metrics.json) and for every transfer target
    (eval_<dataset>.json); an eval file for the run's own dataset is not counted twice.
    """
    rows = []
    for _, run in done.iterrows():
        base = {k: v for k, v in run.items() if k != "eval_targets"}
        own = run.get("data.name")
        targets = run.get("eval_targets")
        targets = targets if isinstance(targets, dict) else {}
        values = {own: run.get(metric)} | {ds: m.get(metric) for ds, m in targets.items() if ds != own}
        for ds, value in values.items():
            value = pd.to_numeric(value, errors="coerce")
            if isinstance(ds, str) and pd.notna(value):
                rows.append({**base, "dataset": ds, "value": float(value)})
    return pd.DataFrame(rows)


def dataset_table(
    df: pd.DataFrame, metric: str = "accuracy", by: list[str] | None = None, ddof: int = 1
) -> pd.DataFrame:
    """The papers' layout: one row per method and setting, one column per dataset, then Average.

    Columns are the datasets the runs were trained and tested on (metrics.json) plus their
    transfer targets (`eval_<dataset>.json`, e.g. ImageNet -> ImageNet-Sketch). A cell never
    pools runs trained on different datasets: when some would (e.g. DTD trained on DTD and
    DTD as a target of ImageNet runs), rows are split by `data.name` as well.

    Args:
        df: a `load_runs` frame; incomplete runs are left out.
        metric: the metric of every cell (`accuracy` by default).
        by: row keys besides `method` (default: the config keys that vary, except data.name).
        ddof: 1 for the sample standard deviation (NaN with one seed), 0 for the population one.
    Returns:
        One row per setting: the row keys (`method` first), then `<dataset>_mean`,
        `<dataset>_std` and `<dataset>_n` (seeds) per dataset, then `average`: the mean of the
        row's cell means, NaN unless every dataset has a value (missing cells are never
        averaged over).
    """
    done = df[df["complete"].astype(bool)] if "complete" in df else df
    if "data.name" not in done or not len(done):
        raise ConfigError("no finished runs with a data.name")
    long = _per_dataset(done, metric)
    if not len(long):
        raise ConfigError(f"metric '{metric}' is in none of the finished runs' metrics files")
    keys = [k for k in (by if by is not None else varying_keys(done)) if k not in ("method", "data.name")]
    keys = ["method", *keys] + (["data.name"] if by is not None and "data.name" in by else [])
    _check_keys(keys, done)
    for key in keys:
        long[key] = long[key].map(_group_value)
    if "data.name" not in keys and long.groupby([*keys, "dataset"])["data.name"].nunique().gt(1).any():
        log.info("some datasets are both trained on and transfer targets: rows split by data.name")
        keys.append("data.name")
    pooled = [k for k in varying_keys(done) if k not in keys and k != "data.name"]
    if pooled:
        log.warning("each cell pools runs that differ in %s (not grouped by)", ", ".join(pooled))
    names = set(long["dataset"])
    columns = [d for d in DATASET_ORDER if d in names] + sorted(names - set(DATASET_ORDER))
    return _wide(long, keys, columns, ddof)


def _wide(long: pd.DataFrame, keys: list[str], columns: list[str], ddof: int) -> pd.DataFrame:
    """One row per `keys` setting of a long frame, `<column>_mean/_std/_n` per value of `dataset`.

    `average` is the mean of the row's cell means, NaN unless every column has a value.
    """
    rows = []
    for values, group in long.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, values if isinstance(values, tuple) else (values,), strict=True))
        for ds in columns:
            cell = group[group["dataset"] == ds]
            row[f"{ds}_mean"] = cell["value"].mean() if len(cell) else float("nan")
            row[f"{ds}_std"] = cell["value"].std(ddof=ddof) if len(cell) > ddof else float("nan")
            row[f"{ds}_n"] = cell["data.seed"].nunique() if "data.seed" in cell else len(cell)
        means = [row[f"{ds}_mean"] for ds in columns]
        row["average"] = float("nan") if any(pd.isna(m) for m in means) else sum(means) / len(means)
        rows.append(row)
    rows.sort(key=lambda r: tuple(_sort_key(r[k]) for k in keys))
    return pd.DataFrame(rows)


def domain_table(
    df: pd.DataFrame, metric: str = "accuracy", by: list[str] | None = None, ddof: int = 1
) -> pd.DataFrame:
    """Leave-one-domain-out: one row per method and setting, one column per target domain, Average.

    Only finished runs with `data.target_domain` set count; each gives its `metric` (accuracy on
    the held-out domain) to that domain's column. Same layout as `dataset_table`, so
    `format_dataset_markdown` prints it.

    Args:
        df: a `load_runs` frame.
        metric: the metric of every cell (`accuracy` by default).
        by: row keys besides `method` (default: the config keys that vary, except the target domain).
        ddof: 1 for the sample standard deviation (NaN with one seed), 0 for the population one.
    Returns:
        The row keys (`method` first), `<domain>_mean`, `<domain>_std`, `<domain>_n` (seeds) per
        target domain in sorted order, and `average` over the domains (NaN for incomplete rows).
    """
    key = "data.target_domain"
    done = df[df["complete"].astype(bool)] if "complete" in df else df
    done = done[done[key].map(_hashable).notna()] if key in done else done.iloc[:0]
    if not len(done):
        raise ConfigError("no finished runs with data.target_domain set (leave-one-domain-out)")
    if metric not in done:
        raise ConfigError(f"metric '{metric}' is in none of those runs' metrics.json files")
    long = done.assign(dataset=done[key], value=pd.to_numeric(done[metric], errors="coerce"))
    long = long[long["value"].notna()].copy()
    keys = [k for k in (by if by is not None else varying_keys(done)) if k not in ("method", key)]
    keys = ["method", *keys]
    _check_keys(keys, done)
    for k in keys:
        long[k] = long[k].map(_group_value)
    return _wide(long, keys, sorted(set(long["dataset"])), ddof)


def format_dataset_markdown(table: pd.DataFrame, digits: int = 2) -> str:
    """A Markdown table of `dataset_table` or `domain_table`: `mean ± std (n=seeds)` cells, `–` if missing."""
    datasets = [c[: -len("_mean")] for c in table.columns if c.endswith("_mean")]
    keys = [c for c in table.columns if not c.endswith(("_mean", "_std", "_n")) and c != "average"]
    header = ["method", *datasets, "**Average**"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    places = _places(pd.concat([table[f"{ds}_mean"] for ds in datasets]), digits)
    for _, row in table.iterrows():
        cells = [row_label(row, keys)]
        cells += [_cell(row[f"{ds}_mean"], row[f"{ds}_std"], places, row[f"{ds}_n"]) for ds in datasets]
        cells.append(_cell(row["average"], float("nan"), places))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
