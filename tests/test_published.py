"""Published figures: internally consistent, and beside ours in `collect.py --table datasets --published`."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from test_results import collect, write_run

from coop.results.published import (
    BASE_TO_NEW,
    BASE_TO_NEW_UNCHECKED,
    CROSS_DATASET,
    DATASETS_11,
    DG_TARGETS,
    DOMAIN_GENERALIZATION,
    FIGURES,
    PROTOCOLS,
    lookup,
)
from coop.results.tables import harmonic_mean


def test_per_dataset_figures_agree_with_the_checked_means():
    """The unchecked per-dataset figures reproduce the checked means and their own HM column."""
    for method, (_, _, rows) in BASE_TO_NEW.items():
        *per, mean = rows
        for i, metric in enumerate(("base", "new")):
            assert sum(r[i] for r in per) / len(per) == pytest.approx(mean[i], abs=0.006), (method, metric)
        for dataset, (base, new, hm) in zip(DATASETS_11, per, strict=False):
            assert harmonic_mean(base, new) == pytest.approx(hm, abs=0.011), (method, dataset)
        assert harmonic_mean(mean[0], mean[1]) == pytest.approx(mean[2], abs=0.011), method
    for method, (_, (base, new, hm)) in BASE_TO_NEW_UNCHECKED.items():  # TCP's, DePT's, MMRL's means
        if base is not None:
            assert harmonic_mean(base, new) == pytest.approx(hm, abs=0.011), method
        assert not lookup(method, "base_to_new", "average", "hm").checked
    for method, (_, row) in CROSS_DATASET.items():  # the mean is over the 10 targets
        assert sum(row[1:11]) / 10 == pytest.approx(row[11], abs=0.006), method
        assert row[0] == DOMAIN_GENERALIZATION[method][1][0]  # one source accuracy in both tables
    for f in FIGURES:
        assert f.protocol in PROTOCOLS and f.source and 0 < f.value < 100
        assert f.dataset in (*DATASETS_11, *DG_TARGETS, "average")
        if f.checked is False and f.protocol == "base_to_new" and f.method not in BASE_TO_NEW_UNCHECKED:
            assert f.dataset != "average"
    assert lookup("cocoop", "base_to_new", "average", "hm").checked
    assert not lookup("cocoop", "base_to_new", "dtd").checked
    assert lookup("maple", "domain_generalization", "imagenet_a").value == 50.90
    coprompt = [lookup("coprompt", "base_to_new", "average", m) for m in ("accuracy", "new_accuracy", "hm")]
    assert [f.value for f in coprompt] == [84.00, 77.23, 80.48] and all(f.checked for f in coprompt)
    assert harmonic_mean(84.00, 77.23) == pytest.approx(80.48, abs=0.011)


def test_collect_published_rows(tmp_path):
    # base-to-new CoCoOp on DTD (2 seeds) and EuroSAT; CoOp on ImageNet with transfer targets;
    # a tiny-model run, which has no published counterpart
    b2n = ["method=cocoop", "data.subsample_classes=base"]
    for seed, acc in ((1, 78.0), (2, 76.0)):
        write_run(
            tmp_path / f"dtd{seed}", [*b2n, "data.name=dtd", f"data.seed={seed}"], metrics={"accuracy": acc}
        )
    write_run(tmp_path / "euro", [*b2n, "data.name=eurosat"], metrics={"accuracy": 90.0})
    evals = {"dtd": {"accuracy": 40.0}, "imagenet_a": {"accuracy": 50.0}}
    write_run(
        tmp_path / "inet",
        ["data.name=imagenet", "eval.targets=[dtd,imagenet_a]"],
        metrics={"accuracy": 70.0},
        evals=evals,
    )
    tiny = ["model.name=configs/models/coop-tiny.json", "model.pretrained=none", "data.name=dtd"]
    write_run(tmp_path / "tiny", tiny, metrics={"accuracy": 10.0})

    assert collect(tmp_path, "--table", "datasets", "--published", "--out", tmp_path / "t") == 0
    table = pd.read_csv(tmp_path / "t" / "results_datasets.csv")
    by = {
        (m, str(s)): r
        for m, s, r in zip(
            table["method"], table["data.subsample_classes"], table.to_dict("records"), strict=True
        )
    }
    ours, paper, delta = by[("cocoop", "base")], by[("cocoop: paper", "base")], by[("cocoop: Δ", "base")]
    assert (
        ours["dtd_mean"] == 77.0 and paper["dtd_mean"] == 77.01 and delta["dtd_mean"] == pytest.approx(-0.01)
    )
    assert paper["eurosat_mean"] == 87.49 and delta["eurosat_mean"] == pytest.approx(90.0 - 87.49)
    assert math.isnan(paper["dtd_std"]) and math.isnan(paper["imagenet_mean"])  # we have no number there
    assert math.isnan(paper["average"])  # as ours: not every column has a number
    # the rows come right under ours, in the same columns
    order = list(table["method"])
    i = order.index("cocoop")
    assert order[i + 1 : i + 3] == ["cocoop: paper", "cocoop: Δ"]
    # transfer: ImageNet is the cross-dataset source, DTD a cross-dataset target, ImageNet-A a DG target
    coop = table[table["method"] == "coop: paper"]
    assert len(coop) == 1  # the tiny-model coop row has none
    coop = coop.iloc[0]
    assert (coop["imagenet_mean"], coop["dtd_mean"], coop["imagenet_a_mean"]) == (71.51, 41.92, 49.71)
    md = (tmp_path / "t" / "results_datasets.md").read_text()
    paper_line = next(line for line in md.splitlines() if line.startswith("| cocoop: paper ("))
    delta_line = next(line for line in md.splitlines() if line.startswith("| cocoop: Δ ("))
    assert paper_line.endswith("| – | 77.01 | 87.49 | – | – |")
    assert delta_line.endswith("| – | -0.01 | 2.51 | – | – |")
    assert "Paper rows:" in md and "CoCoOp (Zhou et al., CVPR 2022), Table 1; 0 of 2 cell(s) checked" in md
    tiny_line = next(
        line for line in md.splitlines() if "pretrained=none" in line and line.startswith("- coop (")
    )
    assert tiny_line.endswith(
        "no paper row: its runs use model.pretrained=none; the published figures ran OpenAI's weights (openai)"
    )
    with pytest.raises(SystemExit):
        collect(tmp_path, "--published")  # only with --table datasets


def test_collect_published_says_why_no_paper_row_applies(tmp_path, capsys):
    """A row without a paper row gets one line naming the reason; none is dropped silently."""
    reasons = {
        ("coop", 16): "the paper quotes only its mean over the 11 datasets for coop (few-shot)",
        (
            "coop",
            2,
        ): "no published few-shot figure for coop at 2 shots on ViT-B-16 (published: 16 shots on ViT-B-16)",
        ("linear_probe", 16): "no published few-shot figures for method=linear_probe",
        ("tip_adapter", 3): "no published few-shot figure for tip_adapter at 3 shots on RN50 "
        "(published: 1, 2, 4, 8, 16 shots on RN50)",
    }
    for method, shots, model in (("coop", 16, "ViT-B-16"), ("coop", 2, "ViT-B-16"),
                                 ("linear_probe", 16, "ViT-B-16"), ("tip_adapter", 3, "RN50")):  # fmt: skip
        over = [f"method={method}", f"data.shots={shots}", f"model.name={model}", "data.name=dtd"]
        write_run(tmp_path / f"{method}{shots}", over, metrics={"accuracy": 50.0, "macro_f1": 49.0})
    assert collect(tmp_path, "--table", "datasets", "--published") == 0
    out = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "results_datasets.csv")
    assert not table["method"].str.contains("paper").any()
    notes = out.split("Paper rows:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(notes) == 4
    for (method, shots), reason in reasons.items():
        line = next(n for n in notes if n.startswith(f"- {method} (") and f"shots={shots}," in n)
        assert f": no paper row: {reason}" in line, line
    assert collect(tmp_path, "--table", "datasets", "--published", "--metric", "macro_f1") == 0
    out = capsys.readouterr().out
    assert out.count("no paper row: the papers report accuracy, not macro_f1") == 4
