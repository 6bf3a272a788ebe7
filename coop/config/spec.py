"""Reading a typed config schema: each key's declaration (`key` in a dataclass field), what it
takes in words, and the check of a value against it.

    seed: int = key(1, ">= 0")                  # a field of a schema dataclass
    specs(RunConfig)["data.seed"].describe()    # "an integer >= 0"

A declaration is the field's type (bool, int, float, str, `| None`, `list[...]`, `Any`) plus, where
it has them, a range (`"> 0"`, `">= 1"`, `"in [0, 1)"`, `"finite"`; on a list, of each item), a
set of names (`choices`; on a list, of each item) and list constraints. The schema itself is
`coop.config.schema`.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


def key(default, rule: str = "", *, choices: tuple = (), **constraints):
    """A config key: its default, range (`rule`), allowed values (`choices`; on a list, of each
    item) and list constraints: `length`, `distinct`, `nonempty`, `nonempty_items` (strings),
    `order` ("sorted" or "increasing"), `items` (the item type of an `Any` key)."""
    meta = {"rule": rule, "choices": tuple(choices), **constraints}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Spec:
    """One key's declaration: `kind` bool | int | float | str | list | any, `item` the kind of a
    list's items, and the constraints of `key`."""

    kind: str
    item: str | None = None
    optional: bool = False
    rule: str = ""
    choices: tuple = ()
    length: int | None = None
    distinct: bool = False
    nonempty: bool = False
    nonempty_items: bool = False
    order: str = ""

    def describe(self) -> str:
        """What the key takes, e.g. "an integer >= 1 or null", "a list of 2 numbers in [0, 1)"."""
        if self.kind == "list":
            text = self._list()
        elif self.kind == "any":  # a name or a list (lora.layers)
            text = f"one of {', '.join(self.choices)} or {self._list()}"
        else:
            text = _scalar(self.kind, self.rule, self.choices)
        return f"{text} or null" if self.optional else text

    def _list(self) -> str:
        noun = {"int": "integers", "float": "numbers", "str": "strings", "bool": "booleans"}[self.item]
        if self.choices and self.kind == "list":
            noun = f"values of {', '.join(self.choices)}"
        elif self.item == "str" and self.nonempty_items:
            noun = "non-empty strings"
        rule = f" {self.rule}" if self.rule and self.item in ("int", "float") else ""
        words = [
            "a",
            "non-empty" if self.nonempty else "",
            {"sorted": "non-decreasing", "increasing": "increasing"}.get(self.order, ""),
            "list of",
            str(self.length) if self.length else "",
            "distinct" if self.distinct else "",
            f"{noun}{rule}",
        ]
        return " ".join(w for w in words if w)

    def accepts(self, value) -> bool:
        if value is None:
            return self.optional
        if self.kind == "any" and isinstance(value, str):
            return value in self.choices
        if self.kind in ("list", "any"):
            if not (OmegaConf.is_list(value) or isinstance(value, list | tuple)):
                return False
            items = list(value)
            return (
                all(_holds(self.item, self.rule, self.choices, v, self.nonempty_items) for v in items)
                and (self.length is None or len(items) == self.length)
                and (not self.nonempty or bool(items))
                and (not self.distinct or len(set(items)) == len(items))
                and (self.order != "sorted" or items == sorted(items))
                and (self.order != "increasing" or items == sorted(set(items)))
            )
        return _holds(self.kind, self.rule, self.choices, value)


def _scalar(kind: str, rule: str, choices: tuple) -> str:
    if kind == "bool":
        return "true or false"
    if choices:
        return f"one of {', '.join(choices)}"
    noun = {"int": "an integer", "float": "a number", "str": "a string"}[kind]
    if rule == "finite":
        return "a finite number"
    return f"{noun} {rule}" if rule else noun


def _bounds(rule: str) -> tuple[float, float, bool, bool]:
    """(low, high, low inclusive, high inclusive) of a rule such as "> 0" or "in [0, 1)"."""
    if rule == "finite":
        return -math.inf, math.inf, False, False
    if rule.startswith(">="):
        return float(rule[2:]), math.inf, True, True
    if rule.startswith(">"):
        return float(rule[1:]), math.inf, False, True
    if rule.startswith("in "):
        low, high = rule[4:-1].split(",")
        return float(low), float(high), rule[3] == "[", rule[-1] == "]"
    raise ValueError(f"unknown range {rule!r}")


def _holds(kind: str, rule: str, choices: tuple, value, nonempty: bool = False) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str) and (value in choices if choices else not nonempty or bool(value))
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (kind == "int" and not isinstance(value, int)):
        return False
    if not rule:
        return True
    low, high, low_in, high_in = _bounds(rule)
    above = value >= low if low_in else value > low  # comparisons with NaN fail
    below = value <= high if high_in else value < high
    return above and below


def _kind(annotation) -> tuple[str, str | None, bool]:
    """(kind, item kind, optional) of a field's annotation."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    if optional:
        annotation = next(a for a in args if a is not type(None))
    if annotation is Any:
        return "any", None, optional
    if typing.get_origin(annotation) is list:
        return "list", typing.get_args(annotation)[0].__name__, optional
    return annotation.__name__, None, optional


def specs(cls, prefix: str = "") -> dict[str, Spec]:
    """{dotted key: Spec} of a schema dataclass and its nested sections."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        annotation = hints[f.name]
        if is_dataclass(annotation):
            out.update(specs(annotation, f"{prefix}{f.name}."))
            continue
        kind, item, optional = _kind(annotation)
        meta = dict(f.metadata)
        item = meta.pop("items", item)
        out[f"{prefix}{f.name}"] = Spec(kind, item, optional, **meta)
    return out


def check_values(cfg: DictConfig, specs: dict[str, Spec]) -> str | None:
    """The first key whose value is out of its declared type, set or range, as a one-line message
    ("train.momentum must be a number >= 0, got -5.0"); None when every key is within."""
    try:  # the whole tree once: a select per key costs ~4x more
        tree = OmegaConf.to_container(cfg, resolve=True)
        value_of = functools.partial(_value_at, tree)
    except OmegaConfBaseException:  # an interpolation that fails: select raises it, naming its key
        value_of = functools.partial(OmegaConf.select, cfg)
    for name, spec in specs.items():
        value = value_of(name)
        if not spec.accepts(value):
            return f"{name} must be {spec.describe()}, got {shown(value)!r}"
    return None


def _value_at(tree: dict, name: str):
    """The value of dotted key `name` in a plain config tree, as `OmegaConf.select` reads it from
    the config: None when a section or the key is absent, or holds OmegaConf's missing value."""
    node = tree
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if node == "???" else node


def check_layer(tree: dict, specs: dict[str, Spec], prefix: str = "") -> str | None:
    """A message for what OmegaConf would misread or fail on in a layer (file, overrides, saved
    config): a boolean key set to anything but YAML's true or false (OmegaConf would read any
    non-zero number or a string "yes" as true: `fl.iid=2`, while the recipes look for
    `dept.enabled: true`), or a key that takes a value set to a mapping; None when there is none."""
    for name, value in tree.items():
        full = f"{prefix}{name}"
        spec = specs.get(full)
        if isinstance(value, dict) and spec is None:
            problem = check_layer(value, specs, f"{full}.")
            if problem:
                return problem
            continue
        interpolation = isinstance(value, str) and value.startswith("${")
        mapping = isinstance(value, dict)
        if spec is not None and (
            mapping
            or spec.kind == "bool"
            and not (isinstance(value, bool) or interpolation or value is None and spec.optional)
        ):
            return f"{full} must be {spec.describe()}, got {value!r}"
    return None


def shown(value):
    """A config value as plain Python, for messages."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
