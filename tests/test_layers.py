"""The package's layers, held statically: each subpackage imports only the layers below it, each
stage of the plan only the stages before it, no module loads another by name, and the module
import graph has no cycle (imports inside functions included)."""

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


# The plan's stages, each a subpackage of `trainer_memcb.plan`, in order -> the stages it may
# import. `device` (the caching allocator, the GPU presets) imports no other stage; the settings, the
# step and the answers may import it. The package `trainer_memcb.plan` itself imports no stage.
PLAN_STAGES: Dict[str, Set[str]] = {
    "device": set(),
    "settings": {"device"},  # a GPU preset's name and the allocator's settings are checked where they are given
    "model": {"settings"},
    "optimizers": {"model", "settings"},
    "step": {"device", "optimizers", "model", "settings"},
    "answers": {"step", "device", "optimizers", "model", "settings"},
}
# What the answers read of the step: its products (the timeline, the evaluation forward) and the
# functions that trace it, never the tracker or the engines.
STEP_PRODUCTS = {"trainer_memcb.plan.step.trace", "trainer_memcb.plan.step.timeline",
                 "trainer_memcb.plan.step.eval_forward", "trainer_memcb.plan.step.flops"}


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
    for table in (ALLOWED, PLAN_STAGES):
        order = list(table)
        for layer, below in table.items():
            assert all(order.index(other) < order.index(layer) for other in below), layer


def stage_of(module: str) -> str:
    """The plan stage of a module of `trainer_memcb.plan` ("<plan>" for the package itself)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "<plan>"


def test_every_plan_module_is_in_a_stage() -> None:
    plan = [module for module in MODULES if layer_of(module) == "plan"]
    assert sorted(module for module in plan if stage_of(module) == "<plan>") == ["trainer_memcb.plan"]
    assert {stage_of(module) for module in plan} - {"<plan>"} <= set(PLAN_STAGES)


def test_each_plan_stage_imports_only_the_stages_before_it() -> None:
    wrong = []
    for module, path in MODULES.items():
        if layer_of(module) != "plan":
            continue
        stage = stage_of(module)
        for imported in package_imports(path):
            if layer_of(imported) != "plan" or stage_of(imported) == stage:
                continue
            if stage == "<plan>" or stage_of(imported) not in PLAN_STAGES[stage]:
                wrong.append(f"{module} -> {imported}")
    assert wrong == []


def test_the_answers_read_the_step_only_through_its_products() -> None:
    wrong = []
    for module, path in MODULES.items():
        if layer_of(module) == "plan" and stage_of(module) == "answers":
            wrong += [f"{module} -> {imported}" for imported in package_imports(path)
                      if imported.startswith("trainer_memcb.plan.step.") and imported not in STEP_PRODUCTS]
    assert wrong == []


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


def test_the_stage_check_sees_a_planted_backward_import(tmp_path) -> None:
    """A stage importing a later one (the trace reading an answer) is found."""
    planted = tmp_path / "planted.py"
    planted.write_text("from trainer_memcb.plan.answers.model_states import plan_model_states\n")
    assert package_imports(planted) == {imported := "trainer_memcb.plan.answers.model_states"}
    assert stage_of(imported) == "answers" and "answers" not in PLAN_STAGES["step"]
