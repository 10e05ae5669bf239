"""`OptimizerMemoryLogger` in real Accelerate loops: figures returned, logged to TensorBoard, exact.

Each test runs a real `accelerate.Accelerator` on the CPU with the tiny DistilBERT from `helpers`
and a real optimizer, a few steps, then reads the TensorBoard event files back.
"""

from __future__ import annotations

import doctest
import json
import os
import warnings
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import get_constant_schedule

import trainer_memcb.training.accelerate_loop
from helpers import TinyDataset, tiny_classifier
from trainer_memcb import OptimizerMemoryLogger
from trainer_memcb.training.figures import ESTIMATE_BYTES, MEASURED_BYTES, MEASURED_ELEMENTS, TRAINABLE_PARAMS, UNEXPECTED_BYTES
from trainer_memcb.training.summary import SUMMARY_FILE_NAME

def in_one_process(expected: Dict[str, int]) -> Dict[str, int]:
    """`expected` as one process logs it: no `..._total_bytes` keys, which would only repeat it."""
    return dict(expected)


def tensorboard_scalars(log_dir: str) -> Dict[str, List[Tuple[int, float]]]:
    """Every scalar in the event files under `log_dir`, as `tag -> [(step, value), ...]`."""
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def trainer_memcb_warnings(caught: List[warnings.WarningMessage]) -> List[str]:
    return [str(warning.message) for warning in caught if str(warning.message).startswith("trainer_memcb:")]


# Accelerate keeps its state in process-wide singletons; each test makes its own Accelerator.
pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


def adamw_bytes(model: torch.nn.Module) -> Tuple[int, int, int]:
    """(parameters, state bytes, state values) for torch AdamW, from the model alone: exp_avg and
    exp_avg_sq in fp32 per value, plus a 0-dim fp32 `step` per tensor (torch/optim/adamw.py)."""
    params = [param for param in model.parameters() if param.requires_grad]
    num_params = sum(param.numel() for param in params)
    return num_params, 8 * num_params + 4 * len(params), 2 * num_params + len(params)


def loop(
    accelerator: Accelerator, model: Any, optimizer: Any, memory: OptimizerMemoryLogger, micro_batches: int
) -> List[Dict[str, int]]:
    """The lesson's loop over `micro_batches` batches of 4; what `memory()` returned each time."""
    loader = torch.utils.data.DataLoader(TinyDataset(size=4 * micro_batches), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    returned = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            returned.append(memory())
            optimizer.zero_grad()
    return returned


def test_figures_reach_tensorboard_exact_on_logging_steps_only(tmp_path):
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = tiny_classifier()
    num_params, state_bytes, state_values = adamw_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = OptimizerMemoryLogger(optimizer, accelerator, logging_steps=2)

    returned = loop(accelerator, model, optimizer, memory, micro_batches=5)
    accelerator.end_training()

    expected = in_one_process({MEASURED_BYTES: state_bytes, MEASURED_ELEMENTS: state_values,
                               ESTIMATE_BYTES: state_bytes, TRAINABLE_PARAMS: num_params,
                               UNEXPECTED_BYTES: 0})  # every parameter has state: measured - estimate
    assert (num_params, state_bytes) == (3_714, 29_808)  # 8 x 3,714 + 4 x 24 tensors
    assert returned == [{}, expected, {}, expected, {}]
    assert memory.optimizer_steps == 5

    scalars = tensorboard_scalars(str(tmp_path / "run"))
    # TensorBoard stores float32; these integers are below 2**24, so they round-trip exactly.
    assert all(int(np.float32(value)) == value for value in expected.values())
    assert scalars == {key: [(2, float(value)), (4, float(value))] for key, value in expected.items()}


def test_gradient_accumulation_counts_optimizer_steps_not_micro_batches(tmp_path):
    accelerator = Accelerator(
        cpu=True, log_with="tensorboard", project_dir=str(tmp_path), gradient_accumulation_steps=2
    )
    accelerator.init_trackers("run")
    model = tiny_classifier()
    _, state_bytes, _ = adamw_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = OptimizerMemoryLogger(optimizer, accelerator)

    returned = loop(accelerator, model, optimizer, memory, micro_batches=8)
    accelerator.end_training()

    # Every second micro-batch steps the optimizer; only those calls measure and log.
    assert [bool(figures) for figures in returned] == [False, True] * 4
    assert memory.optimizer_steps == 4
    assert {int(state["step"]) for state in optimizer.state.values()} == {4}
    logged = tensorboard_scalars(str(tmp_path / "run"))[MEASURED_BYTES]
    assert logged == [(step, float(state_bytes)) for step in (1, 2, 3, 4)]


def test_a_step_counted_by_the_loop_is_the_logged_step(tmp_path):
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = OptimizerMemoryLogger(optimizer, accelerator, logging_steps=10)
    dataset = TinyDataset(size=4)
    model(input_ids=dataset.input_ids, labels=dataset.labels).loss.backward()
    optimizer.step()
    assert memory(step=7) == {}  # not a multiple of 10
    assert memory(step=30)[MEASURED_BYTES] == adamw_bytes(model)[1]
    accelerator.end_training()
    assert [step for step, _ in tensorboard_scalars(str(tmp_path / "run"))[MEASURED_BYTES]] == [30]


def test_breakdown_and_summary_use_the_callbacks_keys_and_file(tmp_path):
    model = tiny_classifier()
    num_params, state_bytes, _ = adamw_bytes(model)
    num_tensors = len(list(model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = OptimizerMemoryLogger(optimizer, breakdown=("key", "dtype"))  # no accelerator: figures only
    # No call yet, so no optimizer step counted: the summary claims no measurement.
    assert memory.summary().startswith("Optimizer state: measured not measured, estimate ")

    dataset = TinyDataset(size=4)
    model(input_ids=dataset.input_ids, labels=dataset.labels).loss.backward()
    optimizer.step()
    logged = memory()
    assert {key: value for key, value in logged.items() if "/" in key} == {
        f"{MEASURED_BYTES}_by_key/exp_avg": 4 * num_params,
        f"{MEASURED_BYTES}_by_key/exp_avg_sq": 4 * num_params,
        f"{MEASURED_BYTES}_by_key/step": 4 * num_tensors,
        f"{MEASURED_BYTES}_by_dtype/float32": state_bytes,
    }

    path = memory.save_summary(str(tmp_path))
    assert path == str(tmp_path / SUMMARY_FILE_NAME)
    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    assert (document["measured"]["num_bytes"], document["estimate"]["num_bytes"]) == (state_bytes, state_bytes)
    assert (document["global_step"], document["optimizer_class"]) == (1, "AdamW")
    assert document["peak_measured_bytes"] == state_bytes
    assert document["measured_minus_estimate_bytes"] == 0
    assert "exp_avg_sq" in memory.summary()


def test_the_last_step_is_logged_and_add_to_puts_figures_beside_eval_metrics(tmp_path):
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = tiny_classifier()
    num_params, state_bytes, state_values = adamw_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = OptimizerMemoryLogger(optimizer, accelerator, logging_steps=5, max_steps=3)
    before = memory.add_to({"eval_accuracy": 0.25}, prefix="eval")  # before any step: estimate only
    assert before == {"eval_accuracy": 0.25, f"eval_{ESTIMATE_BYTES}": state_bytes, f"eval_{TRAINABLE_PARAMS}": num_params}

    returned = loop(accelerator, model, optimizer, memory, micro_batches=3)
    metrics = {"eval_accuracy": 0.75}
    assert memory.add_to(metrics, prefix="eval") is metrics
    accelerator.log(metrics, step=3)
    accelerator.end_training()

    figures = {MEASURED_BYTES: state_bytes, MEASURED_ELEMENTS: state_values, ESTIMATE_BYTES: state_bytes,
               TRAINABLE_PARAMS: num_params}
    assert returned[:2] == [{}, {}]  # 3 is no multiple of 5, but it is the last step
    assert {key: value for key, value in returned[2].items() if key in figures} == figures
    assert {key: value for key, value in metrics.items() if key[len("eval_"):] in figures} == {
        f"eval_{key}": value for key, value in figures.items()}
    scalars = tensorboard_scalars(str(tmp_path / "run"))
    assert scalars[MEASURED_BYTES] == [(3, float(state_bytes))]
    assert scalars[f"eval_{MEASURED_BYTES}"] == [(3, float(state_bytes))]
    assert scalars["eval_accuracy"] == [(3, 0.75)]


@pytest.mark.parametrize("call, message", [
    (lambda memory: memory.add_to(None), "entry=None: expected the dict your loop logs"),
    (lambda memory: memory.add_to({}, prefix=1), "prefix=1: expected a string"),
])
def test_add_to_bad_arguments_raise_value_errors_naming_them(call, message):
    memory = OptimizerMemoryLogger(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(ValueError) as error:
        call(memory)
    assert message in str(error.value)


class MomentumOnly(torch.optim.Optimizer):
    """A real optimizer no estimate rule knows: plain momentum, one buffer per parameter."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                buffer = self.state[param].setdefault("momentum", torch.zeros_like(param))
                buffer.mul_(0.9).add_(param.grad)
                param.add_(buffer, alpha=-group["lr"])


class FailingTracker(GeneralTracker):
    """A tracker whose storage is gone: every `log` raises, as a full disk would."""

    name = "failing"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @property
    def tracker(self) -> None:
        return None

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        pass

    def log(self, values: Dict[str, Any], step: Any = None, **kwargs: Any) -> None:
        self.calls += 1
        raise OSError("No space left on device")


def test_no_rule_and_a_failing_tracker_warn_once_and_training_goes_on():
    tracker = FailingTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("run")
    model = tiny_classifier()
    num_params = sum(param.numel() for param in model.parameters())
    optimizer = MomentumOnly(model.parameters())
    memory = OptimizerMemoryLogger(optimizer, accelerator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = loop(accelerator, model, optimizer, memory, micro_batches=3)
    # Measured without an estimate: the estimate keys are left out, never faked.
    assert returned == [in_one_process({MEASURED_BYTES: 4 * num_params, MEASURED_ELEMENTS: num_params})] * 3
    assert tracker.calls == 3
    messages = trainer_memcb_warnings(caught)
    assert len(messages) == 2
    assert "no estimate rule for optimizer class MomentumOnly" in messages[0]
    assert "accelerator.log failed" in messages[1] and "No space left on device" in messages[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logging_steps": 0}, "logging_steps=0: expected a whole number of at least 1"),
        ({"logging_steps": 2.5}, "logging_steps=2.5: expected a whole number of at least 1"),
        ({"breakdown": ("shape",)}, "breakdown='shape' is not one of ['device', 'dtype', 'key']"),
        ({"accelerator": "tensorboard"}, "accelerator='tensorboard': expected an accelerate.Accelerator"),
        ({"max_steps": 0}, "max_steps=0: expected a whole number of at least 1, or None"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(kwargs, message):
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError) as error:
        OptimizerMemoryLogger(optimizer, **kwargs)
    assert message in str(error.value)


def test_docstring_example_runs():
    results = doctest.testmod(trainer_memcb.training.accelerate_loop, optionflags=doctest.ELLIPSIS)
    assert (results.failed, results.attempted) == (0, 12)


def test_the_guide_loop_runs_as_written_and_logs_exact_bytes(tmp_path, monkeypatch):
    """The loop of docs/custom-loops.md on this file's own tiny model, its TensorBoard entry read
    back (tests/test_docs.py runs the page as a whole)."""
    guide = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "docs", "custom-loops.md")
    with open(guide, encoding="utf-8") as handle:
        blocks = handle.read().split("```python\n")[1:]
    [snippet] = [code for code in (block.split("```", 1)[0] for block in blocks)
                 if "OptimizerMemoryLogger(optimizer, accelerator" in code]
    monkeypatch.chdir(tmp_path)  # the snippet writes under output/my_run
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    namespace = {
        "model": model,
        "optimizer": optimizer,
        "train_dataloader": torch.utils.data.DataLoader(TinyDataset(size=40), batch_size=4),  # 10 steps
        "lr_scheduler": get_constant_schedule(optimizer),
    }
    exec(compile(snippet, guide, "exec"), namespace)

    state_bytes = adamw_bytes(model)[1]
    assert namespace["memory"].optimizer_steps == 10
    logged = tensorboard_scalars(str(tmp_path / "output" / "my_run"))[MEASURED_BYTES]
    assert logged == [(10, float(state_bytes))]
    with open(tmp_path / "output" / "my_run" / SUMMARY_FILE_NAME, encoding="utf-8") as handle:
        assert json.load(handle)["measured"]["num_bytes"] == state_bytes
