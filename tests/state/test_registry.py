"""The rule registry sits below `estimate.py` and `trainer_memcb/state/rules/`, with no import cycle,
even a lazy one (tests/test_layers.py holds the whole package to that)."""

from __future__ import annotations

import ast
import pathlib
from typing import Set

import pytest
import torch

import trainer_memcb
from trainer_memcb import estimate_optimizer_state, measure_optimizer_state, register_estimate_rule
from trainer_memcb.state.registry import find_estimate_rule, find_state_location

PACKAGE = pathlib.Path(trainer_memcb.__file__).parent


def imported_modules(path: pathlib.Path) -> Set[str]:
    """Every module a file imports, at import time or inside a function."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_registry_imports_neither_estimate_nor_the_rules() -> None:
    imported = imported_modules(PACKAGE / "state" / "registry.py")
    assert {name for name in imported if name.startswith("trainer_memcb")} == set()
    assert "import_module" not in (PACKAGE / "state" / "registry.py").read_text()


def test_estimate_does_not_import_the_rules() -> None:
    imported = imported_modules(PACKAGE / "state" / "estimate.py")
    assert sorted(name for name in imported if name.startswith("trainer_memcb")) == [
        "trainer_memcb.state.registry",
        "trainer_memcb.state.registry.EstimateRule",
        "trainer_memcb.state.registry.ParamInfo",
        "trainer_memcb.state.registry.find_estimate_rule",
        "trainer_memcb.state.registry.optimizer_views",
        "trainer_memcb.state.registry.register_estimate_rule",
        "trainer_memcb.state.unwrap",
        "trainer_memcb.state.unwrap.inner_optimizers",
    ]


def test_rules_register_through_the_registry_not_estimate() -> None:
    for path in sorted((PACKAGE / "state" / "rules").glob("*.py")):
        assert "trainer_memcb.state.estimate" not in imported_modules(path), path.name


def test_old_import_path_still_works() -> None:
    from trainer_memcb.state.estimate import ParamInfo as OldParamInfo
    from trainer_memcb.state.estimate import register_estimate_rule as old_register
    from trainer_memcb.state.registry import ParamInfo, register_estimate_rule as new_register

    assert OldParamInfo is ParamInfo and old_register is new_register is register_estimate_rule


class _AttributeState(torch.optim.Optimizer):
    """Keeps one buffer per parameter in an attribute, keyed by position, as AdaLomo does."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})
        self.buffers = [torch.zeros_like(p) for p in self.param_groups[0]["params"]]


def test_user_declared_state_location_is_measured_and_estimated() -> None:
    layer = torch.nn.Linear(4, 3)  # 12 + 3 values
    optimizer = _AttributeState(layer.parameters())
    assert measure_optimizer_state(optimizer).num_bytes == 0  # not in .state, not registered yet
    register_estimate_rule(
        _AttributeState,
        lambda p, group, opt: {"buffer": p.num_bytes},
        state_location=lambda opt: ({"buffer": buffer} for buffer in opt.buffers),
        source="tests/state/test_registry.py _AttributeState.__init__",
    )
    measured = measure_optimizer_state(optimizer)
    assert (measured.num_bytes, measured.num_params_with_state, measured.bytes_by_key) == (60, 2, {"buffer": 60})
    assert estimate_optimizer_state(optimizer).num_bytes == 60
    assert find_state_location(_AttributeState) is find_estimate_rule(_AttributeState).state_location


def test_default_state_location_is_optimizer_state() -> None:
    assert find_state_location(torch.optim.AdamW) is None
    assert find_state_location(torch.optim.Optimizer) is None


def test_bad_state_location_is_refused() -> None:
    with pytest.raises(ValueError, match="state_location='param_groups'"):
        register_estimate_rule(_AttributeState, lambda p, g, o: {}, state_location="param_groups")


def test_the_guide_state_location_snippet_runs_as_written(capsys) -> None:
    guide = PACKAGE.parent / "docs" / "optimizers.md"
    section = guide.read_text(encoding="utf-8").split("## Where the state lives", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(snippet, str(guide), "exec"), {})
    assert capsys.readouterr().out == "40 40\n"
