"""Planned against real in the run: the step plan of the run's own settings, made once at the first
logged step and logged as `step_plan_peak_bytes` (read back from TensorBoard's event files), and,
on CUDA, `device_peak_reserved_bytes` beside `device_peak_allocated_bytes`. Real Trainers on the
tiny DistilBERT on the CPU."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, List

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import DistilBertForSequenceClassification, Trainer

import trainer_memcb.training.step_plan_probe as step_plan_probe
from helpers import TinyDataset, entries_with, tiny_classifier, training_args
from test_callback_logging import train_recording_warnings
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.training.activations_probe import ACTIVATIONS_SUPPORTED, ActivationsProbe
from trainer_memcb.training.tensorboard_view import layout_charts, trainer_tag
from trainer_memcb.training.figures import (
    DEVICE_PEAK_ALLOCATED_BYTES,
    DEVICE_PEAK_RESERVED_BYTES,
    STEP_PLAN_PEAK_BYTES,
    STEP_PLAN_RESERVED_BYTES,
)


def direct_peak(model: torch.nn.Module, optim: str) -> int:
    """`plan_step_memory`'s peak for the run's settings given as plain arguments: batch 4 x 8,
    the arguments' optimizer, fp32, one process, on the CPU."""
    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return DistilBertForSequenceClassification(model.config)

    return plan_step_memory(build, batch_size=4, seq_len=8, optimizer=optim, device_type="cpu")[0].step.peak_bytes


class Counted:
    """Counts the calls of a real function, and calls it."""

    def __init__(self, function: Any) -> None:
        self.function, self.calls = function, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch) -> Any:
    plans = Counted(step_plan_probe.plan_for_trainer)
    watches = Counted(step_plan_probe._BatchShapes.watch)
    monkeypatch.setattr(step_plan_probe, "plan_for_trainer", plans)
    monkeypatch.setattr(step_plan_probe._BatchShapes, "watch", lambda self, module: watches(self, module))
    return plans, watches


def scalars(output_dir: str, tag: str) -> List[Any]:
    (log_dir,) = glob.glob(os.path.join(output_dir, "runs", "*"))
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_plan_step_true_logs_the_plans_peak_from_the_first_logged_step_planned_once(tmp_path, counted):
    plans, watches = counted
    model = tiny_classifier()
    args = training_args(str(tmp_path), report_to=["tensorboard"], logging_steps=2, eval_strategy="steps",
                         eval_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1),
                      callbacks=[OptimizerMemoryCallback(plan_step=True, what_if=(), eval_keys="all")])
    assert train_recording_warnings(trainer) == []
    expected = direct_peak(model, args.optim.value)
    training = entries_with(trainer.state.log_history, "loss")
    assert [(entry["step"], entry.get(STEP_PLAN_PEAK_BYTES)) for entry in training] == [(2, expected), (4, expected)]
    # No figure of the allocator's replay yet: the key is left out, never faked.
    assert not any(STEP_PLAN_RESERVED_BYTES in entry for entry in trainer.state.log_history)
    # Training entries only: an evaluation's entry (every key kept) does not carry it.
    evaluations = entries_with(trainer.state.log_history, "eval_runtime")
    assert len(evaluations) == 2 and not any(f"eval_{STEP_PLAN_PEAK_BYTES}" in entry for entry in evaluations)
    # Planned once, from the one batch hook of the first logged step (step 1 is not logged).
    assert (plans.calls, watches.calls) == (1, 1)
    assert scalars(str(tmp_path), f"train/{STEP_PLAN_PEAK_BYTES}") == [(2, float(expected)), (4, float(expected))]
    assert not any(module._forward_pre_hooks for module in model.modules())
    with open(tmp_path / "optimizer_memory.json", encoding="utf-8") as handle:
        assert json.load(handle)["final_figures"][STEP_PLAN_PEAK_BYTES] == expected  # the summary has it too


def test_the_custom_scalars_chart_the_plans_peak_beside_the_devices_peaks():
    logged = {"": [STEP_PLAN_PEAK_BYTES, DEVICE_PEAK_ALLOCATED_BYTES, DEVICE_PEAK_RESERVED_BYTES, "activations_bytes"]}
    assert layout_charts(logged, trainer_tag)["Optimizer memory"]["the step's peak, planned and on the device (bytes)"] \
        == ["Multiline", ["^train/step_plan_peak_bytes$", "^train/device_peak_allocated_bytes$",
                          "^train/device_peak_reserved_bytes$"]]
    # On the CPU with plan_step=True: the plan alone, still charted.
    assert list(layout_charts({"": [STEP_PLAN_PEAK_BYTES]}, trainer_tag)["Optimizer memory"]) == [
        "the step's peak, planned and on the device (bytes)"]


def test_by_default_a_cpu_run_is_not_planned_and_nothing_is_installed(tmp_path, counted):
    plans, watches = counted
    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path)), train_dataset=TinyDataset(),
                      callbacks=[OptimizerMemoryCallback(what_if=())])
    assert train_recording_warnings(trainer) == []
    assert not any(STEP_PLAN_PEAK_BYTES in entry for entry in trainer.state.log_history)
    assert (plans.calls, watches.calls) == (0, 0)


def test_plan_step_false_plans_nothing_even_when_asked_on_every_step(tmp_path, counted):
    plans, watches = counted
    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path)), train_dataset=TinyDataset(),
                      callbacks=[OptimizerMemoryCallback(what_if=(), plan_step=False, activations=False)])
    trainer.train()
    assert (plans.calls, watches.calls) == (0, 0)


@pytest.mark.parametrize("value", ["yes", "CUDA", 1, None])
def test_a_bad_plan_step_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match=rf"^plan_step={value!r}: expected 'cuda' .*, True .* or False"):
        OptimizerMemoryCallback(plan_step=value)


def test_a_plan_that_fails_warns_once_and_leaves_the_key_out(tmp_path, monkeypatch):
    """A failure injected into the planning (the only thing patched): the run goes on."""
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no plan (on purpose)")

    monkeypatch.setattr(step_plan_probe, "plan_for_trainer", failing)
    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path)), train_dataset=TinyDataset(),
                      callbacks=[OptimizerMemoryCallback(what_if=(), plan_step=True)])
    assert train_recording_warnings(trainer) == [
        "trainer_memcb: planning the run's step failed (RuntimeError('no plan (on purpose)')); it is left out"]
    assert trainer.state.global_step == 4
    assert not any(STEP_PLAN_PEAK_BYTES in entry for entry in trainer.state.log_history)


@pytest.mark.skipif(not ACTIVATIONS_SUPPORTED, reason="the device peaks are read by the activations probe (torch 2.8+)")
def test_on_cuda_the_reserved_peak_is_logged_beside_the_allocated_peak(tmp_path, monkeypatch):
    """CUDA cannot run here. Patched: the probe is told, after arming, that the model's device is
    cuda:0 (its `_cuda_device`), and `torch.cuda.max_memory_allocated` / `max_memory_reserved`
    answer fixed figures for that device. The rest is a real run, read back from TensorBoard."""
    arm = ActivationsProbe._arm

    def arm_on_cuda(self: ActivationsProbe, *args: Any) -> None:
        arm(self, *args)
        self._cuda_device = torch.device("cuda", 0)

    read: List[Any] = []
    monkeypatch.setattr(ActivationsProbe, "_arm", arm_on_cuda)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: read.append(device) or 5_000_000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: read.append(device) or 6_291_456)
    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path), report_to=["tensorboard"],
                                                                  logging_steps=2),
                      train_dataset=TinyDataset(), callbacks=[OptimizerMemoryCallback(what_if=())])
    assert train_recording_warnings(trainer) == []
    training = entries_with(trainer.state.log_history, "loss")
    assert [(entry[DEVICE_PEAK_ALLOCATED_BYTES], entry[DEVICE_PEAK_RESERVED_BYTES]) for entry in training] == [
        (5_000_000, 6_291_456)] * 2
    assert read == [torch.device("cuda", 0)] * 4  # each read once per logged step, for the model's device
    assert scalars(str(tmp_path), f"train/{DEVICE_PEAK_RESERVED_BYTES}") == [(2, 6291456.0), (4, 6291456.0)]
    assert scalars(str(tmp_path), f"train/{DEVICE_PEAK_ALLOCATED_BYTES}") == [(2, 5000000.0), (4, 5000000.0)]


def test_a_compiled_model_is_planned_from_max_length_or_left_out_with_one_warning(tmp_path):
    """A compiled model gets no hook: the arguments' `max_length` (TRL's configs have one) gives
    the length, the batch is the arguments' own; without it the plan is left out, said once."""
    model = tiny_classifier()
    args = training_args(str(tmp_path))
    warned: List[str] = []
    probe = step_plan_probe.StepPlanProbe(True, lambda kind, message: warned.append(message))
    probe.start()
    probe.arm(model, args, compiled=True)
    probe.arm(model, args, compiled=True)
    assert probe.figures(model, args) == {} and warned == [step_plan_probe.COMPILED_MESSAGE]
    assert probe.left_out == "left out: " + step_plan_probe.COMPILED_MESSAGE
    args.max_length = 8
    probe.start()
    probe.arm(model, args, compiled=True)
    assert not model._forward_pre_hooks
    assert probe.figures(model, args) == {STEP_PLAN_PEAK_BYTES: direct_peak(model, args.optim.value)}


def test_only_the_main_process_plans(tmp_path):
    model = tiny_classifier()
    args = training_args(str(tmp_path))
    probe = step_plan_probe.StepPlanProbe(True)
    probe.start(main_process=False)
    probe.arm(model, args)
    assert not model._forward_pre_hooks and probe.figures(model, args) == {}
    assert probe.left_out == "made by the main process only"
