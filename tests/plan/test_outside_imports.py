"""A module first imported while a step is traced runs its body outside the trace: its tensors are
real ones, not counted in the step, and it keeps its own loader; the finder is in `sys.meta_path`
only while a trace's fake mode is entered."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import uuid

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from trainer_memcb.plan.step.fake_mode import fake_tensor_mode
from trainer_memcb.plan.step.live_storages import LiveStorages
from trainer_memcb.plan.step.outside_imports import imports_outside_the_trace


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """The name of a module never imported in this process, whose body makes a 256-byte tensor."""
    name = f"constants_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("import torch\nCONSTANT = torch.ones(64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _finders() -> list:
    return [type(finder).__name__ for finder in sys.meta_path]


def test_an_import_inside_the_trace_makes_real_tensors_the_step_does_not_count(fresh_module) -> None:
    before = _finders()
    mode, tracker = fake_tensor_mode(), LiveStorages()
    with mode, tracker:
        assert type(sys.meta_path[0]).__name__ == "_OutsideTheTrace"
        made = torch.empty(16)  # the step's own: 64 bytes
        module = importlib.import_module(fresh_module)
        with mode:  # entered again inside itself: one finder
            assert _finders().count("_OutsideTheTrace") == 1
    assert _finders() == before
    assert type(made) is FakeTensor and type(module.CONSTANT) is torch.Tensor
    assert tracker.peak_bytes == 64
    assert type(module.__loader__) is importlib.machinery.SourceFileLoader
    assert module.__spec__.loader is module.__loader__


def test_without_it_the_import_is_counted_and_its_tensor_stays_fake(fresh_module) -> None:
    # torch's own fake mode: what the trace did before (the first plan of a process 1,024 bytes
    # above the next with bitsandbytes' 8-bit AdamW, `test_trace_sharing`).
    tracker = LiveStorages()
    with FakeTensorMode(), tracker:
        made = torch.empty(16)
        module = importlib.import_module(fresh_module)
    assert type(made) is FakeTensor and type(module.CONSTANT) is FakeTensor
    assert tracker.peak_bytes == 64 + 256


@pytest.mark.parametrize("outside", [imports_outside_the_trace, fake_tensor_mode])
def test_the_finder_leaves_on_an_error(fresh_module, outside) -> None:
    before = _finders()
    with pytest.raises(RuntimeError, match="inside"):
        with outside(), FakeTensorMode():
            importlib.import_module(fresh_module)
            raise RuntimeError("inside")
    assert _finders() == before
    assert type(sys.modules[fresh_module].CONSTANT) is torch.Tensor
