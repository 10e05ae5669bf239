"""`OptimizerMemoryCallback(memory_snapshot_dir=..., snapshot_steps=...)`: the allocator's history
recorded over the chosen steps and dumped, on a real `Trainer` training the tiny DistilBERT on the CPU.

CUDA cannot run here. Where a test says so, three calls are faked with monkeypatch:
`torch.cuda.is_available` (True), `torch.cuda.memory._record_memory_history` (noted, in order with
the Trainer's step events) and `torch.cuda.memory._dump_snapshot` (noted; it writes the bytes of a
real snapshot from `tests/data/snapshots/` to the path it is given). A fourth, as in
`test_oom_report.py`: `torch.cuda.is_current_stream_capturing` (False), which the optimizer asks
once CUDA is said to be there, and which a CUDA build of torch without a driver (torch 2.6 here)
answers with an error. The Trainer, the steps, the
model, its out-of-memory error and the files written are real.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, List

import pytest
import torch
from transformers import Trainer, TrainerCallback

from helpers import TinyDataset, tiny_classifier, training_args
from test_oom_report import out_of_memory_at_forward
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.plan.device.snapshot_file import read_snapshot
from trainer_memcb.training.memory_snapshots import MAX_ENTRIES, snapshot_path

REAL_SNAPSHOT = pathlib.Path(__file__).parents[1] / "data" / "snapshots" / "EoR_NN.pickle"


class StepEvents(TrainerCallback):
    """Notes each step's beginning and end in `calls`; placed before ours, so it is called first."""

    def __init__(self, calls: List[str]) -> None:
        self.calls = calls

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.calls.append(f"begin {state.global_step + 1}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.calls.append(f"end {state.global_step}")


def fake_cuda(monkeypatch: Any, calls: List[str], available: bool = True) -> None:
    """Fakes the three CUDA calls (see the module docstring); each notes itself in `calls`."""
    def record(enabled: Any = "all", max_entries: Any = None, **kwargs: Any) -> None:
        calls.append("stop" if enabled is None else f"record max_entries={max_entries}")

    def dump(filename: str) -> None:
        calls.append(f"dump {os.path.basename(filename)}")
        with open(filename, "wb") as handle:
            handle.write(REAL_SNAPSHOT.read_bytes())

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)


def train(output_dir: str, calls: List[str], model: Any = None, max_steps: int = 4, **callback_kwargs: Any) -> Trainer:
    trainer = Trainer(model=model or tiny_classifier(), args=training_args(output_dir, max_steps=max_steps),
                      train_dataset=TinyDataset(),
                      callbacks=[StepEvents(calls), OptimizerMemoryCallback(what_if=(), **callback_kwargs)])
    trainer.train()
    return trainer


def steps(count: int) -> List[str]:
    return [f"{moment} {step}" for step in range(1, count + 1) for moment in ("begin", "end")]


def dumped(name: str) -> List[str]:
    """What the faked `_dump_snapshot` notes: the temporary file beside `name`, then renamed to it."""
    return [f"dump .{name}.partial"]


def test_off_by_default_records_nothing(tmp_path, monkeypatch):
    """Faked CUDA (see the module docstring): with it said to be there, still nothing is recorded."""
    calls: List[str] = []
    fake_cuda(monkeypatch, calls)
    train(str(tmp_path / "out"), calls)
    assert calls == steps(4)
    assert OptimizerMemoryCallback().memory_snapshot_dir is None


def test_without_cuda_it_warns_once_and_records_nothing(tmp_path, monkeypatch, recwarn):
    """Faked CUDA calls (see the module docstring) to count them; `is_available` is False."""
    calls: List[str] = []
    fake_cuda(monkeypatch, calls, available=False)
    folder = tmp_path / "snapshots"
    train(str(tmp_path / "out"), calls, memory_snapshot_dir=str(folder))
    messages = [str(w.message) for w in recwarn if "memory snapshot" in str(w.message)]
    assert messages == ["trainer_memcb: memory_snapshot_dir is set but CUDA is not available: there is no allocator "
                        "history to record; no memory snapshot is written"]
    assert calls == steps(4)
    assert not folder.exists()


def normalized(calls: List[str]) -> List[str]:
    """The temporary file's random part dropped: `.NAME.<random>.partial` -> `.NAME.partial`."""
    out = []
    for call in calls:
        if call.startswith("dump ."):
            head, _, tail = call.rpartition(".partial")
            call = head.rsplit(".", 1)[0] + ".partial" + tail
        out.append(call)
    return out


def test_recording_spans_the_chosen_steps_and_the_dump_is_named_by_the_last(tmp_path, monkeypatch):
    """Faked CUDA (see the module docstring)."""
    calls: List[str] = []
    fake_cuda(monkeypatch, calls)
    folder = tmp_path / "snapshots"
    train(str(tmp_path / "out"), calls, memory_snapshot_dir=folder, snapshot_steps="3,2")
    assert normalized(calls) == [
        "begin 1", "end 1", "begin 2", f"record max_entries={MAX_ENTRIES}", "end 2", "begin 3", "end 3",
        *dumped("memory_snapshot_step3.pickle"), "stop", "begin 4", "end 4"]
    assert sorted(os.listdir(folder)) == ["memory_snapshot_step3.pickle"]  # no temporary file left
    assert (folder / "memory_snapshot_step3.pickle").read_bytes() == REAL_SNAPSHOT.read_bytes()
    assert len(read_snapshot(str(folder / "memory_snapshot_step3.pickle")).device_traces[0]) == 5803


# With CUDA faked as available, the out-of-memory report asks the allocator for its state, which this
# torch has not: that report warns (`test_oom_report.py` fakes the allocator's state to test it).
@pytest.mark.filterwarnings("ignore:trainer_memcb. writing the out-of-memory report failed")
def test_an_out_of_memory_error_dumps_the_oom_file_and_goes_on_unchanged(tmp_path, monkeypatch):
    """Faked CUDA (see the module docstring); the classifier raises `torch.OutOfMemoryError` in step
    2's forward (a real hook on the real model, as in `test_oom_report.py`)."""
    calls: List[str] = []
    fake_cuda(monkeypatch, calls)
    model = tiny_classifier()
    raised = out_of_memory_at_forward(model, at=2)
    folder = tmp_path / "snapshots"
    with pytest.raises(torch.OutOfMemoryError) as caught:
        train(str(tmp_path / "out"), calls, model=model, memory_snapshot_dir=str(folder), snapshot_steps=(1, 2))
    assert caught.value is raised[0]
    assert (caught.value.__context__, caught.value.__cause__) == (None, None)
    assert normalized(calls) == ["begin 1", f"record max_entries={MAX_ENTRIES}", "end 1", "begin 2",
                                 *dumped("memory_snapshot_oom.pickle"), "stop"]
    assert sorted(os.listdir(folder)) == ["memory_snapshot_oom.pickle"]


def test_another_error_stops_recording_without_a_file(tmp_path, monkeypatch):
    """Faked CUDA (see the module docstring)."""
    calls: List[str] = []
    fake_cuda(monkeypatch, calls)
    model = tiny_classifier()

    def fail(*args: Any) -> None:
        raise RuntimeError("not memory")

    model.classifier.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="^not memory$"):
        train(str(tmp_path / "out"), calls, model=model, memory_snapshot_dir=str(tmp_path / "snapshots"))
    assert calls == ["begin 1", f"record max_entries={MAX_ENTRIES}", "stop"]
    assert not (tmp_path / "snapshots").exists()


def test_training_that_ends_before_the_last_step_dumps_what_it_recorded(tmp_path, monkeypatch):
    """Faked CUDA (see the module docstring)."""
    calls: List[str] = []
    fake_cuda(monkeypatch, calls)
    folder = tmp_path / "snapshots"
    with pytest.warns(RuntimeWarning, match=r"^trainer_memcb: training ended after step 2, before snapshot step 5; "
                      r"the memory snapshot holds the steps up to 2$"):
        train(str(tmp_path / "out"), calls, max_steps=2, memory_snapshot_dir=str(folder), snapshot_steps=[1, 5])
    assert normalized(calls) == ["begin 1", f"record max_entries={MAX_ENTRIES}", "end 1", "begin 2", "end 2",
                                 *dumped("memory_snapshot_step2.pickle"), "stop"]
    assert sorted(os.listdir(folder)) == ["memory_snapshot_step2.pickle"]


def test_a_link_at_the_destination_is_refused_and_training_goes_on(tmp_path, monkeypatch):
    """Faked CUDA (see the module docstring). The file's name is a symbolic link: not written
    through, one warning, recording stopped, all four steps trained."""
    calls: List[str] = []
    fake_cuda(monkeypatch, calls)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    os.symlink(str(tmp_path / "elsewhere"), str(folder / "memory_snapshot_step1.pickle"))
    with pytest.warns(RuntimeWarning, match=r"^trainer_memcb: writing the memory snapshot memory_snapshot_step1.pickle "
                      r"failed \(UnsafeFileError"):
        trainer = train(str(tmp_path / "out"), calls, memory_snapshot_dir=str(folder), snapshot_steps=(1,))
    assert trainer.state.global_step == 4
    assert calls == ["begin 1", f"record max_entries={MAX_ENTRIES}", "end 1", "stop", *steps(4)[2:]]
    assert not (tmp_path / "elsewhere").exists()
    assert sorted(os.listdir(folder)) == ["memory_snapshot_step1.pickle"]  # the link, no temporary file


def test_with_several_processes_each_name_carries_its_rank():
    assert snapshot_path("runs", "memory_snapshot_step2.pickle") == os.path.join("runs", "memory_snapshot_step2.pickle")
    assert snapshot_path("runs", "memory_snapshot_oom.pickle", rank=1, world_size=2) == \
        os.path.join("runs", "memory_snapshot_oom-rank1.pickle")


@pytest.mark.parametrize("kwargs, message", [
    (dict(memory_snapshot_dir=3), "memory_snapshot_dir=3: expected a folder (a non-empty str or os.PathLike) for "
     "the memory snapshots, or None for none"),
    (dict(memory_snapshot_dir=""), "memory_snapshot_dir='': expected a folder (a non-empty str or os.PathLike) for "
     "the memory snapshots, or None for none"),
    (dict(snapshot_steps=2), "snapshot_steps=2: expected optimizer steps, positive ints (a list or tuple, or one "
     "comma-separated string such as \"1,2\")"),
    (dict(snapshot_steps=()), "snapshot_steps=(): expected optimizer steps, positive ints (a list or tuple, or one "
     "comma-separated string such as \"1,2\")"),
    (dict(snapshot_steps=(0, 2)), "snapshot_steps=0 is not a step: expected positive ints (the first optimizer "
     "step is 1)"),
    (dict(snapshot_steps=(1, True)), "snapshot_steps=True is not a step: expected positive ints (the first "
     "optimizer step is 1)"),
    (dict(snapshot_steps="1,two"), "snapshot_steps='two' is not a step: expected positive ints (the first "
     "optimizer step is 1)"),
])
def test_bad_arguments_are_value_errors_naming_them(kwargs, message):
    with pytest.raises(ValueError) as caught:
        OptimizerMemoryCallback(**kwargs)
    assert str(caught.value) == message


def test_the_arguments_as_kept():
    callback = OptimizerMemoryCallback(memory_snapshot_dir=pathlib.Path("runs"), snapshot_steps="2, 1,2")
    assert (callback.memory_snapshot_dir, callback.snapshot_steps) == ("runs", (1, 2))
