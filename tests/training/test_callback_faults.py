"""`OptimizerMemoryCallback` when something it reads is odd or broken: training always completes,
the figure that cannot be known is left out, and each kind of fault warns exactly once.

Real Trainers on the tiny model with real (small, custom) optimizers; nothing is mocked. Each run
logs 2 steps, so a fault that warned per step instead of once would show.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import torch
from transformers import Trainer

from helpers import TinyDataset, entries_with, tiny_classifier, training_args
from test_callback_logging import adamw_figures, figures_in, train_recording_warnings
from trainer_memcb import OptimizerMemoryCallback, measure_optimizer_state, register_estimate_rule
from trainer_memcb.training.figures import ESTIMATE_BYTES, MEASURED_BYTES, MEASURED_ELEMENTS, TRAINABLE_PARAMS

STEPS = 2


def train_to_the_end(model: torch.nn.Module, optimizer: torch.optim.Optimizer, output_dir: str) -> Dict[str, Any]:
    """Train `STEPS` logged steps with `optimizer`; the Trainer, the training entries, the warnings."""
    trainer = Trainer(
        model=model, args=training_args(output_dir, max_steps=STEPS), train_dataset=TinyDataset(16),
        optimizers=(optimizer, None), callbacks=[OptimizerMemoryCallback()],
    )
    found_warnings = train_recording_warnings(trainer)
    assert trainer.state.global_step == STEPS
    assert len(entries_with(trainer.state.log_history, "train_runtime")) == 1  # training completed
    training = entries_with(trainer.state.log_history, "loss")
    assert [entry["step"] for entry in training] == list(range(1, STEPS + 1))
    return {"trainer": trainer, "training": training, "warnings": found_warnings}


def trainable(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [param for param in model.parameters() if param.requires_grad]


# -- a state full of odd values, and no rule for the optimizer ------------------------------------


class OddStateSGD(torch.optim.Optimizer):
    """Plain SGD whose state holds what real optimizers keep beside tensors: None, strings, ints,
    a nested dict with a list of tensors, and a meta tensor (a shape planned, no memory)."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["kind"] = "odd"
                    state["not_yet"] = None
                    state["step"] = 0
                    state["nested"] = {
                        "buffers": [torch.zeros_like(param), torch.zeros(2, dtype=torch.float64)],
                        "label": "nested",
                        "sizes": (1, 2),
                    }
                    state["planned"] = torch.empty(param.shape, device="meta")
                state["step"] += 1
                param.add_(param.grad, alpha=-group["lr"])


def test_odd_state_values_are_measured_exactly_and_no_rule_warns_once(tmp_path):
    model = tiny_classifier()
    run = train_to_the_end(model, OddStateSGD(model.parameters()), str(tmp_path))
    params = trainable(model)
    # Per parameter: one zeros_like copy (fp32 here) and a 2-value float64 tensor; the rest holds
    # no tensor memory (the meta tensor included).
    expected = {
        MEASURED_BYTES: sum(param.numel() * param.element_size() + 2 * 8 for param in params),
        MEASURED_ELEMENTS: sum(param.numel() + 2 for param in params),
    }
    assert expected == {MEASURED_BYTES: 14856 + 24 * 16, MEASURED_ELEMENTS: 3714 + 24 * 2}
    for entry in run["training"]:
        assert figures_in(entry) == expected  # no estimate keys: no rule knows OddStateSGD
    measured = measure_optimizer_state(run["trainer"].optimizer)
    assert measured.bytes_by_key == {"nested": expected[MEASURED_BYTES]}
    assert measured.num_params_with_state == len(params)

    (warning,) = run["warnings"]
    assert warning.startswith("trainer_memcb: no estimate rule for optimizer class OddStateSGD")
    assert "register_estimate_rule" in warning


# -- a measurement that fails at run time ---------------------------------------------------------


class StorageLessBuffer(torch.Tensor):
    """A wrapper tensor subclass that keeps its data in `.inner` but does not implement
    `__tensor_flatten__`, so nothing says where its storage is: asking for it raises."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "StorageLessBuffer":
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"StorageLessBuffer does not support {func}")


class AdamWWithWrappedBuffer(torch.optim.AdamW):
    """AdamW that also keeps a buffer as a tensor subclass (an AdamW by class: AdamW's rule applies)."""

    def step(self, closure: Optional[Any] = None) -> Any:
        loss = super().step(closure)
        first = self.param_groups[0]["params"][0]
        self.state[first].setdefault("wrapped", StorageLessBuffer(torch.zeros(4)))
        return loss


def test_a_measurement_that_raises_leaves_the_measured_keys_out_and_warns_once(tmp_path):
    model = tiny_classifier()
    run = train_to_the_end(model, AdamWWithWrappedBuffer(model.parameters(), lr=1e-3), str(tmp_path))
    expected = adamw_figures(model)
    for entry in run["training"]:
        assert figures_in(entry) == {ESTIMATE_BYTES: expected[ESTIMATE_BYTES], TRAINABLE_PARAMS: expected[TRAINABLE_PARAMS]}
    (warning,) = run["warnings"]
    assert warning.startswith("trainer_memcb: measuring the optimizer state failed")
    assert "the figure is left out" in warning
    # The end-of-training summary still says what it knows, and leaves the rest out.
    with open(os.path.join(str(tmp_path), "optimizer_memory.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    assert summary["measured"] is None and summary["peak_measured_bytes"] is None
    assert summary["estimate"]["num_bytes"] == expected[ESTIMATE_BYTES]
    assert "measured_minus_estimate_bytes" not in summary


# -- an estimate rule that raises -----------------------------------------------------------------


class SGDWithBrokenRule(torch.optim.SGD):
    """SGD with momentum; its registered estimate rule reads a hyperparameter that is not there."""


def _rule_reading_a_missing_hyperparameter(param: Any, group: Any, optimizer: Any) -> Dict[str, int]:
    return {"momentum_buffer": param.num_bytes * group["momentum_dtype_bytes"]}


register_estimate_rule(SGDWithBrokenRule, _rule_reading_a_missing_hyperparameter)


def test_an_estimate_rule_that_raises_leaves_the_estimate_out_and_warns_once(tmp_path):
    model = tiny_classifier()
    run = train_to_the_end(model, SGDWithBrokenRule(model.parameters(), lr=0.01, momentum=0.9), str(tmp_path))
    params = trainable(model)
    # SGD with momentum: one momentum_buffer per parameter, in its dtype (torch/optim/sgd.py).
    momentum_bytes = sum(param.numel() * param.element_size() for param in params)
    for entry in run["training"]:
        assert figures_in(entry) == {MEASURED_BYTES: momentum_bytes, MEASURED_ELEMENTS: 3714}
    assert momentum_bytes == 14856
    (warning,) = run["warnings"]
    assert warning.startswith("trainer_memcb: estimating the optimizer state failed (KeyError('momentum_dtype_bytes'))")
