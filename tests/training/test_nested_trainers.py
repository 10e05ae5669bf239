"""A Trainer run inside another's step or evaluation: each keeps its own figures.

The outer Trainer's `compute_loss` trains a second Trainer on a logged step, before or after the
outer forward, on the same model or another, with one callback serving both or one each; a
callback of the outer Trainer evaluates a second Trainer while the outer evaluation's containers
hold its batches. The outer figures must be those of the same run without the nested one (the
tiny DistilBERT, batch 4: 40,836 bytes saved for backward), and the nested run's its own.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
from transformers import Trainer, TrainerCallback

from helpers import TinyDataset, accuracy_and_f1, entries_with, tiny_classifier, training_args
from test_activations import assert_nothing_left, measures
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.figures import ACTIVATIONS_BYTES, ACTIVATIONS_PEAK_BYTES

# The tiny DistilBERT's forward on a batch of 4 (`test_activations` counts it independently).
SAVED_BYTES = 40836
ACTIVATIONS = {ACTIVATIONS_BYTES: SAVED_BYTES, ACTIVATIONS_PEAK_BYTES: SAVED_BYTES}


def activations(trainer: Trainer) -> List[Dict[str, int]]:
    return [{key: entry.get(key) for key in (ACTIVATIONS_BYTES, ACTIVATIONS_PEAK_BYTES)}
            for entry in entries_with(trainer.state.log_history, "loss")]


class NestingTrainer(Trainer):
    """Trains `nested` inside each training step's `compute_loss`, before or after its own forward."""

    nested: Optional[Trainer] = None
    when = "before"

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.when == "before":
            self.nested.train()
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.when == "after":  # the outer step's saved tensors are alive: its backward is still to come
            self.nested.train()
        return loss


@measures
@pytest.mark.parametrize("model_kind, when, shared, nested_logging", [
    ("same", "before", True, 1),
    ("same", "after", True, 1),
    ("same", "after", False, 2),  # the nested run's unlogged steps too
    ("other", "after", True, 1),
])
def test_a_trainer_trained_inside_a_logged_step_leaves_the_outer_figures_alone(tmp_path, model_kind, when, shared,
                                                                              nested_logging):
    model = tiny_classifier()
    callback = OptimizerMemoryCallback(what_if=())
    nested_model = model if model_kind == "same" else tiny_classifier(seed=1)
    nested = Trainer(model=nested_model, args=training_args(str(tmp_path / "nested"), max_steps=2,
                                                            logging_steps=nested_logging),
                     train_dataset=TinyDataset(seed=1),
                     callbacks=[callback if shared else OptimizerMemoryCallback(what_if=())])
    outer = NestingTrainer(model=model, args=training_args(str(tmp_path / "outer"), max_steps=2),
                           train_dataset=TinyDataset(), callbacks=[callback])
    outer.nested, outer.when = nested, when
    outer.train()
    assert outer.state.global_step == 2 and nested.state.global_step == 2
    assert activations(outer) == [ACTIVATIONS, ACTIVATIONS]  # before the fix: None (the keys left out)
    assert activations(nested) == [ACTIVATIONS] * (2 // nested_logging)
    assert_nothing_left(model)
    assert_nothing_left(nested_model)


class EvaluateDuringPrediction(TrainerCallback):
    """Evaluates `nested` once, after the outer evaluation's first batch (its containers hold it)."""

    def __init__(self, nested: Trainer) -> None:
        self.nested = nested
        self.done = 0

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.done:
            self.done += 1
            self.nested.evaluate()


CONTAINER_KEYS = ("eval_containers_device_bytes", "eval_containers_host_bytes", "eval_concat_peak_bytes",
                  "eval_host_concat_peak_bytes", "eval_forward_peak_bytes")


def evaluation_figures(trainer: Trainer) -> List[Dict[str, Any]]:
    return [{key: entry.get(key) for key in CONTAINER_KEYS} for entry in entries_with(trainer.state.log_history,
                                                                                      "eval_runtime")]


def evaluating(tmp_path: Any, name: str, callbacks: List[Any], seed: int = 0) -> Trainer:
    """A Trainer that evaluates 16 samples in batches of 8 with metrics (losses, logits and labels held)."""
    return Trainer(model=tiny_classifier(seed), args=training_args(str(tmp_path / name), max_steps=1),
                   eval_dataset=TinyDataset(seed=seed), compute_metrics=accuracy_and_f1, callbacks=callbacks)


@measures
@pytest.mark.parametrize("shared", [True, False], ids=["one-callback", "a-callback-each"])
def test_an_evaluation_run_inside_another_leaves_the_outer_figures_alone(tmp_path, shared):
    keys = dict(eval_keys="all")
    alone = evaluating(tmp_path, "alone", [OptimizerMemoryCallback(what_if=(), **keys)])
    alone.evaluate()
    expected = evaluation_figures(alone)
    # 16 losses (64 bytes), logits 16 x 2 fp32 (128), labels 16 int64 (128)
    assert expected[0]["eval_containers_device_bytes"] == 320 and expected[0]["eval_forward_peak_bytes"] > 0

    callback = OptimizerMemoryCallback(what_if=(), **keys)
    nested = evaluating(tmp_path, "nested", [callback if shared else OptimizerMemoryCallback(what_if=(), **keys)],
                        seed=1)
    nesting = EvaluateDuringPrediction(nested)
    outer = evaluating(tmp_path, "outer", [callback, nesting])
    outer.evaluate()
    assert nesting.done == 1
    assert evaluation_figures(outer) == expected  # before the fix: dropped (one callback), or the nested added
    nested_alone = evaluating(tmp_path, "nested-alone", [OptimizerMemoryCallback(what_if=(), **keys)], seed=1)
    nested_alone.evaluate()
    assert evaluation_figures(nested) == evaluation_figures(nested_alone)
    assert "forward" not in outer.model.__dict__ and "forward" not in nested.model.__dict__


@measures
def test_a_nested_evaluation_that_raises_leaves_the_outer_measured_and_nothing_installed(tmp_path):
    callback = OptimizerMemoryCallback(what_if=(), eval_keys="all")
    alone = evaluating(tmp_path, "alone", [OptimizerMemoryCallback(what_if=(), eval_keys="all")])
    alone.evaluate()

    class Failing(Exception):
        pass

    class RaisingNested(EvaluateDuringPrediction):
        def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.done:
                self.done += 1
                try:
                    self.nested.evaluate()
                except Failing:
                    pass

    class FailingMetrics:
        def __call__(self, prediction: Any) -> Dict[str, float]:
            raise Failing("metrics failed on purpose")

    nested = evaluating(tmp_path, "nested", [callback], seed=1)
    nested.compute_metrics = FailingMetrics()
    outer = evaluating(tmp_path, "outer", [callback, RaisingNested(nested)])
    outer.evaluate()
    assert evaluation_figures(outer) == evaluation_figures(alone)
    from transformers.trainer_pt_utils import EvalLoopContainer
    assert not hasattr(EvalLoopContainer.add, "__wrapped__")  # the container wrappers are gone
    assert "forward" not in outer.model.__dict__ and "forward" not in nested.model.__dict__
    assert callback._evaluations.loops == []
