"""Protocol grids keep each method's recipe: every method x every grid in configs/protocols."""

from __future__ import annotations

import pytest
from conftest import REPO
from omegaconf import OmegaConf

from coop.config.load import load_config
from coop.config.recipes import DATASET_RECIPES, METHOD_DEFAULTS
from coop.methods import METHODS
from coop.train.grid import format_value, load_grid, recipe_keys
from coop.train.sweep import plan

GRIDS = sorted((REPO / "configs" / "protocols").glob("*.yaml"))


def first_point(path, method, *overrides, out):
    """The config of the first run of `path` for `method` (swept keys narrowed to one value)."""
    grid = load_grid(str(path), [])
    narrow = [f"{k}={format_value(v[0])}" for k, v in grid.items() if len(v) > 1 and k != "method"]
    runs = plan(load_grid(str(path), [*narrow, f"method={method}", *overrides]), out, check_data=False)
    return load_config(None, runs[0].overrides)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda p: p.stem)
def test_every_method_keeps_its_recipe(grid, tmp_path):
    assert GRIDS, "no protocol grids found"
    fixed = load_grid(str(grid), []).fixed
    for method in METHODS:
        cfg = first_point(grid, method, out=tmp_path)
        assert cfg.method == method
        recipe = {**METHOD_DEFAULTS.get(method, {}), **DATASET_RECIPES.get(method, {}).get(cfg.data.name, {})}
        for key, value in recipe.items():
            assert OmegaConf.select(cfg, key) == value, f"{grid.name}: method={method} {key}"
        # the grid's own settings apply where the recipe is silent
        for key in fixed - recipe_keys(method) - {"method"}:
            expected = load_grid(str(grid), [])[key][0]
            assert OmegaConf.select(cfg, key) == expected, f"{grid.name}: method={method} {key}"


def test_the_command_line_wins(tmp_path):
    few_shot = REPO / "configs" / "protocols" / "few_shot.yaml"
    assert first_point(few_shot, "coop", out=tmp_path).prompt.n_ctx == 16  # the grid's CoOp setting
    assert first_point(few_shot, "maple", out=tmp_path).prompt.n_ctx == 2  # MaPLe's recipe
    assert first_point(few_shot, "maple", "prompt.n_ctx=4", out=tmp_path).prompt.n_ctx == 4
    cocoop = first_point(few_shot, "cocoop", out=tmp_path).prompt
    assert (cocoop.n_ctx, cocoop.ctx_init) == (None, "a photo of a")  # the 16 would cancel the phrase
    swept = plan(load_grid(str(few_shot), ["method=maple", "prompt.n_ctx=[2,16]", "data.name=dtd",
                                           "data.shots=1", "data.seed=1"]), tmp_path, check_data=False)  # fmt: skip
    assert [load_config(None, r.overrides).prompt.n_ctx for r in swept] == [2, 16]
