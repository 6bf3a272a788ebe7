"""Figures from run folders: accuracy vs shots, vs deep-prompt depth, end vs middle.

    from coop.results import load_runs
    from coop.plots import write_figures
    write_figures(load_runs("runs/position"), "figures/")

Entry point: `tools/plot.py`. Every figure is drawn from `coop.results` tables (mean and std over
seeds per setting); nothing is written for a figure the runs have no data for.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from coop.results import setting_label, summarize, varying_keys

PANEL_KEYS = ("data.name", "model.name")


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
