"""The package's layers hold: no module imports a higher layer or a sibling layer, and no import cycle.

The order is the one docs/development.md draws and each subpackage's `__init__.py` states.
"""

from __future__ import annotations

import ast

import pytest
from conftest import REPO

COOP = REPO / "coop"
# bottom to top; names on one rank are siblings, which never import each other
RANKS = [
    {"config"},
    {"root"},  # coop/io.py, coop/distributed.py, coop/versions.py
    {"model", "data"},
    {"methods", "reference"},
    {"train", "results"},
    {"federated"},
    {"interop"},
    {"tta"},  # its host may be any run or export, loaded as coop.interop loads a classifier
    {"face"},  # coop/__init__.py
]
RANK = {part: i for i, parts in enumerate(RANKS) for part in parts}


def module_name(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(COOP.rglob("*.py"))}


def part_of(module: str) -> str:
    """The layer a module of coop belongs to: its subpackage, 'root' or 'face'."""
    pieces = module.split(".")
    if len(pieces) == 1:
        return "face"
    if f"coop.{pieces[1]}" in MODULES and (COOP / pieces[1]).is_dir():
        return pieces[1]
    return "root"


def imports(path, top_level_only: bool = False) -> set[str]:
    """The coop modules a file imports (`from coop.x import y` names coop.x.y where that is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = _module_level(tree) if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "coop"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "coop":
            subs = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
            found |= subs if len(subs) == len(node.names) else subs | {node.module}
    return {m for m in found if m in MODULES}


def _module_level(tree: ast.Module):
    """Every node outside function bodies: what runs at import, and `if TYPE_CHECKING:` imports,
    which tie the modules as much for a reader as for a type checker."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            todo.extend(ast.iter_child_nodes(node))


def test_the_layers_cover_every_module():
    assert {part_of(m) for m in MODULES} == set(RANK), (
        "a subpackage is missing from RANKS (and from the docs)"
    )
    root = sorted(m for m in MODULES if part_of(m) == "root")
    assert root == ["coop.distributed", "coop.io", "coop.versions"], f"modules at the package root: {root}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_higher_or_sibling_layer(module):
    mine = part_of(module)
    bad = [
        m for m in sorted(imports(MODULES[module])) if part_of(m) != mine and RANK[part_of(m)] >= RANK[mine]
    ]
    assert not bad, f"{module} ({mine}) imports {bad}"


def test_no_import_cycles():
    graph = {m: imports(p, top_level_only=True) - {m} for m, p in MODULES.items()}
    # a package's __init__ imports its own submodules to hand them on; an edge back to it is a cycle
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path[path.index(n) :] + [n])}")
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader of imports finds both forms, so an upward import would not pass unseen."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from coop.train import engine\n    import coop.results.tables\n")
    assert imports(f) == {"coop.train.engine", "coop.results.tables"}
    f.write_text("from coop.methods import METHODS, base\n")
    assert imports(f) == {"coop.methods", "coop.methods.base"}
    f.write_text("if TYPE_CHECKING:\n    from coop.train.engine import Setup\ndef g():\n    import coop.io\n")
    assert imports(f, top_level_only=True) == {"coop.train.engine"}
    assert RANK[part_of("coop.train.engine")] > RANK[part_of("coop.model.clip")]
