"""Published figures beside ours: "does my run reproduce the paper?" for a per-dataset table.

    table = dataset_table(runs)                        # coop.results.tables
    table, notes = with_published(table, runs)         # + a paper row and a Δ row under ours

Under each row of `coop.results.tables.dataset_table` that has a published counterpart
(`coop.results.published`), this adds the paper's row (method `<method>: paper`) and a Δ row (`<method>:
Δ`, ours minus the paper's), with the same columns: `<dataset>_mean` holds the figure where our
row has a number, `_std` and `_n` are empty, and `average` is given where ours is (every column
has a number): the paper's own mean where the columns are exactly its 11 datasets, else the
mean of its cells.

Which published figure a cell gets is read from the runs behind the row, never guessed from names:
- only runs with OpenAI weights and one backbone have counterparts, the figures of that backbone
  (ViT-B/16 for all but Tip-Adapter's RN50 curves);
- `data.subsample_classes=base`: base-to-new (the cell metric `accuracy` is the base accuracy,
  `new_accuracy` the new one);
- trained on ImageNet with `eval.targets`: cross-dataset for the targets and ImageNet itself,
  domain generalisation for ImageNet-V2/-Sketch/-A/-R;
- otherwise few-shot at the row's `data.shots`.
`notes` names each paper row's sources and whether its figures were checked, and says for each
row without a paper row why it has none (`no_counterpart`).
"""

from __future__ import annotations

import math

import pandas as pd

from coop.config.run_names import model_tag
from coop.results.markdown import row_label
from coop.results.published import DATASETS_11, DG_TARGETS, FIGURES, lookup
from coop.results.tables import _group_value

WEIGHTS = "openai"  # what every published figure ran
PROTOCOL_NAMES = {
    "few_shot": "few-shot",
    "base_to_new": "base-to-new",
    "transfer": "cross-dataset / domain generalisation",
}


def row_keys(table: pd.DataFrame) -> list[str]:
    """The setting columns of a `dataset_table` (method first), i.e. not the cells or `average`."""
    return [c for c in table.columns if not c.endswith(("_mean", "_std", "_n")) and c != "average"]


def table_datasets(table: pd.DataFrame) -> list[str]:
    return [c[: -len("_mean")] for c in table.columns if c.endswith("_mean")]


def runs_of(row: pd.Series, keys: list[str], done: pd.DataFrame) -> pd.DataFrame:
    """The finished runs a table row aggregates (equal on every row key)."""
    mask = pd.Series(True, index=done.index)
    for key in keys:
        if key in done:
            mask &= done[key].map(lambda v, want=row[key]: _group_value(v) == want)
    return done[mask]


def row_protocols(table: pd.DataFrame, runs: pd.DataFrame, keys: list[str]):
    """Each row of `table` with `protocol_of` the finished runs of `runs` that it aggregates."""
    done = runs[runs["complete"].astype(bool)] if "complete" in runs else runs
    for _, row in table.iterrows():
        yield row, protocol_of(runs_of(row, keys, done))


def protocol_of(runs: pd.DataFrame) -> tuple[str, int, str] | str:
    """("base_to_new" | "transfer" | "few_shot", shots, model) of the runs, or, when they have no
    published counterpart, a string that says why."""
    if not len(runs):
        return "no finished runs"
    models = sorted({model_tag(str(m)) for m in runs.get("model.name", [])})
    weights = sorted({str(w) for w in runs.get("model.pretrained", [])})
    shots = sorted({int(s) for s in runs.get("data.shots", [])})
    if weights != [WEIGHTS]:
        return (
            f"its runs use model.pretrained={', '.join(weights)}; "
            f"the published figures ran OpenAI's weights ({WEIGHTS})"
        )
    if len(models) != 1:
        return f"its runs mix backbones ({', '.join(models)})"
    if len(shots) != 1:
        return f"its runs mix shot counts ({', '.join(map(str, shots))})"
    model = models[0]
    if "base" in set(runs.get("data.subsample_classes", [])):
        return "base_to_new", shots[0], model
    targets = runs["eval.targets"] if "eval.targets" in runs else pd.Series([], dtype=object)
    trained = set(runs.get("data.name", []))
    if trained == {"imagenet"} and len(targets) and all(isinstance(t, list) and t for t in targets):
        return "transfer", shots[0], model
    return "few_shot", shots[0], model


def no_counterpart(
    method: str, protocol: str, shots: int, model: str, datasets: list[str], metric: str
) -> str:
    """Why `coop.results.published` has no figure for these runs' cells: the metric, the method, the
    backbone and shots, or the datasets (naming what is published instead)."""
    if metric not in (("accuracy", "new_accuracy") if protocol == "base_to_new" else ("accuracy",)):
        return f"the papers report accuracy, not {metric}"
    protocols = ("cross_dataset", "domain_generalization") if protocol == "transfer" else (protocol,)
    figures = [f for f in FIGURES if f.method == method and f.protocol in protocols]
    name = PROTOCOL_NAMES[protocol]
    if not figures:
        return f"no published {name} figures for method={method}"
    if (shots, model) not in {(f.shots, f.model) for f in figures}:
        models = sorted({f.model for f in figures})
        published = "; ".join(
            f"{', '.join(map(str, sorted({f.shots for f in figures if f.model == m})))} shots on {m}"
            for m in models
        )
        return f"no published {name} figure for {method} at {shots} shots on {model} (published: {published})"
    published = sorted({f.dataset for f in figures if (f.shots, f.model) == (shots, model)})
    if published == ["average"]:
        return f"the paper quotes only its mean over the 11 datasets for {method} ({name}), no per-dataset figure"
    listed = ", ".join(d for d in published if d != "average")
    return f"no published {name} figure for {method} on {', '.join(datasets)} (published: {listed})"


def figure_for(method: str, protocol: str, dataset: str, metric: str, shots: int, model: str = "ViT-B-16"):
    if protocol == "transfer":
        protocol = "domain_generalization" if dataset in DG_TARGETS else "cross_dataset"
    if protocol == "base_to_new":
        if metric not in ("accuracy", "new_accuracy"):
            return None
    elif metric != "accuracy":
        return None
    return lookup(method, protocol, dataset, metric, shots, model)


def paper_average(
    method: str,
    protocol: str,
    datasets: list[str],
    metric: str,
    shots: int,
    cells: dict,
    model: str = "ViT-B-16",
):
    """The paper's row's `average`: its own mean over exactly its 11 datasets, else our rule."""
    if protocol in ("few_shot", "base_to_new") and sorted(datasets) == sorted(DATASETS_11):
        fig = lookup(method, protocol, "average", metric, shots, model)
        if fig is not None:
            return fig.value
    values = [cells.get(ds) for ds in datasets]
    return math.nan if any(v is None for v in values) else sum(values) / len(values)


def with_published(table: pd.DataFrame, runs: pd.DataFrame, metric: str = "accuracy"):
    """`table` with a paper row and a Δ row under each row that has published figures.

    Args:
        table: a `coop.results.tables.dataset_table`.
        runs: the `load_runs` frame it was made from.
        metric: the table's cell metric.

    Returns:
        (the table with the added rows, one note per row of `table`: the paper row's sources and
        their checks, or why it has no paper row).
    """
    datasets = table_datasets(table)

    def paper_cells(ours: pd.Series, found: tuple[str, int, str]):
        protocol, shots, model = found
        # only where we have a number: the paper's row is that number's counterpart
        have = [ds for ds in datasets if pd.notna(ours[f"{ds}_mean"])]
        figs = {ds: figure_for(ours["method"], protocol, ds, metric, shots, model) for ds in have}
        figs = {ds: f for ds, f in figs.items() if f is not None}
        if not figs:
            return no_counterpart(ours["method"], protocol, shots, model, have, metric)
        cells = {}
        for ds in datasets:
            value = figs[ds].value if ds in figs else math.nan
            cells.update({f"{ds}_mean": value, f"{ds}_std": math.nan, f"{ds}_n": math.nan})
        cells["average"] = math.nan
        if pd.notna(ours["average"]):
            by_ds = {ds: f.value for ds, f in figs.items()}
            cells["average"] = paper_average(ours["method"], protocol, datasets, metric, shots, by_ds, model)
        return cells, list(figs.values())

    return with_paper_rows(table, runs, row_keys(table), paper_cells)


def with_paper_rows(table: pd.DataFrame, runs: pd.DataFrame, keys: list[str], paper_cells):
    """The loop of both `with_published` (this module's and `coop.results.base_to_new`'s).

    Under each row of `table` whose runs have a published counterpart (`protocol_of`), the paper's
    row and a Δ row (ours minus the paper's; `_std` and `_n` empty). `paper_cells(ours, (protocol,
    shots, model))` gives the paper row's cells (every column but `keys`) and the figures they come
    from, or a string: why the row has no paper row.

    Returns:
        (the table with the added rows, one note per row of `table`).
    """
    rows, notes = [], []
    for ours, found in row_protocols(table, runs, keys):
        rows.append(ours.to_dict())
        got = found if isinstance(found, str) else paper_cells(ours, found)
        if isinstance(got, str):
            notes.append(f"{row_label(ours, keys)}: no paper row: {got}")
            continue
        cells, figures = got
        paper = {k: ours[k] for k in keys} | {"method": f"{ours['method']}: paper"} | cells
        delta = {k: ours[k] for k in keys} | {"method": f"{ours['method']}: Δ"}
        for col, value in cells.items():
            delta[col] = math.nan if col.endswith(("_std", "_n")) else ours[col] - value
        rows += [paper, delta]
        protocol, shots, _ = found
        sources = sorted({f.source for f in figures})
        checked = sum(f.checked for f in figures)
        notes.append(
            f"{paper['method']} ({PROTOCOL_NAMES[protocol]}, {shots} shots): {'; '.join(sources)}; "
            f"{checked} of {len(figures)} cell(s) checked against the paper"
        )
    return pd.DataFrame(rows, columns=table.columns), notes
