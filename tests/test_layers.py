"""The package's layers, held statically: each subpackage imports only the layers below it, no
module loads another by name, and the module import graph has no cycle (imports inside functions
included)."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

import trainer_memcb

PACKAGE = pathlib.Path(trainer_memcb.__file__).parent

# Layer -> the layers it may import, bottom first. The package root (`trainer_memcb/__init__.py`,
# `__main__.py`) re-exports the public names and may import any layer.
ALLOWED: Dict[str, Set[str]] = {
    "utils": set(),
    "state": {"utils"},
    "plan": {"state", "utils"},
    "training": {"plan", "state", "utils"},
    "runs": {"training", "utils"},  # a finished run's file and key names are the training layer's
    "cli": {"runs", "training", "plan", "state", "utils"},
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: Dict[str, pathlib.Path] = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def package_imports(path: pathlib.Path) -> Set[str]:
    """The package's modules a file imports, at import time or inside a function."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from trainer_memcb.state import rules` imports the module `trainer_memcb.state.rules`.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else "<root>"


def test_every_module_is_in_a_layer_except_the_package_root() -> None:
    roots = sorted(module for module in MODULES if layer_of(module) == "<root>")
    assert roots == ["trainer_memcb", "trainer_memcb.__main__"]


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, path in MODULES.items():
        layer = layer_of(module)
        if layer == "<root>":
            continue
        for imported in package_imports(path):
            target = layer_of(imported)
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{module} -> {imported}")
    assert wrong == []


def test_the_allowed_edges_run_one_way() -> None:
    order = list(ALLOWED)
    for layer, below in ALLOWED.items():
        assert all(order.index(other) < order.index(layer) for other in below), layer


def test_no_module_loads_another_by_name() -> None:
    """A by-name load (`importlib.import_module("trainer_memcb...")`) hides an edge from the table
    above; only the package root's lazy public names may use one."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
                if module != "trainer_memcb" and node.value != module:
                    found.append(f"{module}: {node.value!r}")
    assert found == []


def test_the_module_import_graph_has_no_cycle() -> None:
    graph = {module: package_imports(path) - {module} for module, path in MODULES.items()}
    # A package's __init__ importing its own children is not a cycle back up: drop child -> parent
    # edges that exist only because Python imports a parent package first.
    for module in graph:
        graph[module] = {imported for imported in graph[module] if not module.startswith(imported + ".")}
    cycles = []
    state: Dict[str, int] = {}

    def visit(module: str, path: List[str]) -> None:
        state[module] = 1
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                cycles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_layer_test_sees_a_planted_upward_import(tmp_path) -> None:
    """The checker finds an edge the table forbids (so the tests above can fail)."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from trainer_memcb.training import callback\n")
    assert "trainer_memcb.training.callback" in package_imports(planted)
    assert layer_of("trainer_memcb.training.callback") not in ALLOWED["state"]
