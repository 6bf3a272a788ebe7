"""Shipped config files never beat a per-dataset recipe by accident: every run config and every
sweep grid in configs/ x every dataset that `coop.config.recipes.DATASET_RECIPES` has an entry for
resolves each of that entry's keys to the table's value, unless `ON_PURPOSE` lists the file and
the key with its reason. The resolved table (`tools/recipes.py`) shows every recipe value, and
docs/recipes.md is its current output."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import REPO, run_tool_in_process
from omegaconf import OmegaConf

from coop.config.load import load_config
from coop.config.recipes import DATASET_RECIPES, METHOD_DEFAULTS
from coop.results.recipe_table import RECIPE_METHODS, resolved, show
from coop.train.grid import format_value, load_grid
from coop.train.sweep import plan

CONFIGS = REPO / "configs"
YAMLS = sorted(CONFIGS.rglob("*.yaml"))


def is_grid(path) -> bool:
    """A sweep grid of dotted keys (ablations, protocols, federated grids), not a run config."""
    return any("." in key for key in yaml.safe_load(path.read_text()))


RUN_CONFIGS = [p for p in YAMLS if not is_grid(p)]
GRIDS = [p for p in YAMLS if is_grid(p)]

# Shipped files that change a per-dataset recipe key on purpose: {file: {key: why}}. Any other
# file must leave every per-dataset key to the table (the bug this guards against: MMRL's
# vit_b16.yaml set d_r 512, which beat EuroSAT's 2048).
ON_PURPOSE = {
    "mmrl/vit_b16_cross_datasets.yaml": {
        "mmrl.reg_weight": "its cross-dataset scripts pass REG_WEIGHT 0.2 on the command line",
        "mmrl.rep_dim": "its scripts pass REP_DIM 512: the ImageNet checkpoint's d_r on every target",
        "train.epochs": "its cross-dataset yaml trains ImageNet 1 epoch, not base-to-new's 5",
    },
    "hicropl/vit_b16_c2_ep5_batch32_2ctx_cross_datasets.yaml": {
        "train.epochs": "its cross-dataset config trains ImageNet 5 epochs, not base-to-new's 40",
        "train.batch_size": "its cross-dataset config trains ImageNet in batches of 32, not 128",
    },
    "mmrl/vit_b16_few_shot.yaml": {
        "train.epochs": "50 at every shot count; for ImageNet the original's few-shot script picks "
        "vit_b16_imagenet.yaml (5 epochs) instead of this file",
    },
}


def recipe_method(cfg) -> str:
    return f"{cfg.method}+dept" if cfg.dept.enabled else cfg.method


def departures(cfg, method: str, dataset: str) -> dict:
    """{key: (resolved, table)} for the per-dataset keys of `method` on `dataset` that `cfg` does not
    resolve to the table's value."""
    table = DATASET_RECIPES.get(method, {}).get(dataset, {})
    return {k: (OmegaConf.select(cfg, k), v) for k, v in table.items() if OmegaConf.select(cfg, k) != v}


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_run_configs_leave_per_dataset_keys_to_the_table(path):
    name = str(path.relative_to(CONFIGS))
    method = recipe_method(load_config(str(path)))
    allowed, used, wrong = ON_PURPOSE.get(name, {}), set(), []
    for dataset in DATASET_RECIPES.get(method, {}):
        for key, (got, want) in departures(
            load_config(str(path), [f"data.name={dataset}"]), method, dataset
        ).items():
            if key in allowed:
                used.add(key)
            else:
                wrong.append(f"{key}={got!r} on {dataset} (the table's: {want!r})")
    assert not wrong, f"configs/{name} (method {method}) beats the per-dataset recipe: {wrong}"
    assert used == set(allowed), (
        f"ON_PURPOSE lists keys that configs/{name} does not change: {set(allowed) - used}"
    )


def test_every_exception_names_a_shipped_file():
    assert set(ON_PURPOSE) <= {str(p.relative_to(CONFIGS)) for p in RUN_CONFIGS}


def grid_point(path, method: str, dataset: str, out):
    """The config of the first run of grid `path` for `method` (a "+dept" recipe: its host with
    dept.enabled) on `dataset`, the grid's other swept keys narrowed to their first value."""
    host, dept = method.removesuffix("+dept"), method.endswith("+dept")
    chosen = [f"method={host}", f"data.name={dataset}", *(["dept.enabled=true"] if dept else [])]
    grid = load_grid(str(path), [])
    skip = {"method", "data.name", "dept.enabled"}
    narrow = [f"{k}={format_value(v[0])}" for k, v in grid.items() if len(v) > 1 and k not in skip]
    return load_config(
        None, plan(load_grid(str(path), [*narrow, *chosen]), out, check_data=False)[0].overrides
    )


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_grids_leave_per_dataset_keys_to_the_table(path, tmp_path):
    """Every method with a per-dataset recipe, on every dataset that the grid runs and the table
    has (a grid's fixed values yield to the recipe, `coop.train.sweep`; a swept key applies to every
    method the grid runs, so none may be a per-dataset key of one of them: an ablation grid of CoOp
    may sweep prompt.depth, which CoPrompt's table sets per dataset)."""
    grid = load_grid(str(path), [])
    runs = set(grid.get("method", [load_config(None).method]))
    per_dataset_keys = {
        k for method in runs for entry in DATASET_RECIPES.get(method, {}).values() for k in entry
    }
    swept = {k for k, v in grid.items() if len(v) > 1}
    assert not swept & per_dataset_keys, f"configs/{path.relative_to(CONFIGS)} sweeps a per-dataset key"
    wrong = []
    for method, per_dataset in DATASET_RECIPES.items():
        for dataset in set(grid.get("data.name", [load_config(None).data.name])) & set(per_dataset):
            cfg = grid_point(path, method, dataset, tmp_path)
            assert (recipe_method(cfg), cfg.data.name) == (method, dataset)
            wrong += [f"{method} on {dataset}: {k}={g!r} (the table's: {w!r})" for k, (g, w) in departures(cfg, method, dataset).items() if k not in swept]  # fmt: skip
    assert not wrong, f"configs/{path.relative_to(CONFIGS)} beats the per-dataset recipe: {wrong}"


def test_the_check_catches_a_file_that_sets_a_per_dataset_key(tmp_path):
    """MMRL's base-to-new file as it was (d_r 512) fails on EuroSAT; TCP's with 50 epochs on ImageNet."""
    for source, key, value, dataset in (
        ("mmrl/vit_b16.yaml", "mmrl.rep_dim", 512, "eurosat"),
        ("tcp/vit_b16_ep100_ctxv1.yaml", "train.epochs", 50, "imagenet"),
    ):
        cfg = OmegaConf.load(CONFIGS / source)
        OmegaConf.update(cfg, key, value)
        path = tmp_path / source.replace("/", "_")
        OmegaConf.save(cfg, path)
        method = recipe_method(load_config(str(path)))
        got = departures(load_config(str(path), [f"data.name={dataset}"]), method, dataset)
        assert key in got, source


# --- the resolved table: tools/recipes.py and docs/recipes.md ----------------------------------

RECIPES_TOOL = REPO / "tools" / "recipes.py"


def test_docs_recipes_md_is_the_tools_current_output(tmp_path):
    out = tmp_path / "recipes.md"
    res = run_tool_in_process(RECIPES_TOOL, ["--write", out])
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert text == (REPO / "docs" / "recipes.md").read_text(), (
        "docs/recipes.md is stale: python tools/recipes.py --write docs/recipes.md"
    )
    for method in RECIPE_METHODS:
        assert f"\n## {method}\n" in text, method


def test_the_table_shows_every_recipe_value():
    """Each value of METHOD_DEFAULTS and DATASET_RECIPES, as shown for its method and datasets."""
    datasets = ["imagenet", "sun397", "eurosat", "dtd"]
    for method in RECIPE_METHODS:
        _, rows = resolved(method, datasets)
        for dataset in datasets:
            recipe = {**METHOD_DEFAULTS.get(method, {}), **DATASET_RECIPES.get(method, {}).get(dataset, {})}
            for key, value in recipe.items():
                if key == "train.iterations_per_shot":  # shown with its steps
                    assert rows[dataset][key].startswith(f"{value} ("), (method, key)
                else:
                    assert rows[dataset][key] == show(OmegaConf.create({"v": value}), "v"), (
                        method,
                        dataset,
                        key,
                    )
    _, coop = resolved("coop", ["imagenet", "dtd"])
    assert (coop["imagenet"]["train.epochs"], coop["dtd"]["train.epochs"]) == (
        "50 (CoOp's rule)",
        "200 (CoOp's rule)",
    )


def test_the_tool_prints_recipes_and_rejects_bad_input():
    res = run_tool_in_process(RECIPES_TOOL, ["--method", "tcp", "--dataset", "imagenet,sun397,dtd"])
    assert res.returncode == 0, res.stderr
    assert "| imagenet, sun397 | 25 |" in res.stdout and "| dtd | 50 |" in res.stdout
    res = run_tool_in_process(
        RECIPES_TOOL, ["--config", CONFIGS / "mmrl" / "vit_b16.yaml", "--dataset", "eurosat"]
    )
    assert res.returncode == 0 and "| `mmrl.rep_dim` | 2048 |" in res.stdout, res.stderr
    for args, message in (
        (["--method", "foo"], "method 'foo' is not one of"),
        (["--dataset", "nope"], "dataset 'nope' is not one of"),
        (["--method", "mmrl", "train.lrr=1"], "'train.lrr'"),
        (["--method", "tcp", "--write", "x.md"], "--write writes every method"),
    ):
        res = run_tool_in_process(RECIPES_TOOL, args)
        errors = [line for line in res.stderr.splitlines() if "error:" in line]
        assert res.returncode == 2 and len(errors) == 1 and message in errors[0], res.stderr
        assert "Traceback" not in res.stderr


def test_the_tool_runs_as_a_script():
    cmd = [sys.executable, str(RECIPES_TOOL), "--method", "mmrl", "--dataset", "eurosat"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("## mmrl\n") and "| `mmrl.rep_dim` | 2048 |" in res.stdout
