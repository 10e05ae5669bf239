"""A compiled model trains and evaluates with the callback exactly as without it: the same losses,
and every forward, training and evaluation alike, runs the compiled graph.

How "runs compiled" is told: the model is compiled with a backend of the test's own that hands
dynamo's graph back to run as it is (what the "eager" backend does) and counts each time a compiled
graph runs. A forward that dynamo skipped runs eagerly and is not counted. Before the fix the
evaluation's first forward ran under the callback's dispatch-mode counter; dynamo skips a frame it
meets under one, and keeps that skip for the frame's code, so every forward after the first
evaluation ran uncompiled: 2 compiled forwards in 9 (the two training steps before it).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from transformers import Trainer

from helpers import TinyDataset, VOCAB_SIZE, entries_with, training_args
from test_callback_logging import train_recording_warnings
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.activations_probe import ACTIVATIONS_SUPPORTED, COMPILED_MESSAGE
from trainer_memcb.training.evaluation_probe import COMPILED_FORWARD_MESSAGE, COMPILING_FORWARD_MESSAGE
from trainer_memcb.utils.compiled import dispatch_modes_stop_compiling

BACKEND_NAME = "trainer_memcb_counting"
# 6 optimizer steps of one batch, an evaluation of one batch every 2 steps: 9 forwards.
STEPS, EVAL_EVERY = 6, 2
FORWARDS = STEPS + STEPS // EVAL_EVERY
# Our warnings for a compiled model: the activations' (on a torch that measures them, 2.8 and
# newer), then the evaluation forward's.
COMPILED_WARNINGS = ([f"trainer_memcb: {COMPILED_MESSAGE}"] if ACTIVATIONS_SUPPORTED else []) \
    + [f"trainer_memcb: {COMPILED_FORWARD_MESSAGE}"]


class CountingBackend:
    """A dynamo backend that runs the captured graph as it is and counts its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            self.runs += 1
            return graph.forward(*args)

        return run


COUNTING = CountingBackend()
torch._dynamo.register_backend(COUNTING, name=BACKEND_NAME)


class Head(torch.nn.Module):
    """ReLU then linear: a module of the test's own (dynamo inlines torch.nn's own classes rather
    than compiling them on their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(hidden))


class TinyClassifier(torch.nn.Module):
    """Embedding, mean over the tokens, the head: a forward dynamo captures in one graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(VOCAB_SIZE, 8)
        self.head = Head()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Dict[str, torch.Tensor]:
        logits = self.head(self.embedding(input_ids).mean(1))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def compiled_model(how: str) -> torch.nn.Module:
    model = TinyClassifier()
    if how == "torch.compile(model)":
        return torch.compile(model, backend=BACKEND_NAME)
    if how == "model.compile()":
        model.compile(backend=BACKEND_NAME)
    return model  # "torch_compile=True": the Trainer compiles it


def run(tmp_path: Any, how: str, callbacks: List[Any], monkeypatch: pytest.MonkeyPatch,
        build: Callable[[str], torch.nn.Module] = compiled_model) -> Tuple[Trainer, int, List[str]]:
    """Train and evaluate a fresh compiled model; the trainer, the compiled forwards, our warnings."""
    torch._dynamo.reset()
    COUNTING.runs = 0
    overrides: Dict[str, Any] = {}
    if how == "torch_compile=True":
        # TrainingArguments(torch_compile=True) writes accelerate's settings into the environment:
        # set through monkeypatch first, so that they are gone after the test.
        # accelerate takes only the backends it names: "eager", whose compiler is the counting one here.
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "0")
        monkeypatch.setitem(torch._dynamo.backends.registry._COMPILER_FNS, "eager", COUNTING)
        overrides = dict(torch_compile=True, torch_compile_backend="eager")
    args = training_args(str(tmp_path), max_steps=STEPS, eval_strategy="steps", eval_steps=EVAL_EVERY,
                         remove_unused_columns=False, label_names=["labels"], **overrides)
    trainer = Trainer(model=build(how), args=args, train_dataset=TinyDataset(),
                      eval_dataset=TinyDataset(8, seed=1), callbacks=callbacks)
    found_warnings = train_recording_warnings(trainer)
    return trainer, COUNTING.runs, found_warnings


def losses(trainer: Trainer, key: str) -> List[float]:
    return [entry[key] for entry in entries_with(trainer.state.log_history, key)]


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()", "torch_compile=True"])
def test_a_compiled_model_runs_compiled_throughout_with_the_callback(tmp_path, monkeypatch, how):
    without, compiled_without, _ = run(tmp_path / "without", how, [], monkeypatch)
    # Every forward ran the compiled graph; with `torch_compile`, transformers 5 evaluates
    # `trainer.model`, which it did not compile (`_wrap_model`), so there the training steps did.
    assert compiled_without == FORWARDS or (how == "torch_compile=True" and compiled_without >= STEPS)
    trainer, compiled_with, found_warnings = run(tmp_path / "with", how, [OptimizerMemoryCallback(what_if=())],
                                                 monkeypatch)
    assert compiled_with == compiled_without
    assert losses(trainer, "loss") == losses(without, "loss") and len(losses(trainer, "loss")) == STEPS
    assert losses(trainer, "eval_loss") == losses(without, "eval_loss") and len(losses(trainer, "eval_loss")) == 3
    assert found_warnings == COMPILED_WARNINGS
    # The rest is measured: the optimizer's state, and what each evaluation loop held (its 8 losses).
    assert [entry["optimizer_state_bytes"] for entry in entries_with(trainer.state.log_history, "loss")] == [4252] * STEPS
    evaluations = entries_with(trainer.state.log_history, "eval_loss")
    assert [(entry["eval_containers_device_bytes"], entry["eval_containers_host_bytes"]) for entry in evaluations] \
        == [(32, 32)] * 3
    assert not any("eval_forward_peak_bytes" in entry or "activations_bytes" in entry
                   for entry in trainer.state.log_history)


def test_a_model_holding_a_compiled_module_keeps_it_compiled_and_is_not_measured(tmp_path, monkeypatch):
    """`model.head.compile()`: the model is not compiled as a whole, a module inside it is. The
    counter's hooks and dispatch mode would be traced into (or make dynamo skip) that module."""
    def partly_compiled(how: str) -> torch.nn.Module:
        model = TinyClassifier()
        model.head.compile(backend=BACKEND_NAME)
        return model

    without, compiled_without, _ = run(tmp_path / "without", "part", [], monkeypatch, partly_compiled)
    trainer, compiled_with, found_warnings = run(tmp_path / "with", "part", [OptimizerMemoryCallback(what_if=())],
                                                 monkeypatch, partly_compiled)
    assert compiled_with == compiled_without == FORWARDS
    assert losses(trainer, "loss") == losses(without, "loss")
    assert found_warnings == COMPILED_WARNINGS


def scaled_relu(hidden: torch.Tensor) -> torch.Tensor:
    return torch.relu(hidden) * 2.0


def test_a_compiled_function_inside_the_forward_stays_compiled_and_the_forward_is_measured(tmp_path, monkeypatch):
    """A `torch.compile`d function that the forward calls: no module shows it, so the evaluation's
    forward is measured, under a counter that lets dynamo compile what it meets."""
    activation = torch.compile(scaled_relu, backend=BACKEND_NAME)

    class CallsACompiledFunction(TinyClassifier):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Dict[str, torch.Tensor]:
            logits = self.head.linear(activation(self.embedding(input_ids).mean(1)))
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    def build(how: str) -> torch.nn.Module:
        return CallsACompiledFunction()

    without, compiled_without, _ = run(tmp_path / "without", "function", [], monkeypatch, build)
    trainer, compiled_with, found_warnings = run(tmp_path / "with", "function",
                                                 [OptimizerMemoryCallback(what_if=(), eval_keys="all")], monkeypatch, build)
    assert compiled_with == compiled_without == FORWARDS  # before: the evaluations' compiled runs were skipped
    assert losses(trainer, "loss") == losses(without, "loss")
    evaluations = entries_with(trainer.state.log_history, "eval_loss")
    if dispatch_modes_stop_compiling():  # torch 2.6: the forward is left out, with one warning
        assert found_warnings == [f"trainer_memcb: {COMPILING_FORWARD_MESSAGE}"]
        assert not any("eval_forward_peak_bytes" in entry for entry in evaluations) and len(evaluations) == 3
    else:
        assert found_warnings == []
        assert [entry["eval_forward_peak_bytes"] > 0 for entry in evaluations] == [True] * 3
