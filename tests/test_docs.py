"""The README and docs/ stay true: every config key, script and config file they name exists."""

from __future__ import annotations

import importlib
import re

import pytest
from conftest import REPO

from coop.config.load import flatten
from coop.config.schema import DEFAULTS, METHODS

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "csv", "md", "txt", "pt", "png", "bin", "toml"}
SECTIONS = {key for key, value in DEFAULTS.items() if isinstance(value, dict)}
KEYS = set(flatten(DEFAULTS))
# a dotted name not preceded by a name, path or attribute character: `train.lr`, data.shots=4
DOTTED = re.compile(r"(?<![\w./<>-])([a-z_]+)\.([a-z_][a-z0-9_]*)(?![\w(])")
SCRIPT = re.compile(r"\btools/(\w+\.py)\b")
CONFIG_FILE = re.compile(r"\bconfigs/([\w./-]+\.(?:yaml|json))\b")
# a path of the package (not the tail of another path: configs/coop/vit_b16.yaml) and a dotted name in it
MODULE_PATH = re.compile(r"(?<![\w/.-])coop/[\w./]*[\w/]")
MODULE_NAME = re.compile(r"(?<![\w./-])coop\.[a-z_]\w*(?:\.[A-Za-z_]\w*)*")
NOT_MODULES = {"coop.prompts"}  # the `format` value of an exported file (interop.md), not a module


def _text(path) -> str:
    return path.read_text(encoding="utf-8")


def test_docs_exist_and_readme_links_them():
    readme = _text(REPO / "README.md")
    assert len(DOCS) > 1
    for doc in DOCS[1:]:
        assert f"docs/{doc.name}" in readme, f"README.md does not link docs/{doc.name}"


def test_readme_fits_on_a_page():
    assert len(_text(REPO / "README.md").splitlines()) <= 250


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_config_keys_exist(doc):
    unknown = set()
    for section, key in DOTTED.findall(_text(doc)):
        if section in SECTIONS and key not in FILE_SUFFIXES and f"{section}.{key}" not in KEYS:
            unknown.add(f"{section}.{key}")
    assert not unknown, f"{doc.name} names config keys that do not exist: {sorted(unknown)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_scripts_and_config_files_exist(doc):
    text = _text(doc)
    missing = [f"tools/{s}" for s in SCRIPT.findall(text) if not (REPO / "tools" / s).is_file()]
    missing += [f"configs/{c}" for c in CONFIG_FILE.findall(text) if not (REPO / "configs" / c).is_file()]
    assert not missing, f"{doc.name} names files that do not exist: {sorted(set(missing))}"


def resolves(dotted: str) -> bool:
    """Whether `coop.a.b.name` is a module, or a name in the longest module that prefixes it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError:
            continue
        for attr in parts[n:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_module_paths_exist(doc):
    """Every `coop/...` path and `coop.module.name` the docs name is real (the layout moves)."""
    text = _text(doc)
    missing = [p for p in MODULE_PATH.findall(text) if not (REPO / p).exists()]
    missing += [m for m in MODULE_NAME.findall(text) if m not in NOT_MODULES and not resolves(m)]
    assert not missing, f"{doc.name} names modules that do not exist: {sorted(set(missing))}"


def test_the_module_check_catches_an_old_path():
    assert MODULE_PATH.findall("see coop/engine.py and configs/coop/vit_b16.yaml") == ["coop/engine.py"]
    assert not (REPO / "coop/engine.py").exists()
    assert not resolves("coop.engine.predict") and not resolves("coop.train.engine.no_such_name")
    assert resolves("coop.train.engine.predict") and resolves("coop.model")


def test_the_key_check_catches_a_misspelt_key():
    found = {
        f"{s}.{k}" for s, k in DOTTED.findall("run with train.aug_view=1 and `data.shots`, tools/train.py")
    }
    assert "train.aug_view" in found and "train.aug_view" not in KEYS
    assert "data.shots" in found and "data.shots" in KEYS
    assert "train.py" not in found or "py" in FILE_SUFFIXES


def test_method_lists_name_every_method():
    """docs/training.md's `method` row and the table of docs/methods.md name exactly the methods."""
    row = next(
        line for line in _text(REPO / "docs" / "training.md").splitlines() if line.startswith("| `method` |")
    )
    assert re.findall(r"`(\w+)`", row.split("|")[2].split("(DePT")[0]) == list(METHODS)
    table = re.findall(r"^\| `(\w+)`", _text(REPO / "docs" / "methods.md"), flags=re.M)
    assert [m for m in table if m != "method"] == list(METHODS)


def test_readme_demo_timing_describes_the_demo_config():
    """The README's measured demo names the run configs/demo.yaml makes: its views, shots and epochs."""
    from coop.config.checks import epochs_for_shots
    from coop.config.load import load_config

    cfg = load_config(str(REPO / "configs" / "demo.yaml"))
    epochs = cfg.train.epochs or epochs_for_shots(cfg.data.shots, cfg.data.name)
    text = " ".join(_text(REPO / "README.md").split())
    timing = text.split("On an idle 2-core CPU", 1)[1].split("A second run", 1)[0]
    n_classes = 3  # textile: nominal, local defect, global defect
    assert (
        f"{cfg.train.aug_views} augmented views of the {cfg.data.shots * n_classes} training images" in timing
    )
    assert f"{epochs} training epochs" in timing and "min" in timing
    assert "seconds" not in _text(REPO / "configs" / "demo.yaml")
