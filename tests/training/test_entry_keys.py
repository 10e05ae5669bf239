"""Which keys each log entry carries: by default every figure in training entries and only the
measured/estimate pair in evaluation entries; `eval_keys=` and `train_keys=` choose otherwise. The
notebook's table is read from transformers' own `NotebookProgressCallback` tracker, driven by a
real Trainer on the tiny model."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import pytest
from transformers import PrinterCallback, Trainer

from helpers import TinyDataset, entries_with, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.activations_probe import ACTIVATION_KEYS, ACTIVATIONS_SUPPORTED
from trainer_memcb.training.figures import key_names

pytest.importorskip("IPython", reason="transformers' notebook progress display needs IPython")
from transformers.utils.notebook import NotebookProgressCallback  # noqa: E402

# Everything a one-process AdamW run logs (no ZeRO, no reference model, no breakdown).
ONE_PROCESS_KEYS = {
    "optimizer_state_bytes", "optimizer_state_estimate_bytes", "optimizer_state_elements",
    "optimizer_trainable_params", "optimizer_state_unexpected_bytes", "model_params_bytes", "model_grads_bytes",
    "model_states_bytes", "model_states_estimate_bytes",
}
# Training entries carry the activations too, where this torch measures them (the device's peaks on CUDA only).
TRAINING_KEYS = ONE_PROCESS_KEYS | (set(ACTIVATION_KEYS) - {"device_peak_allocated_bytes", "device_peak_reserved_bytes"}
                                    if ACTIVATIONS_SUPPORTED else set())
OURS = set(key_names())
# Evaluation entries carry evaluation's own memory beside the model states.
EVALUATION_ENTRY_KEYS = ONE_PROCESS_KEYS | {"containers_device_bytes", "containers_host_bytes", "concat_peak_bytes",
                                            "host_concat_peak_bytes", "forward_peak_bytes"}


def accuracy(eval_prediction: Any) -> Dict[str, float]:
    predictions = np.argmax(eval_prediction.predictions, axis=-1)
    return {"accuracy": float((predictions == eval_prediction.label_ids).mean())}


class KeptTracker(NotebookProgressCallback):
    """transformers' notebook progress callback, unchanged, but it keeps its training tracker
    after training (it drops it in `on_train_end`), so that its table can be read."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.kept = self.training_tracker


def run(output_dir: str, notebook: bool = False, callback: bool = True, **callback_kwargs: Any) -> SimpleNamespace:
    callbacks: List[Any] = []
    if callback:
        callbacks.append(OptimizerMemoryCallback(what_if=(), **callback_kwargs))
    tracker = KeptTracker() if notebook else None
    if tracker is not None:
        callbacks.append(tracker)
    trainer = Trainer(
        model=tiny_classifier(), args=training_args(output_dir, eval_strategy="steps", eval_steps=2),
        train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1), compute_metrics=accuracy,
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    history = trainer.state.log_history
    return SimpleNamespace(trainer=trainer, tracker=tracker,
                           train=entries_with(history, "loss"), eval=entries_with(history, "eval_loss"))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return run(str(tmp_path_factory.mktemp("default")), notebook=True)


def ours(entry: Dict[str, Any], prefix: str = "") -> set:
    return {key[len(prefix):] for key in entry if key.startswith(prefix) and key[len(prefix):] in OURS}


def test_by_default_training_entries_carry_every_figure(default_run):
    assert [entry["step"] for entry in default_run.train] == [1, 2, 3, 4]
    for entry in default_run.train:
        assert ours(entry) == TRAINING_KEYS


def test_by_default_evaluation_entries_carry_the_measured_and_estimate_pair_and_the_containers(default_run):
    assert [entry["step"] for entry in default_run.eval] == [2, 4]
    for entry in default_run.eval:
        assert ours(entry, "eval_") == {"optimizer_state_bytes", "optimizer_state_estimate_bytes",
                                        "containers_device_bytes", "containers_host_bytes"}
        assert entry["eval_optimizer_state_bytes"] == default_run.train[0]["optimizer_state_bytes"] == 2 * (
            entry["eval_optimizer_state_estimate_bytes"] // 2)


def test_the_notebook_table_shows_the_metrics_and_four_memory_columns(default_run, tmp_path):
    table = default_run.tracker.kept.inner_table
    assert table[0] == ["Step", "Training Loss", "Validation Loss", "Accuracy", "Containers Device Bytes",
                        "Containers Host Bytes", "Optimizer State Bytes", "Optimizer State Estimate Bytes"]
    assert [row[0] for row in table[1:]] == [2, 4]
    measured = default_run.train[0]["optimizer_state_bytes"]
    for row, entry in zip(table[1:], default_run.eval):
        assert row[4:] == [entry["eval_containers_device_bytes"], entry["eval_containers_host_bytes"], measured, measured]


def test_without_the_callback_the_notebook_table_is_step_losses_and_accuracy(tmp_path):
    table = run(str(tmp_path), notebook=True, callback=False).tracker.kept.inner_table
    assert table[0] == ["Step", "Training Loss", "Validation Loss", "Accuracy"]


def test_eval_keys_all_puts_every_figure_in_evaluation_entries_too(tmp_path):
    result = run(str(tmp_path), eval_keys="all")
    for entry in result.eval:
        assert ours(entry, "eval_") == EVALUATION_ENTRY_KEYS


def test_a_list_of_keys_and_a_breakdown_by_its_first_part(tmp_path):
    result = run(str(tmp_path), breakdown="key", train_keys="short",
                 eval_keys=["model_states_bytes", "optimizer_state_bytes_by_key"])
    for entry in result.train:
        assert ours(entry) == {"optimizer_state_bytes", "optimizer_state_estimate_bytes"}
        assert not any("by_key" in key for key in entry)
    for entry in result.eval:
        assert ours(entry, "eval_") == {"model_states_bytes"}
        by_key = {key for key in entry if key.startswith("eval_optimizer_state_bytes_by_key/")}
        assert by_key == {"eval_optimizer_state_bytes_by_key/exp_avg", "eval_optimizer_state_bytes_by_key/exp_avg_sq",
                          "eval_optimizer_state_bytes_by_key/step"}


def test_no_keys_leaves_the_entries_as_the_trainer_made_them(tmp_path):
    result = run(str(tmp_path), eval_keys=None, train_keys=())
    assert not any(ours(entry) for entry in result.train)
    assert not any(ours(entry, "eval_") for entry in result.eval)
    with open(os.path.join(str(tmp_path), "optimizer_memory.json"), encoding="utf-8") as file:
        assert set(json.load(file)["final_figures"]) == TRAINING_KEYS  # the summary keeps every figure
