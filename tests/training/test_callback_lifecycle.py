"""`OptimizerMemoryCallback`'s life cycle: built (or refused), started twice, closed twice, shared by
two Trainers, and no trace on a Trainer that does not use it. Real Trainers on the tiny model."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import pytest
import torch
from transformers import Trainer

from helpers import TinyDataset, entries_with, tiny_classifier, training_args
from test_callback_logging import train_recording_warnings
from trainer_memcb import OptimizerMemoryCallback, measure_optimizer_state
from trainer_memcb.training.figures import MEASURED_BYTES
from trainer_memcb.training.trainer_log_hook import is_log_hook_installed

# -- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "breakdown, message",
    [
        (("shape",), "breakdown='shape' is not one of ['device', 'dtype', 'key']"),
        ("keys", "breakdown='keys' is not one of ['device', 'dtype', 'key']"),
        (("key", 3), "breakdown=3 is not one of ['device', 'dtype', 'key']"),
        (7, "breakdown=7: expected some of ['device', 'dtype', 'key']"),
    ],
)
def test_a_bad_breakdown_is_refused_naming_it_and_the_allowed_ones(breakdown, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimizerMemoryCallback(breakdown=breakdown)


@pytest.mark.parametrize("summary_file", ["", "logs/optimizer_memory.json", "..", ".", 3])
def test_a_bad_summary_file_is_refused_naming_it_and_the_allowed_ones(summary_file):
    expected = f"summary_file={summary_file!r}: expected a plain file name such as 'optimizer_memory.json', or None"
    with pytest.raises(ValueError, match=re.escape(expected)):
        OptimizerMemoryCallback(summary_file=summary_file)


def test_good_arguments_are_kept():
    assert OptimizerMemoryCallback(breakdown="key").breakdown == ("key",)
    assert OptimizerMemoryCallback(breakdown=["device", "dtype"]).breakdown == ("device", "dtype")
    assert OptimizerMemoryCallback(summary_file=None).summary_file is None
    assert OptimizerMemoryCallback(summary_file="memory.json").summary_file == "memory.json"


def test_the_log_hook_wraps_trainer_log_exactly_once():
    OptimizerMemoryCallback()
    wrapped = Trainer.log
    for _ in range(3):
        OptimizerMemoryCallback(breakdown=("key",))
    assert Trainer.log is wrapped and is_log_hook_installed()
    original = Trainer.log.__wrapped__
    assert not hasattr(original, "__wrapped__")
    assert original.__qualname__ == "Trainer.log" and original.__module__ == "transformers.trainer"


# -- started twice, shared by two Trainers -------------------------------------------------------


class UpdateHistorySGD(torch.optim.SGD):
    """Plain SGD that also keeps every gradient it applied, like LBFGS keeps its history: its state
    grows by one parameter-sized fp32 tensor per parameter per step."""

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param].setdefault("applied_gradients", []).append(param.grad.clone())
        return loss


def trainable_bytes(model: torch.nn.Module) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters() if param.requires_grad)


def read_summary(output_dir: str) -> dict:
    with open(os.path.join(output_dir, "optimizer_memory.json"), encoding="utf-8") as handle:
        return json.load(handle)


def test_one_callback_for_two_train_calls_then_for_a_second_trainer(tmp_path):
    callback = OptimizerMemoryCallback()
    first_dir, second_dir = str(tmp_path / "first"), str(tmp_path / "second")

    model = tiny_classifier()
    history_sgd = UpdateHistorySGD(model.parameters(), lr=0.1)
    first = Trainer(
        model=model, args=training_args(first_dir, max_steps=2, logging_steps=2), train_dataset=TinyDataset(16),
        optimizers=(history_sgd, None), callbacks=[callback],
    )
    per_step = trainable_bytes(model)  # 3714 fp32 values: 14856 bytes of gradient kept per step
    assert per_step == 14856

    # Both train() calls reuse the optimizer, whose history keeps growing: 2 steps, then 4.
    for call, steps_so_far in ((1, 2), (2, 4)):
        found = train_recording_warnings(first)
        if call == 1:  # the SGD rule knows no `applied_gradients`: said once, with its bytes
            assert len(found) == 1 and "state the rule does not know: +29,712 bytes" in found[0]
        else:
            assert found == []
        (entry,) = entries_with(first.state.log_history, "loss")
        assert entry["step"] == 2, call
        assert entry[MEASURED_BYTES] == steps_so_far * per_step, call
        assert read_summary(first_dir)["measured"]["num_bytes"] == steps_so_far * per_step, call
    assert measure_optimizer_state(history_sgd).num_bytes == 4 * per_step

    # The same callback on another Trainer follows that Trainer's optimizer, not the last one.
    second = Trainer(
        model=tiny_classifier(), args=training_args(second_dir, max_steps=2, logging_steps=2),
        train_dataset=TinyDataset(16), callbacks=[callback],
    )
    assert train_recording_warnings(second) == []
    (entry,) = entries_with(second.state.log_history, "loss")
    adamw_bytes = 2 * per_step + 4 * 24  # two fp32 moments, and a 4-byte `step` for each of 24 tensors
    assert entry[MEASURED_BYTES] == entry["optimizer_state_estimate_bytes"] == adamw_bytes
    summary = read_summary(second_dir)
    assert summary["optimizer_class"] == "AdamW"
    assert summary["measured"]["num_bytes"] == summary["peak_measured_bytes"] == adamw_bytes
    assert summary["measured_minus_estimate_bytes"] == 0


def test_a_trainer_without_the_callback_logs_no_optimizer_keys(tmp_path):
    OptimizerMemoryCallback()  # the hook on Trainer.log is installed in this process
    assert is_log_hook_installed()
    trainer = Trainer(
        model=tiny_classifier(), args=training_args(str(tmp_path), max_steps=2),
        train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1),
    )
    assert train_recording_warnings(trainer) == []
    metrics = trainer.evaluate()
    history = trainer.state.log_history
    assert len(entries_with(history, "loss")) == 2 and len(entries_with(history, "eval_loss")) == 1
    assert [key for entry in history for key in entry if "optimizer" in key] == []
    assert [key for key in metrics if "optimizer" in key] == []
    assert not os.path.exists(os.path.join(str(tmp_path), "optimizer_memory.json"))
