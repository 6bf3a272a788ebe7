"""The result tables as Markdown: `mean ± std` cells, setting and row labels, and the two layouts.

    from coop.results.markdown import format_dataset_markdown, format_markdown
    print(format_markdown(summarize(runs, by)))           # one row per setting, a column per metric
    print(format_dataset_markdown(dataset_table(runs)))   # one column per dataset (or target domain)

The tables come from `coop.results.tables`; `coop.results.base_to_new` and `coop.results.reproduce`
label their rows and format their cells with the same helpers.
"""

from __future__ import annotations

import pandas as pd


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
