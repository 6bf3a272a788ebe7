"""Figures from run folders: accuracy vs shots, vs deep-prompt depth, end vs middle, per round.

    from coop.results.tables import load_runs
    from coop.results.plots import write_figures
    write_figures(load_runs("runs/position"), "figures/", root="runs/position")

Entry point: `tools/plot.py`. Every figure is drawn from `coop.results.tables` tables (mean and std over
seeds per setting); nothing is written for a figure the runs have no data for. The per-round
figure of federated runs reads each finished run's `history.csv` (hence `root`); its data is
`round_table(load_histories(runs, root))`. Each `*_figure` function returns the matplotlib
Figure (None without data); `write_figures` saves and closes them.

Every figure follows the same rules: a setting has one colour in every panel; one legend, outside
the axes; settings that every line shares are named once, in the title, not in each label; the
title is wrapped to the figure's width; a percentage (accuracy, macro-F1, H) is drawn on an axis
that ends at 100, so a mean + std above 100 is cut at the top rather than stretching the axis.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from coop.results.run_files import read_history
from coop.results.tables import METRICS, PERSONAL_METRICS, config_keys, setting_label, summarize, varying_keys

PANEL_KEYS = ("data.name", "model.name")
ROUND_PANEL_KEYS = (*PANEL_KEYS, "data.target_domain")  # leave-one-domain-out: a panel per target
PERCENT = (*METRICS, *PERSONAL_METRICS)  # metrics in %: their axis ends at 100
AXIS_LABELS = {
    "data.shots": "shots per class (data.shots, log scale)",
    "prompt.depth": "layers with prompts (prompt.depth)",
    "round": "communication round",
}
DPI = 120


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(keys: list[str], values) -> str:
    return setting_label(keys, values) or "all"


def _groups(table: pd.DataFrame, keys: list[str]):
    if not keys:
        return [((), table)]
    return [(v if isinstance(v, tuple) else (v,), g) for v, g in table.groupby(keys, sort=False)]


def _split_fixed(table: pd.DataFrame, keys: list[str]) -> tuple[list[str], str]:
    """The keys whose values differ within `table`, and a label of the others ("" if none)."""
    varying = [k for k in keys if table[k].map(str).nunique() > 1]
    fixed = [k for k in keys if k not in varying]
    return varying, setting_label(fixed, tuple(table[k].iloc[0] for k in fixed))


def _ylabel(metric: str) -> str:
    return f"{metric} (%)" if metric in PERCENT else metric


def _cap(axes, metric: str) -> None:
    """A percentage's axis ends at 100: error bars past it are cut, the axis is not stretched."""
    if metric in PERCENT:
        for ax in axes:
            low, high = ax.get_ylim()
            if high > 100:
                ax.set_ylim(low, 100)


def _title(fig, text: str, fontsize: int = 10) -> None:
    """The figure's title, wrapped so that no line is wider than the figure."""
    fig.suptitle(textwrap.fill(text, int(fig.get_figwidth() * 72 / (0.6 * fontsize))), fontsize=fontsize)


def _legend(fig, handles: dict, title: str | None = None) -> None:
    """One legend for every panel, below them and outside every axes (constrained layout)."""
    if not handles:
        return
    entry = 0.06 * max(len(label) for label in handles) + 0.7  # inches at fontsize 8
    ncols = max(1, min(len(handles), int(fig.get_figwidth() / entry)))
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=ncols,
               fontsize=8, title=title, title_fontsize=8, frameon=False)  # fmt: skip


def _dodge(xs: np.ndarray, i: int, n: int, log: bool) -> np.ndarray:
    """Shift line i of n sideways by about 1% of the x range (at most 6% of the smallest x gap),
    so that error bars at one x do not hide one another."""
    t = np.log2(xs) if log else xs
    ticks = np.unique(t)
    step = min(0.012 * np.ptp(ticks), 0.06 * np.diff(ticks).min()) if len(ticks) > 1 else 0.0
    t = t + (i - (n - 1) / 2) * step
    return np.exp2(t) if log else t


def lines_figure(df: pd.DataFrame, x: str, metric: str = "accuracy"):
    """Metric vs a config key, one line per other setting, error bars = std over seeds.

    One panel per dataset (and model, when several). None when `x` takes fewer than two values
    among the finished runs.

    Args:
        df: a `load_runs` frame.
        x: the config key on the x axis, e.g. "data.shots" or "prompt.depth".
        metric: metric column.
    Returns:
        The Figure, or None.
    """
    done = df[df["complete"]] if len(df) else df
    if x not in done or done[x].nunique() < 2 or metric not in done:
        return None
    varying = varying_keys(done)
    panels = [k for k in PANEL_KEYS if k in varying or (k == "data.name" and k in done)]
    lines = [k for k in varying if k != x and k not in panels]
    table = summarize(done, by=[x, *panels, *lines], metrics=[metric])
    table = table[pd.to_numeric(table[x], errors="coerce").notna()]
    # A setting measured at a single x value has no trend to show (e.g. depth runs in a shots plot).
    table = table.groupby([*panels, *lines], dropna=False, sort=False).filter(lambda g: len(g) > 1)
    if not len(table):
        return None
    lines, fixed = _split_fixed(table, lines)
    panel_groups = _groups(table, panels)
    line_labels = [_label(lines, v) for v, _ in _groups(table, lines)]
    colours = {label: f"C{i % 10}" for i, label in enumerate(line_labels)}
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panel_groups), figsize=(4.2 * len(panel_groups) + 0.6, 3.8),
                             squeeze=False, sharey=True, layout="constrained")  # fmt: skip
    handles = {}
    for ax, (pvalues, ptable) in zip(axes[0], panel_groups, strict=True):
        for lvalues, ltable in _groups(ptable, lines):
            label = _label(lines, lvalues)
            ltable = ltable.sort_values(x, key=lambda s: pd.to_numeric(s))
            xs = _dodge(pd.to_numeric(ltable[x]).to_numpy(float), line_labels.index(label),
                        len(line_labels), log=x == "data.shots")  # fmt: skip
            drawn = ax.errorbar(xs, ltable[f"{metric}_mean"], yerr=ltable[f"{metric}_std"].fillna(0),
                                marker="o", ms=4, capsize=3, color=colours[label], label=label)  # fmt: skip
            drawn.lines[0].set_clip_on(False)  # a point at 100 is drawn whole on the capped axis
            handles.setdefault(label, drawn)
        if x == "data.shots":
            ax.set_xscale("log", base=2)
        xs = sorted(pd.to_numeric(ptable[x]).unique())
        ax.set_xticks(xs, [f"{v:g}" for v in xs])
        ax.minorticks_off()
        ax.set_title(_label(panels, pvalues), fontsize=9)
        ax.set_xlabel(AXIS_LABELS.get(x, x))
        ax.grid(alpha=0.3)
    _cap(axes.flat, metric)
    axes[0, 0].set_ylabel(_ylabel(metric))
    if lines:
        _legend(fig, handles)
    _title(fig, f"{metric} vs {x}, mean ± std over seeds" + (f" ({fixed})" if fixed else ""))
    return fig


def positions_figure(df: pd.DataFrame, metric: str = "accuracy"):
    """Bar chart of each class-token position per dataset (and other setting) at the most shots.

    Within each group, only the largest shot count that every position reached is used, so that
    bars compare like with like. None with fewer than two positions.

    Args:
        df: a `load_runs` frame.
        metric: metric column.
    Returns:
        The Figure, or None.
    """
    key = "prompt.position"
    done = df[df["complete"]] if len(df) else df
    if key not in done or done[key].nunique() < 2 or metric not in done:
        return None
    varying = varying_keys(done)
    groups = [k for k in ("data.name", *varying) if k in done and k not in (key, "data.shots")]
    groups = list(dict.fromkeys(groups))
    table = summarize(done, by=[*groups, "data.shots", key], metrics=[metric])
    positions = sorted(table[key].unique(), key=["end", "middle", "front"].index)
    drawn = []  # (group values + shots, {position: (mean, std)})
    for gvalues, gtable in _groups(table, groups):
        common = set.intersection(*(set(t["data.shots"]) for _, t in gtable.groupby(key)))
        if len(gtable[key].unique()) < 2 or not common:
            continue
        at = gtable[gtable["data.shots"] == max(common)].set_index(key)
        bars = {
            p: (at[f"{metric}_mean"].get(p, np.nan), at[f"{metric}_std"].get(p, np.nan)) for p in positions
        }
        drawn.append(((*gvalues, max(common)), bars))
    if not drawn:
        return None
    keys = [*groups, "data.shots"]
    settings = pd.DataFrame([values for values, _ in drawn], columns=keys)
    shown, fixed = _split_fixed(settings, keys)
    labels = ["\n".join(setting_label([k], row[k]) for k in shown) for _, row in settings.iterrows()]
    longest = max((len(line) for label in labels for line in label.splitlines()), default=0)
    group_width = max(0.45 * len(positions) + 0.3, 0.065 * longest)  # inches: bars or tick text
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, group_width * len(drawn) + 1.2), 4.2), layout="constrained")
    width = 0.8 / len(positions)
    xs = np.arange(len(drawn))
    handles = {}
    for i, p in enumerate(positions):
        means = np.array([bars[p][0] for _, bars in drawn], float)
        stds = np.array([bars[p][1] for _, bars in drawn], float)
        rects = ax.bar(xs + (i - (len(positions) - 1) / 2) * width, means, width,
                       yerr=np.nan_to_num(stds), capsize=3, label=p)  # fmt: skip
        texts = [f"{m:.1f}" if np.isfinite(m) else "" for m in means]
        ax.bar_label(rects, texts, fontsize=7, label_type="center", color="white")
        handles[p] = rects
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel(_ylabel(metric))
    ax.grid(axis="y", alpha=0.3)
    _cap([ax], metric)
    _legend(fig, handles, title="class-token position")
    fixed = f" ({fixed})" if fixed else ""
    _title(fig, f"{metric} by class-token position, mean ± std over seeds{fixed}")
    return fig


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


def rounds_figure(df: pd.DataFrame, metric: str = "accuracy", root=None):
    """Metric per communication round, one line per setting, a band of ± std over seeds.

    One panel per dataset (and model and target domain, when they vary). None without `root`,
    or when no finished run has a history.csv with at least two rounds.

    Args:
        df: a `load_runs` frame.
        metric: a history.csv column.
        root: the folder `df` was loaded from.
    Returns:
        The Figure, or None.
    """
    if root is None or not len(df):
        return None
    histories = load_histories(df, root)
    table = round_table(histories, metric)
    if not len(table) or table["round"].nunique() < 2:
        return None
    from matplotlib.ticker import MaxNLocator

    panels, lines = round_keys(histories)
    lines, fixed = _split_fixed(table, lines)
    panel_groups = _groups(table, panels)
    colours = {_label(lines, v): f"C{i % 10}" for i, (v, _) in enumerate(_groups(table, lines))}
    ncols = min(len(panel_groups), 4)
    nrows = math.ceil(len(panel_groups) / ncols)
    plt = _pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 0.6, 3.4 * nrows + 0.6), squeeze=False,
                             sharey=True, layout="constrained")  # fmt: skip
    handles = {}
    for ax, (pvalues, ptable) in zip(axes.flat, panel_groups, strict=False):
        for lvalues, ltable in _groups(ptable, lines):
            label = _label(lines, lvalues)
            ltable = ltable.sort_values("round")
            x, mean = ltable["round"].to_numpy(float), ltable[f"{metric}_mean"].to_numpy(float)
            std = ltable[f"{metric}_std"].fillna(0).to_numpy(float)
            (drawn,) = ax.plot(x, mean, marker="o" if len(x) <= 30 else None, ms=3, color=colours[label],
                               label=label, clip_on=False)  # fmt: skip
            ax.fill_between(x, mean - std, mean + std, color=colours[label], alpha=0.2, linewidth=0)
            handles.setdefault(label, drawn)
        ax.set_title(_label(panels, pvalues), fontsize=9)
        ax.set_xlabel(AXIS_LABELS["round"])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panel_groups) :]:
        ax.set_visible(False)
    _cap(axes.flat, metric)
    for row in axes:
        row[0].set_ylabel(_ylabel(metric))
    if lines:
        _legend(fig, handles)
    _title(fig, f"{metric} per round, mean ± std over seeds" + (f" ({fixed})" if fixed else ""))
    return fig


FIGURES = {
    "acc_vs_shots.png": lambda df, m, root: lines_figure(df, "data.shots", m),
    "acc_vs_depth.png": lambda df, m, root: lines_figure(df, "prompt.depth", m),
    "end_vs_middle.png": lambda df, m, root: positions_figure(df, m),
    "acc_vs_round.png": lambda df, m, root: rounds_figure(df, m, root),
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
    plt = _pyplot()
    written = []
    for name, make in FIGURES.items():
        fig = make(df, metric, root)
        if fig is not None:
            fig.savefig(out_dir / name, dpi=DPI)
            plt.close(fig)
            written.append(out_dir / name)
    return written
