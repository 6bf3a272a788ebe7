"""Sweep grids: a grid file with `key=value` overrides as {dotted key: list of values}, the keys a
method's recipe keeps against a protocol's fixed values, and values as `key=value` text for train.py.

    grid = load_grid("configs/protocols/few_shot.yaml", ["method=[coop,maple]"])
    grid.fixed                      # the keys the file fixes: protocol settings
    recipe_keys("maple")            # the keys MaPLe's recipe keeps (its own, and those cancelling it)
    format_value(0.002)             # "0.002", which OmegaConf reads back as the same value

`coop.train.sweep.plan` expands a grid into run folders.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from coop.config.checks import ConfigError
from coop.config.load import LENGTH_YIELDS, flatten
from coop.config.recipes import DATASET_RECIPES, METHOD_DEFAULTS, YIELDS_TO


class Grid(dict):
    """{dotted key: list of values}; `fixed`: the keys that the grid file sets to one value and the
    command line does not set, the protocol settings that yield to a method's recipe."""

    fixed: frozenset[str] = frozenset()


def recipe_keys(method: str) -> set[str]:
    """The keys of `method`'s recipe (its per-dataset entries included), and the keys whose value
    would cancel one of its entries (`YIELDS_TO`, `LENGTH_YIELDS`: e.g. prompt.n_ctx cancels
    CoCoOp's phrase)."""
    recipe = {**METHOD_DEFAULTS.get(method, {})}
    for per_dataset in DATASET_RECIPES.get(method, {}).values():
        recipe.update(per_dataset)
    yields = {**LENGTH_YIELDS, **YIELDS_TO.get(method, {})}
    cancel = set()
    for key in recipe:
        other = yields.get(key, ())
        cancel |= {other} if isinstance(other, str) else set(other)
    return set(recipe) | cancel


def load_grid(path: str | None, overrides: list[str]) -> Grid:
    """Grid file <- `key=value` overrides, as {dotted key: list of values} (scalars -> [v]).

    Args:
        path: YAML grid file (nested mappings are read as dotted keys) or None.
        overrides: `key=value` strings; values are YAML, so `[1,2]` is a list.
    """
    grid, from_file = {}, set()
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"grid file not found: {path}")
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse grid file {path}: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"grid file {path} must be a mapping of config keys to values or lists")
        grid = flatten(data)
        from_file = {k for k, v in grid.items() if not isinstance(v, list) or len(v) == 1}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument '{item}' is not of the form key=value")
        try:
            grid[key.strip()] = yaml.safe_load(text) if text.strip() else ""
            from_file.discard(key.strip())
        except yaml.YAMLError:
            raise ConfigError(f"cannot parse the value of '{item}'") from None
    values = {k: v if isinstance(v, list) else [v] for k, v in grid.items()}
    for key, v in values.items():
        if key == "output_dir":
            raise ConfigError("output_dir is set by the sweep (--out); remove it from the grid")
        if not v:
            raise ConfigError(f"grid key {key} has an empty list of values")
    grid = Grid(values)
    grid.fixed = frozenset(from_file)
    return grid


@functools.lru_cache(maxsize=4096)  # a grid formats the same few values for each of its points
def _parse_dotlist_value(text: str):
    """How OmegaConf reads `key=text` (for comparison only: callers never change the result)."""
    try:
        return OmegaConf.from_dotlist([f"k={text}"]).k
    except Exception:  # YAML errors of odd strings
        return _UNPARSABLE


_UNPARSABLE = object()


def format_value(value) -> str:
    """A value as a `key=value` string for train.py that OmegaConf parses back to the same value."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, list | tuple):  # a list-valued key, e.g. eval.targets: [[a, b]]
        text = "[" + ",".join(format_value(v) for v in value) + "]"
    else:
        text = str(value)
        if _parse_dotlist_value(text) != text:
            text = "'" + text.replace("'", "''") + "'"  # YAML single-quoted scalar
    if _parse_dotlist_value(text) != value:
        raise ConfigError(f"grid value {value!r} cannot be passed on the command line")
    return text
