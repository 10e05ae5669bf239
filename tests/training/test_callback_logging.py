"""Where `OptimizerMemoryCallback`'s figures land: log_history, checkpoints, TensorBoard, the summary.

Every test drives a real `Trainer` on the tiny DistilBERT from `helpers` (CPU, a few steps) with
real optimizers, and asserts exact bytes. The runs are shared per module: a Trainer run is the
slow part, and several facts can be read from one run.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import warnings
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from accelerate.optimizer import AcceleratedOptimizer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer, get_constant_schedule

from helpers import TinyDataset, accuracy_and_f1, entries_with, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback, estimate_optimizer_state, measure_optimizer_state
from trainer_memcb.training.callback import log_entry_prefix
from trainer_memcb.training.figures import (
    BREAKDOWN_KEY_PREFIXES,
    ESTIMATE_BYTES,
    KEY_DESCRIPTIONS,
    MEASURED_BYTES,
    MEASURED_ELEMENTS,
    TRAINABLE_PARAMS,
)
from trainer_memcb.utils.units import KiB

FIGURE_KEYS = (MEASURED_BYTES, MEASURED_ELEMENTS, ESTIMATE_BYTES, TRAINABLE_PARAMS)


# -- what the tiny model's AdamW state must hold, worked out from the model alone -------------------


def adamw_figures(model: torch.nn.Module) -> Dict[str, int]:
    """AdamW keeps exp_avg and exp_avg_sq in each trainable tensor's dtype, plus a 0-dim fp32 `step`
    tensor per tensor (torch/optim/adamw.py). `model.parameters()` yields a tied tensor once."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    num_params = sum(param.numel() for param in trainable)
    moment_bytes = sum(param.numel() * param.element_size() for param in trainable)
    return {
        MEASURED_BYTES: 2 * moment_bytes + 4 * len(trainable),
        MEASURED_ELEMENTS: 2 * num_params + len(trainable),
        ESTIMATE_BYTES: 2 * moment_bytes + 4 * len(trainable),
        TRAINABLE_PARAMS: num_params,
    }


def figures_in(entry: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """The four figures of a log entry, by unprefixed key; missing ones left out."""
    return {key: entry[f"{prefix}{key}"] for key in FIGURE_KEYS if f"{prefix}{key}" in entry}


def trainer_memcb_warnings(caught: List[warnings.WarningMessage]) -> List[str]:
    return [
        str(warning.message)
        for warning in caught
        if issubclass(warning.category, RuntimeWarning) and str(warning.message).startswith("trainer_memcb:")
    ]


def train_recording_warnings(trainer: Trainer, **train_kwargs: Any) -> List[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(**train_kwargs)
    return trainer_memcb_warnings(caught)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- the runs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """4 steps, logged, evaluated and saved every 2, TensorBoard on, every breakdown; then a `test`
    evaluation. The summary the callback logs at the end is captured from its logger."""
    output_dir = str(tmp_path_factory.mktemp("tensorboard_run"))
    model = tiny_classifier()
    trainer = Trainer(
        model=model,
        args=training_args(
            output_dir, report_to=["tensorboard"], logging_steps=2, eval_strategy="steps", eval_steps=2,
            save_strategy="steps", save_steps=2,
        ),
        train_dataset=TinyDataset(16),
        eval_dataset=TinyDataset(8, seed=1),
        compute_metrics=accuracy_and_f1,
        # Every key in evaluation entries too (the default keeps two there: test_entry_keys.py).
        callbacks=[OptimizerMemoryCallback(breakdown=("key", "dtype", "device"), eval_keys="all")],
    )
    callback_logger = logging.getLogger("trainer_memcb.training.callback")
    records, previous_level = _Records(), callback_logger.level
    callback_logger.addHandler(records)
    callback_logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
            test_metrics = trainer.evaluate(metric_key_prefix="test")
    finally:
        callback_logger.removeHandler(records)
        callback_logger.setLevel(previous_level)
    return SimpleNamespace(
        trainer=trainer, output_dir=output_dir, test_metrics=test_metrics, expected=adamw_figures(model),
        log_messages=records.messages, warnings=trainer_memcb_warnings(caught),
    )


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """2 epochs of 2 steps, logged and evaluated per epoch, and evaluated before the first step."""
    model = tiny_classifier()
    trainer = Trainer(
        model=model,
        args=training_args(
            str(tmp_path_factory.mktemp("epoch_run")), max_steps=-1, num_train_epochs=2,
            logging_strategy="epoch", eval_strategy="epoch", eval_on_start=True,
        ),
        train_dataset=TinyDataset(8),
        eval_dataset=TinyDataset(8, seed=1),
        compute_metrics=accuracy_and_f1,
        callbacks=[OptimizerMemoryCallback(eval_keys="all")],
    )
    found_warnings = train_recording_warnings(trainer)
    return SimpleNamespace(trainer=trainer, expected=adamw_figures(model), warnings=found_warnings)


@pytest.fixture(scope="module")
def accumulating_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """2 optimizer steps of 2 accumulated batches each, with the user's own AdamW and scheduler."""
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(
        model=model,
        args=training_args(str(tmp_path_factory.mktemp("accumulating_run")), max_steps=2, gradient_accumulation_steps=2),
        train_dataset=TinyDataset(16),
        optimizers=(optimizer, get_constant_schedule(optimizer)),
        callbacks=[OptimizerMemoryCallback()],
    )
    found_warnings = train_recording_warnings(trainer)
    return SimpleNamespace(trainer=trainer, optimizer=optimizer, expected=adamw_figures(model), warnings=found_warnings)


# -- log_history, with evaluation, by steps and by epoch -----------------------------------------


def test_tiny_model_adamw_figures_are_these_exact_numbers(tensorboard_run):
    # 3714 trainable values in 24 tensors: 2 x 3714 x 4 bytes of moments + 24 x 4 bytes of `step`.
    assert tensorboard_run.expected == {
        MEASURED_BYTES: 29808, MEASURED_ELEMENTS: 7452, ESTIMATE_BYTES: 29808, TRAINABLE_PARAMS: 3714,
    }
    measured = measure_optimizer_state(tensorboard_run.trainer.optimizer)
    estimate = estimate_optimizer_state(tensorboard_run.trainer.optimizer)
    assert (measured.num_bytes, measured.num_elements) == (29808, 7452)
    assert (estimate.num_bytes, estimate.num_params) == (29808, 3714)
    assert tensorboard_run.warnings == []


def test_logging_by_steps_puts_the_figures_in_every_training_entry(tensorboard_run):
    training = entries_with(tensorboard_run.trainer.state.log_history, "loss")
    assert [entry["step"] for entry in training] == [2, 4]  # max_steps=4 / logging_steps=2
    for entry in training:
        assert figures_in(entry) == tensorboard_run.expected


def test_evaluation_by_steps_logs_the_figures_beside_accuracy_and_f1(tensorboard_run):
    evaluations = entries_with(tensorboard_run.trainer.state.log_history, "eval_runtime")
    assert [entry["step"] for entry in evaluations] == [2, 4]
    for entry in evaluations:
        assert {"eval_accuracy", "eval_f1", "eval_loss"} <= entry.keys()
        assert figures_in(entry, "eval_") == tensorboard_run.expected
    # The entry that closes training (train_runtime, ...) is a summary, not a step: no figures.
    closing = entries_with(tensorboard_run.trainer.state.log_history, "train_runtime")
    assert len(closing) == 1 and figures_in(closing[0]) == {}


def test_evaluate_with_another_prefix_returns_and_logs_prefixed_figures(tensorboard_run):
    expected = tensorboard_run.expected
    assert tensorboard_run.test_metrics["test_optimizer_state_bytes"] == expected[MEASURED_BYTES]
    assert tensorboard_run.test_metrics["test_optimizer_state_estimate_bytes"] == expected[ESTIMATE_BYTES]
    (logged,) = entries_with(tensorboard_run.trainer.state.log_history, "test_runtime")
    assert figures_in(logged, "test_") == expected
    assert "test_accuracy" in logged and not any(key.startswith("eval_optimizer") for key in logged)


def test_breakdown_keys_are_exact_and_sum_to_the_total(tensorboard_run):
    num_params = tensorboard_run.expected[TRAINABLE_PARAMS]
    total = tensorboard_run.expected[MEASURED_BYTES]
    by_part = {
        "optimizer_state_bytes_by_key/exp_avg": 4 * num_params,
        "optimizer_state_bytes_by_key/exp_avg_sq": 4 * num_params,
        "optimizer_state_bytes_by_key/step": 4 * 24,
        "optimizer_state_bytes_by_dtype/float32": total,
        "optimizer_state_bytes_by_device/cpu": total,
    }
    history = tensorboard_run.trainer.state.log_history
    for entry, prefix in [(e, "") for e in entries_with(history, "loss")] + [
        (e, "eval_") for e in entries_with(history, "eval_runtime")
    ]:
        logged = {key: value for key, value in entry.items() if key.startswith(f"{prefix}optimizer_state_bytes_by_")}
        assert logged == {f"{prefix}{key}": value for key, value in by_part.items()}
        by_key = [value for key, value in logged.items() if "_by_key/" in key]
        assert sum(by_key) == entry[f"{prefix}optimizer_state_bytes"]


def test_logging_and_evaluating_by_epoch(epoch_run):
    history = epoch_run.trainer.state.log_history
    training = entries_with(history, "loss")
    # 8 samples / batch 4 = 2 steps an epoch, 2 epochs: one training entry per epoch.
    assert [(entry["step"], entry["epoch"]) for entry in training] == [(2, 1.0), (4, 2.0)]
    for entry in training:
        assert figures_in(entry) == epoch_run.expected
    evaluations = [entry for entry in entries_with(history, "eval_runtime") if entry["step"] > 0]
    assert [entry["step"] for entry in evaluations] == [2, 4]
    for entry in evaluations:
        assert "eval_accuracy" in entry and figures_in(entry, "eval_") == epoch_run.expected
    assert epoch_run.warnings == []


def test_evaluation_before_the_first_step_claims_no_measurement(epoch_run):
    (on_start,) = [entry for entry in entries_with(epoch_run.trainer.state.log_history, "eval_runtime")
                   if entry["step"] == 0]
    # The optimizer exists (its estimate is known) but its state is still empty.
    assert figures_in(on_start, "eval_") == {
        ESTIMATE_BYTES: epoch_run.expected[ESTIMATE_BYTES],
        TRAINABLE_PARAMS: epoch_run.expected[TRAINABLE_PARAMS],
    }
    assert "eval_accuracy" in on_start


def test_gradient_accumulation_logs_once_per_optimizer_step(accumulating_run):
    training = entries_with(accumulating_run.trainer.state.log_history, "loss")
    assert [entry["step"] for entry in training] == [1, 2]
    for entry in training:
        assert figures_in(entry) == accumulating_run.expected
    assert accumulating_run.warnings == []


def test_the_closing_train_runtime_entry_gets_no_figures_under_any_prefix(accumulating_run):
    # The entry `train()` closes with (train_runtime, train_loss, ...) is a summary, not a step: it
    # takes neither the figures nor `train_`-prefixed ones, though its keys end in `_runtime`.
    (closing,) = entries_with(accumulating_run.trainer.state.log_history, "train_runtime")
    figure_keys = set(KEY_DESCRIPTIONS) | set(BREAKDOWN_KEY_PREFIXES.values())
    assert [key for key in closing if any(figure in key for figure in figure_keys)] == []
    assert log_entry_prefix(dict(closing)) is None
    # The control: the training entries of the same run do hold them, unprefixed.
    assert all(figures_in(entry) == accumulating_run.expected
               for entry in entries_with(accumulating_run.trainer.state.log_history, "loss"))


# -- which optimizer -------------------------------------------------------------------------------


def test_the_trainers_own_optimizer_is_measured_through_its_accelerate_wrapper(tensorboard_run):
    optimizer = tensorboard_run.trainer.optimizer
    assert isinstance(optimizer, AcceleratedOptimizer) and type(optimizer.optimizer) is torch.optim.AdamW
    assert measure_optimizer_state(optimizer.optimizer).num_bytes == tensorboard_run.expected[MEASURED_BYTES]


def test_a_user_passed_optimizer_and_scheduler_are_measured(accumulating_run):
    wrapped = accumulating_run.trainer.optimizer
    assert isinstance(wrapped, AcceleratedOptimizer) and wrapped.optimizer is accumulating_run.optimizer
    last = entries_with(accumulating_run.trainer.state.log_history, "loss")[-1]
    assert last[MEASURED_BYTES] == measure_optimizer_state(accumulating_run.optimizer).num_bytes == 29808


# -- TensorBoard, checkpoints, resuming ----------------------------------------------------------


def test_tensorboard_event_files_hold_the_figures_beside_loss_accuracy_and_f1(tensorboard_run):
    (log_dir,) = glob.glob(os.path.join(tensorboard_run.output_dir, "runs", "*"))
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/accuracy", "eval/f1", "test/accuracy"} <= tags

    expected = tensorboard_run.expected
    # TensorBoard stores float32; these integers are far below 2**24, so they round-trip exactly.
    assert all(int(np.float32(value)) == value for value in expected.values())
    for tag, steps, value in [
        ("train/optimizer_state_bytes", [2, 4], expected[MEASURED_BYTES]),
        ("train/optimizer_state_estimate_bytes", [2, 4], expected[ESTIMATE_BYTES]),
        ("train/optimizer_state_bytes_by_key/exp_avg", [2, 4], 4 * expected[TRAINABLE_PARAMS]),
        ("eval/optimizer_state_bytes", [2, 4], expected[MEASURED_BYTES]),
        ("eval/optimizer_state_estimate_bytes", [2, 4], expected[ESTIMATE_BYTES]),
        ("test/optimizer_state_bytes", [4], expected[MEASURED_BYTES]),
        ("test/optimizer_state_estimate_bytes", [4], expected[ESTIMATE_BYTES]),
    ]:
        scalars = events.Scalars(tag)
        assert [(event.step, event.value) for event in scalars] == [(step, float(value)) for step in steps], tag
    # The eval figure is written at the same step as the eval accuracy it sits beside.
    assert [event.step for event in events.Scalars("eval/accuracy")] == [2, 4]


def test_checkpoint_trainer_state_holds_the_figures(tensorboard_run):
    for step in (2, 4):
        path = os.path.join(tensorboard_run.output_dir, f"checkpoint-{step}", "trainer_state.json")
        with open(path, encoding="utf-8") as handle:
            history = json.load(handle)["log_history"]
        training = entries_with(history, "loss")
        evaluations = entries_with(history, "eval_runtime")
        assert [entry["step"] for entry in training] == [entry["step"] for entry in evaluations] == list(range(2, step + 1, 2))
        for entry in training:
            assert figures_in(entry) == tensorboard_run.expected
        for entry in evaluations:
            assert figures_in(entry, "eval_") == tensorboard_run.expected


def test_resuming_from_a_checkpoint_logs_the_same_figures(tensorboard_run, tmp_path):
    checkpoint = os.path.join(tensorboard_run.output_dir, "checkpoint-2")
    trainer = Trainer(
        model=tiny_classifier(seed=1),
        args=training_args(str(tmp_path), logging_steps=2),
        train_dataset=TinyDataset(16),
        callbacks=[OptimizerMemoryCallback()],
    )
    found_warnings = train_recording_warnings(trainer, resume_from_checkpoint=checkpoint)
    training = entries_with(trainer.state.log_history, "loss")
    # Step 2 comes from the checkpoint's trainer_state.json; step 4 is logged by the resumed run.
    assert [entry["step"] for entry in training] == [2, 4]
    for entry in training:
        assert figures_in(entry) == tensorboard_run.expected
    assert measure_optimizer_state(trainer.optimizer).num_bytes == tensorboard_run.expected[MEASURED_BYTES]
    assert found_warnings == []


# -- the end-of-training summary -----------------------------------------------------------------


def test_summary_file_holds_the_exact_bytes(tensorboard_run):
    with open(os.path.join(tensorboard_run.output_dir, "optimizer_memory.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    expected = tensorboard_run.expected
    assert summary["optimizer_class"] == "AdamW"
    assert summary["global_step"] == 4
    assert summary["measured"]["num_bytes"] == summary["estimate"]["num_bytes"] == expected[MEASURED_BYTES]
    assert summary["measured_minus_estimate_bytes"] == 0
    assert summary["peak_measured_bytes"] == expected[MEASURED_BYTES]
    assert summary["measured"]["bytes_by_key"] == summary["estimate"]["bytes_by_key"] == {
        "exp_avg": 4 * expected[TRAINABLE_PARAMS], "exp_avg_sq": 4 * expected[TRAINABLE_PARAMS], "step": 4 * 24,
    }


def test_summary_text_uses_binary_units(tensorboard_run):
    (summary,) = [message for message in tensorboard_run.log_messages if message.startswith("Optimizer state:")]
    lines = summary.splitlines()
    total_kib = f"{29808 / KiB:.1f} KiB"  # 29.1 KiB
    assert lines[0] == f"Optimizer state: measured {total_kib}, estimate {total_kib}"
    assert lines[1] == "  29,808 bytes in 7,452 values over 24 parameter tensors"
    assert lines[2] == "  estimate: 29,808 bytes for 3,714 trainable parameters"
    exp_avg_kib = f"{4 * 3714 / KiB:.1f} KiB"  # 14.5 KiB
    assert f"  {'exp_avg':<24} {exp_avg_kib:>14} {exp_avg_kib:>14}" in lines
    assert f"  {'step':<24} {'96 B':>14} {'96 B':>14}" in lines
    assert not any(unit in summary for unit in (" KB", " MB", " GB"))


# -- a Trainer whose log() skips Trainer.log -----------------------------------------------------


class ReimplementedLogTrainer(Trainer):
    """Overrides `log` without calling `super().log`: the hook on `Trainer.log` never runs."""

    def log(self, logs: Dict[str, float], start_time: Any = None) -> None:
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)


def test_a_log_override_that_skips_trainer_log_still_gets_the_figures(tmp_path):
    model = tiny_classifier()
    trainer = ReimplementedLogTrainer(
        model=model, args=training_args(str(tmp_path), max_steps=2), train_dataset=TinyDataset(16),
        callbacks=[OptimizerMemoryCallback()],
    )
    found_warnings = train_recording_warnings(trainer)
    training = entries_with(trainer.state.log_history, "loss")
    assert [entry["step"] for entry in training] == [1, 2]
    for entry in training:
        assert figures_in(entry) == adamw_figures(model)
    assert len(found_warnings) == 1
    assert "does not call transformers.Trainer.log" in found_warnings[0]
