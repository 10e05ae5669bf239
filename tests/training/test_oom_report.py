"""An out-of-memory error inside a real training step: the report in `output_dir`, exact; the same
error object reaching the caller, nothing chained to it; nothing of ours left on the model. Real
Trainers on the tiny DistilBERT on the CPU, whose classifier raises `torch.OutOfMemoryError` from
inside the step's forward."""

from __future__ import annotations

import doctest
import os
from typing import Any, Dict, List

import pytest
import torch
from transformers import Trainer, TrainerCallback

import trainer_memcb.training.oom_report as oom_report
from helpers import TinyDataset, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.oom_report import OOM_REPORT_FILE_NAME, allocator_state, oom_report_path
from trainer_memcb.utils.units import format_bytes

# The report's head for the tiny model's run: its figures (those of transformers 5, in the comments)
# come from the step plan asked for directly, `plan_step_memory` with the same settings.
REPORT_HEAD = """Out of memory in Trainer.train after 1 optimizer step
error: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (on purpose)

The step plan for this run's settings (batch 4 x 8, {optim}, fp32, engine none, on cpu) peaks in {phase} at {peak}, holding:
  parameters: {parameters}
  gradients: {gradients}
  optimizer state: {optimizer_state}
  activations: {activations}
  batch and buffers: {batch_and_buffers}
  other: {other}

"""
# On transformers 5: 90220 bytes (88.1 KiB) in backward: parameters 14856 bytes (14.5 KiB), gradients
# 3464 bytes (3.4 KiB), optimizer state 29808 bytes (29.1 KiB), activations 33600 bytes (32.8 KiB),
# batch and buffers 288 bytes (288 B), other 8204 bytes (8.0 KiB).


def report_head(optim: str) -> str:
    """`REPORT_HEAD` with the figures of `plan_step_memory` for the run's settings, given directly."""
    from test_run_plan import direct_plan

    plan = direct_plan(tiny_classifier(), optim)
    figures = {part: f"{value} bytes ({format_bytes(value)})" for part, value in plan.step.peak_parts.items()}
    return REPORT_HEAD.format(optim=optim, phase=plan.step.peak_phase,
                              peak=f"{plan.step.peak_bytes} bytes ({format_bytes(plan.step.peak_bytes)})", **figures)
NO_CUDA = "The caching allocator: not read (no CUDA device: the model is not on one, and CUDA is not available)\n"
ALLOCATOR = """The caching allocator on cuda:0, when the error reached Trainer.train:
  reserved: 27262976 bytes (26.0 MiB)
  allocated: 19922944 bytes (19.0 MiB)
  reserved minus allocated: 7340032 bytes (7.0 MiB)
  segments: 2 (1 in the small pool, 1 in the large pool)
  largest free block: 5242880 bytes (5.0 MiB)
  inactive split blocks: 7340032 bytes (7.0 MiB)
"""
# A small-pool segment of 2 MiB and a large-pool one of 24 MiB on device 0, and one on device 1
# (left out): the largest inactive block on device 0 is 5 MiB.
MEMORY_STATS = {"reserved_bytes.all.current": 27_262_976, "allocated_bytes.all.current": 19_922_944,
                "segment.all.current": 2, "segment.small_pool.current": 1, "segment.large_pool.current": 1,
                "inactive_split_bytes.all.current": 7_340_032}
SNAPSHOT = [
    {"device": 0, "segment_type": "small", "total_size": 2_097_152, "blocks": [
        {"size": 1_048_576, "state": "active_allocated"}, {"size": 1_048_576, "state": "inactive"}]},
    {"device": 0, "segment_type": "large", "total_size": 25_165_824, "blocks": [
        {"size": 18_874_368, "state": "active_allocated"}, {"size": 5_242_880, "state": "inactive"},
        {"size": 1_048_576, "state": "active_awaiting_free"}]},
    {"device": 1, "segment_type": "large", "total_size": 20_971_520, "blocks": [
        {"size": 20_971_520, "state": "inactive"}]},
]


def out_of_memory_at_forward(model: torch.nn.Module, at: int) -> List[BaseException]:
    """Make the model's classifier raise `torch.OutOfMemoryError` in its `at`-th forward (the
    user's own hook, which stays): the error objects raised, for identity."""
    raised: List[BaseException] = []
    calls: List[int] = []

    def fail(module: Any, inputs: Any, output: Any) -> None:
        calls.append(1)
        if len(calls) == at:
            raised.append(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (on purpose)\n"
                                                  "the rest of torch's message"))
            raise raised[-1]

    model.classifier.register_forward_hook(fail)
    return raised


def report(output_dir: str) -> str:
    with open(os.path.join(output_dir, OOM_REPORT_FILE_NAME), encoding="utf-8") as handle:
        return handle.read()


def train_until_out_of_memory(output_dir: str, **callback_kwargs: Any) -> Dict[str, Any]:
    model = tiny_classifier()
    raised = out_of_memory_at_forward(model, at=2)  # step 2's forward: step 1 was logged, and planned
    hooks = {name: dict(module._forward_pre_hooks) for name, module in model.named_modules()}
    args = training_args(output_dir)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(),
                      callbacks=[OptimizerMemoryCallback(what_if=(), **callback_kwargs)])
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.train()
    return dict(model=model, trainer=trainer, raised=raised, caught=caught.value, hooks=hooks, optim=args.optim.value)


def assert_left_as_it_was(run: Dict[str, Any]) -> None:
    """The same error object, nothing chained to it; no wrapper or hook of ours on the model."""
    (raised,) = run["raised"]
    assert run["caught"] is raised
    assert (raised.__context__, raised.__cause__) == (None, None)
    assert run["trainer"].state.global_step == 1
    model = run["model"]
    assert "forward" not in model.__dict__
    assert {name: dict(module._forward_pre_hooks) for name, module in model.named_modules()} == run["hooks"]
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch 2.8 and newer
    assert top_hooks is None or top_hooks(False) is None


def test_an_out_of_memory_step_writes_the_plan_by_part_and_propagates_unchanged(tmp_path):
    run = train_until_out_of_memory(str(tmp_path), plan_step=True)
    assert report(str(tmp_path)) == report_head(run["optim"]) + NO_CUDA
    assert_left_as_it_was(run)


def test_the_allocators_state_is_in_the_report(tmp_path, monkeypatch):
    """CUDA cannot run here. Patched: `torch.cuda.is_available` (True), `current_device` (0),
    `memory_stats` and `memory_snapshot` (the figures above); they are read only now, in the failure
    path. Also `is_current_stream_capturing` (False), which the optimizer asks once CUDA is said to
    be there, and which a CUDA build of torch without a driver answers with an error. The model,
    the step and its error are real."""
    head = report_head(training_args(str(tmp_path)).optim.value)  # before CUDA is patched in
    read: List[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: read.append(f"stats {device}") or MEMORY_STATS)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kwargs: read.append("snapshot") or SNAPSHOT)
    run = train_until_out_of_memory(str(tmp_path), plan_step=True)
    assert report(str(tmp_path)) == head + ALLOCATOR
    assert read == ["stats cuda:0", "snapshot"]  # once, after the error
    assert_left_as_it_was(run)


def test_without_a_plan_the_report_says_why(tmp_path):
    run = train_until_out_of_memory(str(tmp_path))  # plan_step="cuda" on the CPU: not planned here
    text = report(str(tmp_path))
    assert text.splitlines()[3] == "The step plan for this run's settings: not made on this device (plan_step='cuda')"
    assert_left_as_it_was(run)


class OutOfMemoryAtStepBegin(TrainerCallback):
    """A callback after ours raising at step 1's beginning, once ours has put its batch hook on."""

    def __init__(self) -> None:
        self.raised: List[BaseException] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        assert len(model._forward_pre_hooks) == 1  # ours, waiting for the step's batch
        self.raised.append(torch.OutOfMemoryError("CUDA out of memory (on purpose)"))
        raise self.raised[-1]


def test_the_batch_hook_is_gone_when_the_step_fails_before_its_forward(tmp_path):
    model = tiny_classifier()
    failing = OutOfMemoryAtStepBegin()
    trainer = Trainer(model=model, args=training_args(str(tmp_path)), train_dataset=TinyDataset(),
                      callbacks=[OptimizerMemoryCallback(what_if=(), plan_step=True), failing])
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.train()
    assert caught.value is failing.raised[0] and caught.value.__context__ is None
    assert not model._forward_pre_hooks and "forward" not in model.__dict__
    assert report(str(tmp_path)).splitlines()[:4] == [
        "Out of memory in Trainer.train after 0 optimizer steps", "error: OutOfMemoryError: CUDA out of memory (on purpose)",
        "", "The step plan for this run's settings: not made yet (it is made at the first logged step, from that "
        "step's batch)"]


def test_another_error_writes_no_report(tmp_path):
    model = tiny_classifier()

    def fail(*args: Any) -> None:
        raise RuntimeError("not memory")

    model.classifier.register_forward_hook(fail)
    trainer = Trainer(model=model, args=training_args(str(tmp_path)), train_dataset=TinyDataset(),
                      callbacks=[OptimizerMemoryCallback(what_if=(), plan_step=True)])
    with pytest.raises(RuntimeError, match="^not memory$"):
        trainer.train()
    assert not os.path.exists(os.path.join(str(tmp_path), OOM_REPORT_FILE_NAME))


def test_a_report_that_cannot_be_written_warns_once_and_the_error_still_propagates(tmp_path):
    """The report's path is a symbolic link: refused, one warning, the run's own error unchanged."""
    os.symlink(str(tmp_path / "elsewhere.txt"), str(tmp_path / OOM_REPORT_FILE_NAME))
    with pytest.warns(RuntimeWarning, match="^trainer_memcb: writing the out-of-memory report failed"):
        run = train_until_out_of_memory(str(tmp_path), plan_step=True)
    assert not os.path.exists(tmp_path / "elsewhere.txt")
    assert_left_as_it_was(run)


def test_each_process_writes_its_own_report():
    assert oom_report_path("out") == os.path.join("out", "out_of_memory_report.txt")
    assert oom_report_path("out", rank=3, world_size=4) == os.path.join("out", "out_of_memory_report-rank3.txt")


def test_the_allocator_state_reads_one_devices_segments(monkeypatch):
    """Patched, as above: `memory_stats` and `memory_snapshot`."""
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: MEMORY_STATS)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kwargs: SNAPSHOT)
    assert allocator_state(torch.device("cuda", 1))["largest_free_block_bytes"] == 20_971_520
    assert allocator_state(torch.device("cuda", 0)) == {
        "reserved_bytes": 27_262_976, "allocated_bytes": 19_922_944, "reserved_minus_allocated_bytes": 7_340_032,
        "segments": 2, "small_pool_segments": 1, "large_pool_segments": 1, "largest_free_block_bytes": 5_242_880,
        "inactive_split_bytes": 7_340_032}


def test_docstring_examples_run():
    results = doctest.testmod(oom_report, optionflags=doctest.ELLIPSIS)
    assert (results.failed, results.attempted) == (0, 1)


class OutOfMemoryInBackward(torch.autograd.Function):
    """The identity, whose backward raises `torch.OutOfMemoryError`, as a CUDA backward can."""

    raised: List[BaseException] = []

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        OutOfMemoryInBackward.raised.append(torch.OutOfMemoryError("CUDA out of memory in backward (on purpose)"))
        raise OutOfMemoryInBackward.raised[-1]


class BackwardOutOfMemoryTrainer(Trainer):
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        return OutOfMemoryInBackward.apply(super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs))


def test_the_first_steps_out_of_memory_in_backward_is_planned_then(tmp_path):
    """The first logged step runs out of memory in its backward, before its entry: its batch was
    seen in its forward, so the plan is made in the failure path, and the report has it."""
    OutOfMemoryInBackward.raised.clear()
    model = tiny_classifier()
    args = training_args(str(tmp_path))
    trainer = BackwardOutOfMemoryTrainer(model=model, args=args, train_dataset=TinyDataset(),
                                         callbacks=[OptimizerMemoryCallback(what_if=(), plan_step=True)])
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.train()
    assert caught.value is OutOfMemoryInBackward.raised[0] and caught.value.__context__ is None
    head = report_head(args.optim.value).replace("after 1 optimizer step", "after 0 optimizer steps")
    head = head.replace(". Tried to allocate 2.00 GiB (on purpose)", " in backward (on purpose)")
    assert report(str(tmp_path)) == head + NO_CUDA
    assert not model._forward_pre_hooks and "forward" not in model.__dict__
