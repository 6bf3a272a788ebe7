"""`collect.py --table base_to_new`: Base / New / H per dataset, the Average block, paper rows."""

from __future__ import annotations

import pandas as pd
import pytest
from test_results import collect, write_run

from coop.results.base_to_new import base_to_new_table, with_published
from coop.results.published import BASE_TO_NEW, DATASETS_11
from coop.results.tables import load_runs


def b2n_run(root, method, dataset, seed, base, new, *extra):
    over = [f"method={method}", f"data.name={dataset}", "data.root=/data", f"data.seed={seed}",
            "data.subsample_classes=base", *extra]  # fmt: skip
    write_run(root / f"{method}/{dataset}/seed{seed}", over, metrics={"accuracy": base},
              evals={f"{dataset}_new": {"accuracy": new}})  # fmt: skip


def test_average_h_is_of_the_averages(tmp_path):
    # dtd: Base 80 New 40, eurosat: Base 40 New 80 (means over 2 seeds). Per-dataset H = 53.33
    # each, so their mean is 53.33; the papers' Average H is HM(60, 60) = 60.
    for seed, d in ((1, -2.0), (2, 2.0)):
        b2n_run(tmp_path, "coop", "dtd", seed, 80.0 + d, 40.0 - d)
        b2n_run(tmp_path, "coop", "eurosat", seed, 40.0 + d, 80.0 - d)
    write_run(
        tmp_path / "coop/dtd/unfinished",
        ["data.name=dtd", "data.subsample_classes=base"],
        metrics={"accuracy": 1.0},
    )  # fmt: skip
    table = base_to_new_table(load_runs(tmp_path))
    row = table.iloc[0]
    assert list(table["method"]) == ["coop"] and row["dtd_n"] == 2
    assert (row["dtd_base_mean"], row["dtd_new_mean"]) == (80.0, 40.0)
    assert row["dtd_base_std"] == pytest.approx(2 * 2**0.5)
    assert row["dtd_hm"] == pytest.approx(2 * 80 * 40 / 120) == pytest.approx(row["eurosat_hm"])
    assert (row["average_base"], row["average_new"]) == (60.0, 60.0)
    assert row["average_hm"] == pytest.approx(60.0)

    assert collect(tmp_path, "--table", "base_to_new") == 0
    csv = pd.read_csv(tmp_path / "results_base_to_new.csv")
    assert csv["average_hm"][0] == pytest.approx(60.0)
    md = (tmp_path / "results_base_to_new.md").read_text()
    assert "| method | dtd Base | dtd New | dtd H | eurosat Base |" in md
    assert "| coop | 80.00 ± 2.83 (n=2) | 40.00 ± 2.83 (n=2) | 53.33 | 40.00 ± 2.83 (n=2) |" in md
    assert md.rstrip().splitlines()[-1].endswith("| 60.00 | 60.00 | 60.00 |")


def test_published_rows_and_deltas(tmp_path):
    # CoCoOp on the 11 datasets, one seed, each Base one point above the paper and New one below.
    rows = BASE_TO_NEW["cocoop"][2]
    for ds, (base, new, _) in zip(DATASETS_11, rows, strict=False):
        b2n_run(tmp_path, "cocoop", ds, 1, base + 1.0, new - 1.0)
    runs = load_runs(tmp_path)
    table, notes = with_published(base_to_new_table(runs), runs)
    assert list(table["method"]) == ["cocoop", "cocoop: paper", "cocoop: Δ"]
    ours, paper, delta = (table.iloc[i] for i in range(3))
    assert paper["dtd_base_mean"] == 77.01 and paper["dtd_new_mean"] == 56.00 and paper["dtd_hm"] == 64.85
    assert delta["dtd_base_mean"] == pytest.approx(1.0) and delta["dtd_new_mean"] == pytest.approx(-1.0)
    # the paper's own Average (its checked means), not one recomputed from its cells
    assert (paper["average_base"], paper["average_new"], paper["average_hm"]) == (80.47, 71.69, 75.83)
    assert delta["average_hm"] == pytest.approx(ours["average_hm"] - 75.83)
    assert len(notes) == 1 and notes[0].startswith("cocoop: paper (base-to-new, 16 shots): CoCoOp")
    assert notes[0].endswith("; 3 of 36 cell(s) checked against the paper")  # 33 cells, 3 averages
    assert collect(tmp_path, "--table", "base_to_new", "--published") == 0
    md = (tmp_path / "results_base_to_new.md").read_text()
    assert "Paper rows:" in md and "| cocoop: Δ |" in md


def test_published_rows_only_for_the_papers_backbone(tmp_path):
    """The paper's ViT-B/16 row is never put under runs of another backbone."""
    for ds in ("dtd", "eurosat"):
        b2n_run(tmp_path, "cocoop", ds, 1, 70.0, 60.0, "model.name=ViT-L-14")
    runs = load_runs(tmp_path)
    table, notes = with_published(base_to_new_table(runs), runs)
    assert list(table["method"]) == ["cocoop"]
    assert notes == [
        "cocoop: no paper row: no published base-to-new figure for cocoop at 16 shots on ViT-L-14 "
        "(published: 16 shots on ViT-B-16)"
    ]
