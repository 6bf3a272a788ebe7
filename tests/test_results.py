"""Result tables from hand-written run folders: grouping, base-to-new HM, the per-dataset layout."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

import pandas as pd
import pytest
import yaml
from conftest import REPO
from omegaconf import OmegaConf

from coop.config.load import load_config
from coop.results.tables import dataset_table, format_dataset_markdown, load_runs, summarize, varying_keys


def collect(*args) -> int:
    spec = importlib.util.spec_from_file_location("coop_tool_collect", REPO / "tools" / "collect.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.main([str(a) for a in args])


def write_run(folder, overrides=(), extra=None, metrics=None, evals=None, legacy=False):
    """A run folder as train.py/eval.py leave it: config.yaml, metrics.json, eval_*.json.

    `extra`: keys added to the config as they are; `legacy`: a config from before the `method` key.
    """
    cfg = OmegaConf.to_container(load_config(None, list(overrides)))
    cfg.update(extra or {})
    if legacy:
        cfg.pop("method", None)
    cfg["output_dir"] = str(folder)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps({**metrics, "per_class_accuracy": [1.0]}))
    for name, values in (evals or {}).items():
        (folder / f"eval_{name}.json").write_text(json.dumps(values))


def test_result_free_keys_never_split_seeds(tmp_path):
    # Seed 2 ran on another machine: other device, workers, data folder, eval batch and cache switch.
    write_run(tmp_path / "a", ["data.seed=1"], metrics={"accuracy": 60.0})
    other = ["data.seed=2", "data.num_workers=8", "device=cuda", "data.root=/elsewhere",
             "train.eval_batch_size=500", "train.cache_features=false"]  # fmt: skip
    write_run(tmp_path / "b", other, metrics={"accuracy": 70.0})
    runs = load_runs(tmp_path)
    assert varying_keys(runs) == []
    assert collect(tmp_path) == 0
    table = pd.read_csv(tmp_path / "results.csv")
    assert len(table) == 1 and table["n_seeds"][0] == 2 and table["seeds"][0] == "1,2"
    assert table["accuracy_mean"][0] == 65.0
    # a key that can change results still splits
    write_run(tmp_path / "c", ["data.seed=1", "train.lr=0.1"], metrics={"accuracy": 10.0})
    assert varying_keys(load_runs(tmp_path)) == ["train.lr"]


def test_list_valued_config_keys_group(tmp_path):
    for seed, targets in ((1, ["dtd"]), (2, ["dtd"]), (3, ["dtd", "eurosat"])):
        write_run(tmp_path / f"s{seed}", [f"data.seed={seed}"], extra={"eval": {"targets": targets}},
                  metrics={"accuracy": 50.0 + seed})  # fmt: skip
    table = summarize(load_runs(tmp_path), by=["eval.targets"])
    assert dict(zip(table["eval.targets"], table["n_seeds"], strict=True)) == {
        ("dtd",): 2,
        ("dtd", "eurosat"): 1,
    }


def test_base_to_new_hm_is_of_seed_averages(tmp_path):
    # seed 1: base 80, new 40; seed 2: base 40, new 80. Per-seed HMs are 53.33 each, but the
    # seed-averaged accuracies are 60 and 60, whose HM (CoCoOp's headline number) is 60.
    for seed, base, new in ((1, 80.0, 40.0), (2, 40.0, 80.0)):
        write_run(
            tmp_path / f"seed{seed}",
            [f"data.seed={seed}", "data.subsample_classes=base"],
            metrics={"accuracy": base},
            evals={"textile_new": {"accuracy": new}},
        )
    table = summarize(load_runs(tmp_path), by=[])
    assert table["new_accuracy_mean"][0] == 60.0
    assert table["hm_mean"][0] == pytest.approx(60.0)
    assert table["hm_per_seed_mean"][0] == pytest.approx(2 * 80 * 40 / 120)
    assert table["hm_per_seed_std"][0] == pytest.approx(0.0)
    assert collect(tmp_path) == 0
    assert "| 60.00 ± 28.28 | 60.00 | 53.33 ± 0.00 |" in (tmp_path / "results.md").read_text()


def synthetic_study(root):
    """CoOp (no `method` key: an older config) on dtd, eurosat and imagenet (+ two ImageNet
    targets), 2 seeds, complete; zero-shot CLIP without eurosat, 1 seed; one unfinished run."""
    acc = {}
    for seed in (1, 2):
        for ds in ("dtd", "eurosat", "imagenet"):
            value = {"dtd": 60, "eurosat": 80, "imagenet": 70}[ds] + seed
            evals = {}
            if ds == "imagenet":
                evals = {"imagenet_sketch": {"accuracy": 40.0 + seed}, "imagenetv2": {"accuracy": 60.0 + seed},
                         "imagenet_new": {"accuracy": 1.0}}  # fmt: skip
            over = [f"data.name={ds}", "data.root=/data", f"data.seed={seed}"]
            write_run(
                root / f"coop/{ds}/seed{seed}", over, metrics={"accuracy": value}, evals=evals, legacy=True
            )
            acc.setdefault(ds, []).append(value)
    for ds, value in (("dtd", 44.0), ("imagenet", 66.0)):
        write_run(root / f"zs/{ds}", ["method=zeroshot", f"data.name={ds}"], metrics={"accuracy": value})
    write_run(root / "coop/dtd/seed3", ["data.name=dtd", "data.root=/data", "data.seed=3"])
    return acc


def test_collect_datasets_table(tmp_path):
    acc = synthetic_study(tmp_path)
    out = tmp_path / "tables"
    assert collect(tmp_path, "--table", "datasets", "--by", "method", "--out", out) == 0
    table = pd.read_csv(out / "results_datasets.csv").set_index("method")
    assert list(table.index) == ["coop", "zeroshot"]
    columns = [c[: -len("_mean")] for c in table.columns if c.endswith("_mean")]
    assert columns == ["imagenet", "dtd", "eurosat", "imagenetv2", "imagenet_sketch"]  # the papers' order
    coop = table.loc["coop"]
    for ds, values in acc.items():
        assert coop[f"{ds}_mean"] == pytest.approx(statistics.mean(values))
        assert coop[f"{ds}_std"] == pytest.approx(statistics.stdev(values))
        assert coop[f"{ds}_n"] == 2
    assert coop["imagenet_sketch_mean"] == 41.5 and coop["imagenetv2_n"] == 2
    means = [coop[f"{ds}_mean"] for ds in columns]
    assert coop["average"] == pytest.approx(sum(means) / len(means))
    zs = table.loc["zeroshot"]
    assert zs["dtd_mean"] == 44.0 and zs["dtd_n"] == 1 and pd.isna(zs["dtd_std"])
    assert pd.isna(zs["eurosat_mean"]) and zs["eurosat_n"] == 0
    assert pd.isna(zs["average"])  # incomplete: never averaged over the cells it has

    text = (out / "results_datasets.md").read_text()
    assert "| method | imagenet | dtd | eurosat | imagenetv2 | imagenet_sketch | **Average** |" in text
    assert "| coop | 71.50 ± 0.71 (n=2) | 61.50 ± 0.71 (n=2) |" in text
    assert f"| {coop['average']:.2f} |" in text
    zs_line = next(line for line in text.splitlines() if line.startswith("| zeroshot"))
    assert zs_line == "| zeroshot | 66.00 (n=1) | 44.00 (n=1) | – | – | – | – |"
    assert "Incomplete runs" in text and "coop/dtd/seed3" in text
    assert not (tmp_path / "results_datasets.csv").exists()  # --out was given


def test_datasets_table_rows_follow_varying_settings(tmp_path):
    synthetic_study(tmp_path)
    assert list(dataset_table(load_runs(tmp_path))["method"]) == ["coop", "zeroshot"]
    # Another CoOp setting becomes a row of its own, labelled by what differs.
    write_run(tmp_path / "coop16/dtd", ["data.name=dtd", "prompt.n_ctx=16"], metrics={"accuracy": 65.0})
    table = dataset_table(load_runs(tmp_path))
    assert "prompt.n_ctx" in table.columns and "data.root" not in table.columns
    assert list(zip(table["method"], table["dtd_mean"], strict=True)) == [
        ("coop", 65.0), ("coop", 61.5), ("zeroshot", 44.0)
    ]  # fmt: skip
    assert "| coop (n_ctx=16) | – | 65.00 (n=1) |" in format_dataset_markdown(table)
    # DTD both trained on and reached by transfer from ImageNet: cells must not pool the two.
    write_run(tmp_path / "coop/imagenet/seed9", ["data.name=imagenet", "data.seed=9"],
              metrics={"accuracy": 70.0}, evals={"dtd": {"accuracy": 30.0}})  # fmt: skip
    split = dataset_table(load_runs(tmp_path), by=["method", "prompt.n_ctx"])
    coop = split[(split["method"] == "coop") & (split["prompt.n_ctx"] == "null")].set_index("data.name")
    assert coop.loc["dtd", "dtd_mean"] == 61.5 and coop.loc["imagenet", "dtd_mean"] == 30.0
    with pytest.raises(ValueError, match="unknown grouping key 'prompt.colour'"):
        dataset_table(load_runs(tmp_path), by=["prompt.colour"])
