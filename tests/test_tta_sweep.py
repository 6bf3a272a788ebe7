"""Test-time passes in sweeps and tables: tools/sweep.py over a test-time protocol (tools/tta.py in
its own process), tools/collect.py --table test_time (per-dataset cells, the OOD and 10-dataset
averages, the papers' rows)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, TINY_CONFIG, make_image_folder, run_tool_in_process

from coop.results.tables import load_runs
from coop.results.tta_table import CROSS, OOD, PUBLISHED, tta_table, with_published

ZERO = REPO / "configs" / "tta" / "zero.yaml"
TINY = [f"model.name={TINY_CONFIG}", "model.pretrained=none"]


def test_a_sweep_plans_and_runs_test_time_passes(tmp_path):
    grid = REPO / "configs" / "protocols" / "test_time_cross_dataset.yaml"
    args = [
        "--grid",
        grid,
        "--config",
        ZERO,
        "--out",
        tmp_path / "plan",
        "--dry-run",
        *TINY,
        "data.root=/nowhere",
    ]
    result = run_tool_in_process(REPO / "tools" / "sweep.py", args)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "30 runs: 0 done, 0 to resume, 30 new"
    assert lines[0].split()[:2] == [
        "new",
        "caltech101/coop-tiny/tta_zero/zeroshot_template-bfda1b93_views64/seed1",
    ]
    folder = make_image_folder(tmp_path / "images", n_train=1, n_test=1)
    args = [
        "--config",
        ZERO,
        "--out",
        tmp_path / "runs",
        *TINY,
        "data.name=imagefolder",
        f"data.root={folder}",
    ]
    args += ["tta.views=2", "data.num_workers=0", "device=cpu", "data.seed=1"]
    result = run_tool_in_process(REPO / "tools" / "sweep.py", args)
    assert result.returncode == 0, result.stderr
    runs = sorted((tmp_path / "runs").rglob("metrics.json"))
    assert [p.parent.relative_to(tmp_path / "runs").as_posix() for p in runs] == [
        f"imagefolder/coop-tiny/tta_zero/zeroshot_template-bfda1b93_views2/seed{s}" for s in (1,)
    ]
    metrics = json.loads(runs[0].read_text())
    assert metrics["tta_method"] == "zero" and metrics["n_test"] == 3
    # tools/tta.py ran in its own process: its summary line, in the run's sweep.log
    summary = json.loads((runs[0].parent / "sweep.log").read_text().strip().splitlines()[-1])
    assert summary == {
        "output_dir": str(runs[0].parent),
        **{k: metrics[k] for k in summary if k != "output_dir"},
    }
    assert set(summary) == {
        "output_dir",
        "accuracy",
        "top5",
        "ece",
        "macro_f1",
        "n_test",
        "tta_method",
        "seed",
    }


def fake_pass(root, method: str, dataset: str, seed: int, accuracy: float) -> None:
    """A finished test-time pass's metrics.json and config.yaml, as tools/tta.py writes them."""
    folder = root / dataset / method / f"seed{seed}"
    folder.mkdir(parents=True)
    config = {"method": "zeroshot", "data": {"name": dataset, "seed": seed}, "tta": {"method": method}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    metrics = {"accuracy": accuracy, "tta_method": method, "method": "zeroshot", "init": None}
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_the_table_averages_the_shifted_sets_and_the_ten_datasets(tmp_path):
    for seed, shift in ((1, 0.0), (2, 2.0)):
        for i, dataset in enumerate(("imagenet", *OOD, *CROSS)):
            fake_pass(tmp_path, "zero", dataset, seed, 50.0 + i + shift)
        for i, dataset in enumerate(OOD[:3]):  # an incomplete OOD row
            fake_pass(tmp_path, "tda", dataset, seed, 40.0 + i + shift)
    (tmp_path / "train_run").mkdir()  # a training run: not a test-time pass
    (tmp_path / "train_run" / "metrics.json").write_text(json.dumps({"accuracy": 1.0}))
    (tmp_path / "train_run" / "config.yaml").write_text(yaml.safe_dump({"method": "coop"}))
    table = tta_table(load_runs(tmp_path))
    zero = table[table["tta_method"] == "zero"].iloc[0]
    assert zero["imagenet_mean"] == 51.0 and zero["imagenet_n"] == 2
    assert zero["imagenet_std"] == pytest.approx(2**0.5)
    assert zero["ood_average"] == pytest.approx(51.0 + 2.5)  # datasets 1-4
    assert zero["cross_average"] == pytest.approx(51.0 + 9.5)  # datasets 5-14
    tda = table[table["tta_method"] == "tda"].iloc[0]
    assert tda["imagenetv2_mean"] == 41.0 and tda.isna()["ood_average"] and tda.isna()["cross_average"]
    papers = with_published(table)
    assert len(papers) == len(table) + len(PUBLISHED)
    assert (
        papers.iloc[-1].to_dict()["tta_method"] == "zero: paper" and papers.iloc[-1]["cross_average"] == 64.21
    )
    result = run_tool_in_process(
        REPO / "tools" / "collect.py", [tmp_path, "--table", "test_time", "--published"]
    )
    assert result.returncode == 0, result.stderr
    assert "| zero (host=zeroshot) | 51.00 ± 1.41 (n=2) |" in result.stdout
    assert "| 53.50 | 60.50 |" in result.stdout and "| tpt: paper |" in result.stdout
    assert (tmp_path / "results_test_time.csv").is_file()
