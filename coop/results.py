"""Tables and figures from run folders: every `metrics.json` (with its `config.yaml`) under a root.

    from coop.results import load_runs, summarize, varying_keys
    runs = load_runs("runs/position")                 # one row per run folder
    table = summarize(runs, by=varying_keys(runs))    # mean / std over seeds per setting

Entry points: `tools/collect.py` (tables) and `tools/plot.py` (figures). A run folder is any
folder holding `metrics.json`, `config.yaml`, `checkpoint.pt` or `sweep.log`; one without `metrics.json`
is incomplete and is kept (flag `complete`) so that tools can list it. Numbers come from the
metrics files only, never from logs.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from coop.config import flatten

log = logging.getLogger(__name__)

RUN_FILES = ("metrics.json", "config.yaml", "checkpoint.pt", "sweep.log")  # sweep.log: failed at start
METRICS = ("accuracy", "macro_f1", "new_accuracy", "hm")  # the last two: base-to-new runs
IGNORED_KEYS = ("data.seed", "output_dir")  # never grouping keys by default
KEY_ORDER = ("data.name", "model.name", "model.pretrained", "data.shots")  # leading table columns


def _read_config(folder: Path) -> dict:
    """The run's config as a flat {dotted key: value} dict; from config.yaml, else the checkpoint."""
    path = folder / "config.yaml"
    if path.is_file():
        try:
            return flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
        except Exception as e:  # yaml errors are multi-line
            log.warning("cannot read %s: %s", path, str(e).splitlines()[0])
            return {}
    ckpt = folder / "checkpoint.pt"
    if ckpt.is_file():
        import torch

        try:
            return flatten(torch.load(ckpt, map_location="cpu", weights_only=True).get("config") or {})
        except Exception as e:
            log.warning("cannot read the config of %s: %s", ckpt, str(e).splitlines()[0])
    return {}


def load_runs(root: str | os.PathLike) -> pd.DataFrame:
    """One row per run folder under `root`: config keys (dotted), metrics, `run`, `complete`.

    Args:
        root: folder searched recursively for run folders.
    Returns:
        DataFrame with columns `run` (path relative to root), `complete` (metrics.json present),
        every config key (e.g. `prompt.position`) and every metrics.json key (e.g. `accuracy`).
        Empty when no run folder is found.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results root not found: {root}")
    folders = sorted({p.parent for name in RUN_FILES for p in root.rglob(name) if ".submitit" not in p.parts})
    rows = []
    for folder in folders:
        row = {"run": folder.relative_to(root).as_posix() or ".", "complete": False}
        row.update(_read_config(folder))
        if row.get("prompt.position") == "mid":  # an alias
            row["prompt.position"] = "middle"
        metrics = folder / "metrics.json"
        if metrics.is_file():
            try:
                values = json.loads(metrics.read_text())
            except (OSError, json.JSONDecodeError) as e:
                log.warning("unreadable %s (%s): run counted as incomplete", metrics, e)
            else:
                row.update({k: v for k, v in values.items() if not isinstance(v, dict | list)})
                row["complete"] = True
                row.update(_base_to_new(folder, row))
        rows.append(row)
    df = pd.DataFrame(rows)
    return df if len(df) else pd.DataFrame(columns=["run", "complete"])


def _base_to_new(folder: Path, row: dict) -> dict:
    """For a base-class run evaluated on the new classes: new-class accuracy and the harmonic mean."""
    if row.get("data.subsample_classes") != "base":
        return {}
    path = folder / f"eval_{row.get('data.name')}_new.json"
    try:
        new = float(json.loads(path.read_text())["accuracy"])
    except (OSError, KeyError, ValueError, TypeError):
        return {}
    base = float(row["accuracy"])
    return {"new_accuracy": new, "hm": 2 * base * new / (base + new) if base + new else 0.0}


def config_keys(df: pd.DataFrame) -> list[str]:
    """The config columns of a `load_runs` frame (dotted names, plus `output_dir`/`device`)."""
    return [c for c in df.columns if "." in c or c in ("output_dir", "device")]


def _hashable(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return v


def varying_keys(df: pd.DataFrame, exclude=IGNORED_KEYS) -> list[str]:
    """Config keys whose values differ between the complete runs (the default grouping keys).

    Args:
        df: a `load_runs` frame.
        exclude: keys never returned (by default data.seed and output_dir).
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
        metrics: metric columns to aggregate (those present in `df`).
        ddof: 1 for the sample standard deviation (NaN with one seed), 0 for the population one.
    Returns:
        One row per setting: the `by` columns, `n_seeds` (distinct seeds), `n_runs` (only when
        some setting has more runs than seeds, i.e. `by` pools settings), `seeds`, and
        `<metric>_mean`, `<metric>_std` for each metric (over runs).
    """
    done = df[df["complete"]].copy() if "complete" in df else df.copy()
    by = list(by) or [k for k in ("data.name", "model.name") if k in done]
    missing = [k for k in by if k not in done.columns]
    if missing:
        known = ", ".join(sorted(config_keys(done)))
        raise ValueError(f"unknown grouping key '{missing[0]}' (known: {known})")
    metrics = [m for m in metrics if m in done.columns]
    if not metrics:
        raise ValueError(f"no metric columns ({', '.join(METRICS)}) in the finished runs")
    for key in by:  # None and NaN group together; booleans and numbers stay as they are
        done[key] = done[key].map(lambda v: "null" if _hashable(v) is None else v)
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
            col = pd.to_numeric(group[m], errors="coerce")
            row[f"{m}_mean"] = col.mean()
            row[f"{m}_std"] = col.std(ddof=ddof) if len(col) > ddof else float("nan")
        rows.append(row)
    rows.sort(key=lambda r: tuple(_sort_key(r[k]) for k in by))
    table = pd.DataFrame(rows)
    if (table["n_runs"] == table["n_seeds"]).all():
        table = table.drop(columns="n_runs")  # one run per seed, as in a plain sweep
    return table


def _sort_key(v):
    """Numbers in numeric order, before strings/booleans (mixed columns such as n_ctx 4 / null)."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def format_markdown(table: pd.DataFrame, digits: int = 2) -> str:
    """A Markdown table with `mean ± std` cells for each metric."""
    metrics = [c[: -len("_mean")] for c in table.columns if c.endswith("_mean")]
    keys = [c for c in table.columns if not c.endswith(("_mean", "_std")) and c != "seeds"]
    header = keys + metrics
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    # Metrics in [0, 1] (e.g. a macro-F1 fraction) get two more digits than percentages.
    places = {m: digits + 2 if table[f"{m}_mean"].abs().max() <= 1 else digits for m in metrics}
    for _, row in table.iterrows():
        cells = [str(row[k]) for k in keys]
        for m in metrics:
            mean, std, d = row[f"{m}_mean"], row[f"{m}_std"], places[m]
            if pd.isna(mean):
                cells.append("–")
            elif pd.isna(std):
                cells.append(f"{mean:.{d}f}")
            else:
                cells.append(f"{mean:.{d}f} ± {std:.{d}f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def incomplete_runs(df: pd.DataFrame) -> list[str]:
    """Relative folders of the runs without metrics.json."""
    return df.loc[~df["complete"].astype(bool), "run"].tolist() if len(df) else []


# ---------------------------------------------------------------- figures

PANEL_KEYS = ("data.name", "model.name")


def _label(keys: list[str], values) -> str:
    values = values if isinstance(values, tuple) else (values,)
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values, strict=True)) or "all"


def _groups(table: pd.DataFrame, keys: list[str]):
    if not keys:
        return [((), table)]
    return [(v if isinstance(v, tuple) else (v,), g) for v, g in table.groupby(keys, sort=False)]


def plot_lines(df: pd.DataFrame, x: str, path, metric: str = "accuracy", title: str = "") -> bool:
    """Metric vs a config key, one line per other setting, error bars = std over seeds.

    One panel per dataset (and model, when several). Nothing is written when `x` takes fewer
    than two values among the finished runs.

    Args:
        df: a `load_runs` frame.
        x: the config key on the x axis, e.g. "data.shots" or "prompt.depth".
        path: PNG file to write.
        metric: metric column.
        title: figure title.
    Returns:
        True when the figure was written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = df[df["complete"]] if len(df) else df
    if x not in done or done[x].nunique() < 2 or metric not in done:
        return False
    varying = varying_keys(done)
    panels = [k for k in PANEL_KEYS if k in varying or (k == "data.name" and k in done)]
    lines = [k for k in varying if k != x and k not in panels]
    table = summarize(done, by=[x, *panels, *lines], metrics=[metric])
    table = table[pd.to_numeric(table[x], errors="coerce").notna()]
    # A setting measured at a single x value has no trend to show (e.g. depth runs in a shots plot).
    table = table.groupby([*panels, *lines], dropna=False, sort=False).filter(lambda g: len(g) > 1)
    if not len(table):
        return False
    panel_groups = _groups(table, panels)
    fig, axes = plt.subplots(
        1, len(panel_groups), figsize=(4.6 * len(panel_groups), 3.6), squeeze=False, sharey=True
    )
    for ax, (pvalues, ptable) in zip(axes[0], panel_groups, strict=True):
        for lvalues, ltable in _groups(ptable, lines):
            ltable = ltable.sort_values(x, key=lambda s: pd.to_numeric(s))
            ax.errorbar(
                pd.to_numeric(ltable[x]), ltable[f"{metric}_mean"], yerr=ltable[f"{metric}_std"].fillna(0),
                marker="o", capsize=3, label=_label(lines, lvalues),
            )  # fmt: skip
        if x == "data.shots":
            ax.set_xscale("log", base=2)
        xs = sorted(pd.to_numeric(ptable[x]).unique())
        ax.set_xticks(xs, [f"{v:g}" for v in xs])
        ax.set_title(_label(panels, pvalues), fontsize=9)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    axes[0, 0].set_ylabel(f"{metric} (%)" if metric == "accuracy" else metric)
    fig.suptitle(title or f"{metric} vs {x} (mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_positions(df: pd.DataFrame, path, metric: str = "accuracy") -> bool:
    """Bar chart of each class-token position per dataset (and other setting) at the most shots.

    Within each group, only the largest shot count that every position reached is used, so that
    bars compare like with like. Nothing is written with fewer than two positions.

    Args:
        df: a `load_runs` frame.
        path: PNG file to write.
        metric: metric column.
    Returns:
        True when the figure was written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    key = "prompt.position"
    done = df[df["complete"]] if len(df) else df
    if key not in done or done[key].nunique() < 2 or metric not in done:
        return False
    varying = varying_keys(done)
    groups = [k for k in ("data.name", *varying) if k in done and k not in (key, "data.shots")]
    groups = list(dict.fromkeys(groups))
    table = summarize(done, by=[*groups, "data.shots", key], metrics=[metric])
    positions = sorted(table[key].unique(), key=["end", "middle", "front"].index)
    labels, bars = [], {p: ([], []) for p in positions}
    for gvalues, gtable in _groups(table, groups):
        common = set.intersection(*(set(t["data.shots"]) for _, t in gtable.groupby(key)))
        if len(gtable[key].unique()) < 2 or not common:
            continue
        shots = max(common)
        at = gtable[gtable["data.shots"] == shots].set_index(key)
        labels.append(f"{_label(groups, gvalues)}\n{shots} shots")
        for p in positions:
            bars[p][0].append(at[f"{metric}_mean"].get(p, np.nan))
            bars[p][1].append(at[f"{metric}_std"].get(p, np.nan))
    if not labels:
        return False
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(labels) * len(positions) / 2 + 2), 3.8))
    width = 0.8 / len(positions)
    xs = np.arange(len(labels))
    for i, p in enumerate(positions):
        means, stds = bars[p]
        drawn = ax.bar(xs + (i - (len(positions) - 1) / 2) * width, means, width,
                       yerr=np.nan_to_num(stds), capsize=3, label=p)  # fmt: skip
        ax.bar_label(drawn, fmt="%.1f", fontsize=7, label_type="center", color="white")
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel(f"{metric} (%)" if metric == "accuracy" else metric)
    ax.set_title(f"class-token position: {' vs '.join(positions)} (mean ± std over seeds)", fontsize=10)
    ax.legend(title="position")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


FIGURES = {
    "acc_vs_shots.png": lambda df, path, m: plot_lines(df, "data.shots", path, m),
    "acc_vs_depth.png": lambda df, path, m: plot_lines(df, "prompt.depth", path, m),
    "end_vs_middle.png": plot_positions,
}


def write_figures(df: pd.DataFrame, out_dir, metric: str = "accuracy") -> list[Path]:
    """Every figure of `FIGURES` for which the runs hold data; returns the paths written.

    Args:
        df: a `load_runs` frame.
        out_dir: folder for the PNG files.
        metric: metric column to plot.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [out_dir / name for name, plot in FIGURES.items() if plot(df, out_dir / name, metric)]
