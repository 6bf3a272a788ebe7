"""Figures from run folders: accuracy vs shots, vs deep-prompt depth, end vs middle, per round.

    from coop.results import load_runs
    from coop.plots import write_figures
    write_figures(load_runs("runs/position"), "figures/", root="runs/position")

Entry point: `tools/plot.py`. Every figure is drawn from `coop.results` tables (mean and std over
seeds per setting); nothing is written for a figure the runs have no data for. The per-round
figure of federated runs reads each finished run's `history.csv` (hence `root`); its data is
`round_table(load_histories(runs, root))`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from coop.results import config_keys, setting_label, summarize, varying_keys
from coop.run_files import read_history

PANEL_KEYS = ("data.name", "model.name")
ROUND_PANEL_KEYS = (*PANEL_KEYS, "data.target_domain")  # leave-one-domain-out: a panel per target


def _label(keys: list[str], values) -> str:
    return setting_label(keys, values) or "all"


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


def load_histories(runs: pd.DataFrame, root) -> pd.DataFrame:
    """Long format: one row per (finished run, round) of the runs whose history.csv has `round`.

    Args:
        runs: a `load_runs` frame of `root`.
        root: the folder `runs` was loaded from (its `run` column is relative to it).
    Returns:
        The run's config keys, `run` and `complete`, then the history's columns (`round`,
        `accuracy`, `macro_f1`, `train_loss`, ...); empty when no run has a per-round history.
    """
    done = runs[runs["complete"].astype(bool)] if len(runs) else runs
    keys = config_keys(done)
    frames = []
    for _, run in done.iterrows():
        history = read_history(Path(root) / run["run"])
        if history is None or "round" not in history:
            continue  # centralised runs log epochs, not rounds
        frame = pd.DataFrame([{**run[keys].to_dict(), "run": run["run"], "complete": True}] * len(history))
        for column in history:
            frame[column] = history[column].to_numpy()
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run", "complete"])


def round_keys(histories: pd.DataFrame) -> tuple[list[str], list[str]]:
    """The per-round figure's panel keys (dataset, and model and target domain when they vary) and
    line keys (every other varying config key but the seed)."""
    varying = varying_keys(histories)
    panels = [k for k in ROUND_PANEL_KEYS if k in varying or (k == "data.name" and k in histories)]
    return panels, [k for k in varying if k not in panels]


def round_table(histories: pd.DataFrame, metric: str = "accuracy", ddof: int = 1) -> pd.DataFrame:
    """Mean and std over seeds of `metric` per (panel, line setting, round): the per-round figure's data.

    Args:
        histories: a `load_histories` frame.
        metric: a history.csv column (`accuracy`, `macro_f1`, `train_loss`, ...).
        ddof: 1 for the sample standard deviation (NaN with one seed), 0 for the population one.
    Returns:
        The `round_keys` columns, `round`, `n_seeds`, `seeds`, `<metric>_mean`, `<metric>_std`;
        empty when there is no history with that metric.
    """
    if not len(histories) or metric not in histories:
        return pd.DataFrame()
    panels, lines = round_keys(histories)
    return summarize(histories, by=[*panels, *lines, "round"], metrics=[metric], ddof=ddof)


def plot_rounds(df: pd.DataFrame, path, metric: str = "accuracy", root=None) -> bool:
    """Metric per communication round, one line per setting, a band of ± std over seeds.

    One panel per dataset (and model and target domain, when they vary). Nothing is written
    without `root`, or when no finished run has a history.csv with at least two rounds.

    Args:
        df: a `load_runs` frame.
        path: PNG file to write.
        metric: a history.csv column.
        root: the folder `df` was loaded from.
    Returns:
        True when the figure was written.
    """
    if root is None or not len(df):
        return False
    histories = load_histories(df, root)
    table = round_table(histories, metric)
    if not len(table) or table["round"].nunique() < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels, lines = round_keys(histories)
    panel_groups = _groups(table, panels)
    ncols = min(len(panel_groups), 4)
    nrows = math.ceil(len(panel_groups) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False, sharey=True)
    for ax, (pvalues, ptable) in zip(axes.flat, panel_groups, strict=False):
        for lvalues, ltable in _groups(ptable, lines):
            ltable = ltable.sort_values("round")
            x, mean = ltable["round"].to_numpy(float), ltable[f"{metric}_mean"].to_numpy(float)
            std = ltable[f"{metric}_std"].fillna(0).to_numpy(float)
            (drawn,) = ax.plot(
                x, mean, marker="o" if len(x) <= 30 else None, ms=3, label=_label(lines, lvalues)
            )
            ax.fill_between(x, mean - std, mean + std, color=drawn.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(_label(panels, pvalues), fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    for ax in axes.flat[len(panel_groups) :]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel(f"{metric} (%)" if metric in ("accuracy", "macro_f1") else metric)
    fig.suptitle(f"{metric} per round (mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


FIGURES = {
    "acc_vs_shots.png": lambda df, path, m, root: plot_lines(df, "data.shots", path, m),
    "acc_vs_depth.png": lambda df, path, m, root: plot_lines(df, "prompt.depth", path, m),
    "end_vs_middle.png": lambda df, path, m, root: plot_positions(df, path, m),
    "acc_vs_round.png": plot_rounds,
}


def write_figures(df: pd.DataFrame, out_dir, metric: str = "accuracy", root=None) -> list[Path]:
    """Every figure of `FIGURES` for which the runs hold data; returns the paths written.

    Args:
        df: a `load_runs` frame.
        out_dir: folder for the PNG files.
        metric: metric column to plot.
        root: the folder `df` was loaded from; without it the per-round figure is skipped.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [out_dir / name for name, plot in FIGURES.items() if plot(df, out_dir / name, metric, root)]
