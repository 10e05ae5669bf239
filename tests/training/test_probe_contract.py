"""Every wrapper and hook the library installs, put through every way out of a step.

What the library installs while training: the activations probe's wrapper of `model.forward`,
the saved-tensors hooks it pushes around each measured forward, its watch of checkpoint's
recomputation (`torch.utils.checkpoint._recomputation_hook`, wrapped while a counter lives), the
loop logger's step pre-hooks on the optimizer, and, under ZeRO-1/2, a wrapper of DeepSpeed's `step`
(`tests/training/test_model_states.py` holds that tap's own removal; here a real ZeRO-2 Trainer's
`train()` raises, in a process of its own). The hooks on
the `Trainer` class (`log`, `train`) stay for the process by design: they change nothing for a
Trainer without our callback.

Each failure happens on a logged step (the probe is armed) of a real Trainer on the tiny DistilBERT
with activation checkpointing: a forward that raises, a backward that raises (as an out-of-memory
error does), an optimizer step that raises, and `train()` raising elsewhere in the step (a callback
of the user's). Afterwards the model and the optimizer must be exactly as before (the same
`forward` object, the same module hooks, no saved-tensors hooks, checkpoint's hook the original),
and a new Trainer with a new callback on the same model and optimizer must measure the same bytes
as on a fresh model. Nothing is mocked.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.utils.checkpoint
from transformers import Trainer, TrainerCallback

import trainer_memcb.training.activations_probe as activations_probe
from helpers import TinyDataset, entries_with, requires_torch, tiny_classifier, training_args
from test_callback_logging import train_recording_warnings
from trainer_memcb import OptimizerMemoryCallback, OptimizerMemoryLogger
from trainer_memcb.training.figures import ACTIVATIONS_BYTES, ACTIVATIONS_PEAK_BYTES
from trainer_memcb.training.trainer_train_hook import is_train_hook_installed

measures = requires_torch("2.8", "torch._C._autograd._top_saved_tensors_default_hooks, to see saved-tensor hooks "
                          "of the user's own; on an older torch the activations are left out")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORIGINAL_RECOMPUTATION_HOOK = torch.utils.checkpoint._recomputation_hook
FAIL_AT = 2  # a logged step (logging_steps=1), after a first step that logs its figures
MISSING = object()


class Failure(RuntimeError):
    """The user's own error, raised on purpose."""


class RaisingBackward(torch.autograd.Function):
    """The identity, whose backward raises: what an out-of-memory error in backward looks like."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Failure("out of memory in backward (on purpose)")


class FailingStepAdamW(torch.optim.AdamW):
    """AdamW whose `fail_at`-th step raises (once)."""

    def __init__(self, params: Any, fail_at: int = 0) -> None:
        super().__init__(params, lr=1e-3)
        self.fail_at, self.steps = fail_at, 0

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        if self.steps == self.fail_at:
            raise Failure("optimizer step failed (on purpose)")
        return super().step(closure)


class BackwardFailingTrainer(Trainer):
    """A Trainer whose loss raises in backward at optimizer step `fail_at`."""

    fail_at = 0

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if self.state.global_step + 1 == self.fail_at:
            return RaisingBackward.apply(loss)
        return loss


class RaiseAtStepBegin(TrainerCallback):
    """A user's callback that raises at the beginning of step `fail_at`, after ours armed the probe."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.fail_at:
            raise Failure("a callback failed (on purpose)")


def hooks_of(model: torch.nn.Module) -> Dict[str, Tuple[int, ...]]:
    """Every module's hooks, by kind (their ids): what the model had, to compare with afterwards."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    return {f"{name}.{kind}": tuple(getattr(module, kind, {})) for name, module in model.named_modules() for kind in kinds}


def optimizer_hooks(optimizer: torch.optim.Optimizer) -> Tuple[Any, ...]:
    return (vars(optimizer).get("step", MISSING), dict(optimizer._optimizer_step_pre_hooks),
            dict(optimizer._optimizer_step_post_hooks))


class Snapshot:
    """What the user's model and optimizer hold of anyone's wrappers and hooks (the optimizer's
    left unchecked when it is None)."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.forward = model.__dict__.get("forward", MISSING)
        self.hooks = hooks_of(model)
        self.optimizer = optimizer_hooks(optimizer) if optimizer is not None else None

    def assert_unchanged(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        assert model.__dict__.get("forward", MISSING) is self.forward
        assert hooks_of(model) == self.hooks
        if optimizer is not None:
            assert optimizer_hooks(optimizer) == self.optimizer
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert torch.utils.checkpoint._recomputation_hook is ORIGINAL_RECOMPUTATION_HOOK


def args(output_dir: str, **overrides: Any) -> Any:
    return training_args(output_dir, **{"max_steps": 3, **overrides})


def checkpointed_classifier() -> torch.nn.Module:
    """The tiny DistilBERT with (non-reentrant) activation checkpointing, enabled before any
    snapshot: enabling it adds a forward hook of transformers' own to the input embeddings."""
    model = tiny_classifier()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def activations(trainer: Trainer) -> List[Tuple[int, int, int]]:
    return [(entry["step"], entry[ACTIVATIONS_BYTES], entry[ACTIVATIONS_PEAK_BYTES])
            for entry in entries_with(trainer.state.log_history, ACTIVATIONS_BYTES)]


@pytest.fixture(scope="module")
def fresh_model_figures(tmp_path_factory) -> Tuple[int, int]:
    """The activations of one logged step of a fresh model, with a fresh callback."""
    trainer = Trainer(model=checkpointed_classifier(), args=args(str(tmp_path_factory.mktemp("fresh")), max_steps=1),
                      train_dataset=TinyDataset(), callbacks=[OptimizerMemoryCallback(what_if=())])
    trainer.train()
    [(step, saved, peak)] = activations(trainer)
    assert step == 1 and saved > 0 and peak >= saved
    return saved, peak


def train_again_measures_as_fresh(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                                  output_dir: str, expected: Tuple[int, int], snapshot: Snapshot) -> None:
    """A new Trainer and a new callback on the same model (and optimizer) measure what a fresh
    model does, and leave them as `snapshot` found them."""
    trainer = Trainer(model=model, args=args(output_dir, max_steps=1), train_dataset=TinyDataset(),
                      optimizers=(optimizer, None), callbacks=[OptimizerMemoryCallback(what_if=())])
    assert train_recording_warnings(trainer) == []
    assert activations(trainer) == [(1, *expected)]
    snapshot.assert_unchanged(model, optimizer if snapshot.optimizer is not None else None)


@measures
@pytest.mark.parametrize("where", ["forward", "backward", "optimizer step", "callback"])
def test_a_step_that_raises_leaves_the_model_and_optimizer_as_they_were(tmp_path, fresh_model_figures, where):
    model = checkpointed_classifier()
    optimizer = FailingStepAdamW(model.parameters(), fail_at=FAIL_AT if where == "optimizer step" else 0)
    trainer_class, callbacks = Trainer, [OptimizerMemoryCallback(what_if=())]
    if where == "forward":  # the user's own hook, inside the model's forward: it stays, the error passes
        calls = []

        def fail_in_forward(module: Any, inputs: Any, output: Any) -> None:
            calls.append(module.training)
            if len(calls) == FAIL_AT:
                raise Failure("forward failed (on purpose)")

        model.classifier.register_forward_hook(fail_in_forward)
    elif where == "backward":
        trainer_class = BackwardFailingTrainer
        BackwardFailingTrainer.fail_at = FAIL_AT
    elif where == "callback":
        callbacks.append(RaiseAtStepBegin(FAIL_AT))
    snapshot = Snapshot(model, optimizer)
    trainer = trainer_class(model=model, args=args(str(tmp_path / "failing")), train_dataset=TinyDataset(),
                            optimizers=(optimizer, None), callbacks=callbacks)
    with pytest.raises(Failure) as raised:
        trainer.train()
    assert raised.value.__context__ is None  # the user's own error, nothing of ours chained to it
    assert trainer.state.global_step == FAIL_AT - 1
    assert activations(trainer) == [(1, *fresh_model_figures)]  # the step before was measured
    snapshot.assert_unchanged(model, optimizer)
    BackwardFailingTrainer.fail_at = 0
    train_again_measures_as_fresh(model, optimizer, str(tmp_path / "again"), fresh_model_figures, snapshot)


@measures
def test_a_wrapper_left_by_a_loop_that_raised_is_recognised_as_ours(tmp_path, fresh_model_figures):
    """A custom loop whose backward raised, and that never called `close()`: the probe's wrapper
    stays on the model. The next probe must take it for ours and wrap the user's forward."""
    model = checkpointed_classifier()
    optimizer = torch.optim.AdamW(model.parameters())
    before = Snapshot(model, optimizer)
    memory = OptimizerMemoryLogger(optimizer, model=model)  # armed for step 1
    batch = TinyDataset()[0]
    output = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
    with pytest.raises(Failure):
        RaisingBackward.apply(output.loss).backward()
    stale = model.__dict__["forward"]
    assert activations_probe.is_activations_wrapper(stale)
    assert torch.utils.checkpoint._recomputation_hook is not ORIGINAL_RECOMPUTATION_HOOK  # its counter watches
    del output
    # The loop's step pre-hooks stay on its optimizer until its `close()` (and would disarm its
    # probe at that optimizer's step): the Trainer gets an optimizer of its own, the model is checked.
    model_only = copy.copy(before)
    model_only.optimizer = None
    train_again_measures_as_fresh(model, None, str(tmp_path), fresh_model_figures, model_only)
    # The old probe was disarmed when its wrapper was taken off: it measures nothing any more.
    assert not memory.monitor.activations.armed
    memory.close()  # the loop's step pre-hooks, which `close()` is there to remove
    before.assert_unchanged(model, optimizer)


@measures
def test_the_loop_logger_as_a_context_removes_everything_when_the_loop_raises():
    model = checkpointed_classifier()
    optimizer = torch.optim.AdamW(model.parameters())
    before = Snapshot(model, optimizer)
    batch = TinyDataset()[0]
    with pytest.raises(Failure, match="^out of memory in backward"):
        with OptimizerMemoryLogger(optimizer, model=model) as memory:
            assert activations_probe.is_activations_wrapper(model.__dict__["forward"])
            loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
            RaisingBackward.apply(loss).backward()
    assert memory.monitor.activations.armed is False
    before.assert_unchanged(model, optimizer)


@pytest.mark.slow  # a torchrun job / torch.compile: tens of seconds here
def test_a_zero2_step_tap_is_gone_when_train_raises(tmp_path):
    """DeepSpeed's own ZeRO-2 engine in one process (torchrun): the tap wraps DeepSpeed's `step`
    while training, and is gone once `train()` has raised (it used to stay until `on_train_end`)."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               os.path.join(REPO_ROOT, "tests", "dist_scripts", "zero_tap_raises.py"), str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    with open(tmp_path / "rank0.json", encoding="utf-8") as handle:
        result = json.load(handle)
    assert result == {"error": "a callback failed (on purpose)", "global_step": 1, "zero": "DeepSpeedZeroOptimizer",
                      "wrapped_during_training": True, "wrapped_after": False}


def test_the_trainer_class_hooks_are_marked_and_pass_a_plain_trainer_through(tmp_path):
    """`Trainer.train` and `Trainer.log` stay wrapped for the process (installed once, by the first
    callback): a Trainer without our callback trains as before, and its error reaches the caller."""
    OptimizerMemoryCallback(), OptimizerMemoryCallback()
    assert is_train_hook_installed()
    assert not getattr(Trainer.train.__wrapped__, "__trainer_memcb_train_hook__", False)  # wrapped once
    model = tiny_classifier()
    trainer = Trainer(model=model, args=args(str(tmp_path), max_steps=2),
                      train_dataset=TinyDataset(), callbacks=[RaiseAtStepBegin(2)])
    with pytest.raises(Failure, match="^a callback failed"):
        trainer.train()
    assert trainer.state.global_step == 1 and "forward" not in model.__dict__


# -- torch.compile: the run goes as it goes without the callback ---------------------------------
# The "eager" backend keeps the tests quick: dynamo still traces the model's forward (where a
# wrapper of ours would be traced too, and fail under fullgraph), without compiling kernels.


def losses(trainer: Trainer) -> List[float]:
    return [entry["loss"] for entry in entries_with(trainer.state.log_history, "loss")]


def compile_run(output_dir: str, model: torch.nn.Module, callbacks: List[Any], **overrides: Any) -> Tuple[Trainer, List[str]]:
    trainer = Trainer(model=model, args=args(output_dir, max_steps=2, remove_unused_columns=False, **overrides),
                      train_dataset=TinyDataset(), callbacks=callbacks)
    return trainer, train_recording_warnings(trainer)


@measures
@pytest.mark.slow  # a torchrun job / torch.compile: tens of seconds here
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_the_trainers_torch_compile_runs_as_without_the_callback_and_leaves_the_activations_out(
        tmp_path, monkeypatch, fullgraph):
    # TrainingArguments(torch_compile=True) writes accelerate's settings into the environment:
    # set through monkeypatch first, so that they are gone after the test.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "1" if fullgraph else "0")
    compiled = dict(torch_compile=True, torch_compile_backend="eager")
    torch._dynamo.reset()
    model = tiny_classifier()
    without, _ = compile_run(str(tmp_path / "without"), tiny_classifier(), [], **compiled)
    trainer, found_warnings = compile_run(str(tmp_path / "with"), model, [OptimizerMemoryCallback(what_if=())],
                                          **compiled)
    assert found_warnings == [f"trainer_memcb: {activations_probe.COMPILED_MESSAGE}"]
    assert trainer.state.global_step == 2 and losses(trainer) == losses(without)
    training = entries_with(trainer.state.log_history, "loss")
    assert [ACTIVATIONS_BYTES in entry for entry in training] == [False, False]
    assert [entry["optimizer_state_bytes"] for entry in training] == [29808, 29808]  # the rest is measured
    assert "forward" not in model.__dict__


@measures
@pytest.mark.slow  # a torchrun job / torch.compile: tens of seconds here
def test_a_users_compiled_model_runs_as_without_the_callback_and_gets_its_what_if(tmp_path):
    torch._dynamo.reset()
    model = tiny_classifier()
    without, _ = compile_run(str(tmp_path / "without"), torch.compile(tiny_classifier(), backend="eager"), [])
    compiled = torch.compile(model, backend="eager")
    compiled_forward = compiled.__dict__["forward"]  # dynamo's own, on the wrapper
    callback = OptimizerMemoryCallback(what_if=("adamw_torch", "adafactor"))
    trainer, found_warnings = compile_run(str(tmp_path / "with"), compiled, [callback])
    assert found_warnings == [f"trainer_memcb: {activations_probe.COMPILED_MESSAGE}"]  # no what-if failure
    assert trainer.state.global_step == 2 and losses(trainer) == losses(without)
    with open(tmp_path / "with" / "optimizer_memory.json") as handle:
        what_if = json.load(handle)["what_if"]
    assert what_if["model"] == "DistilBertForSequenceClassification" and what_if["trainable_params"] == 3714
    assert [(entry["name"], entry["estimate"]["num_bytes"]) for entry in what_if["optimizers"]][0] == ("adamw_torch", 29808)
    assert "forward" not in model.__dict__ and compiled.__dict__["forward"] is compiled_forward


# -- the wrapper on its own: whose it is, what it replaced ---------------------------------------


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())


def measured(probe: activations_probe.ActivationsProbe, model: torch.nn.Module, rows: int, step: int) -> Dict[str, int]:
    """Arm `probe` on `model`, run one forward and backward of `rows` rows, and read the figures."""
    probe.arm(model, step)
    model(torch.ones(rows, 4)).sum().backward()
    probe.before_optimizer_step()
    return probe.figures(step)


@measures
def test_a_wrapper_whose_probe_is_gone_puts_back_the_users_own_forward():
    model = small_model()
    users_forward = model.forward  # an instance attribute of the user's (a bound method, say)
    model.forward = users_forward
    probe = activations_probe.ActivationsProbe()
    probe.arm(model, 1)
    stale = model.__dict__["forward"]
    assert activations_probe.is_activations_wrapper(stale) and not activations_probe.is_activations_wrapper(users_forward)
    gone = weakref.ref(probe)
    del probe  # held weakly by its wrapper: gone, and its wrapper with it as far as measuring goes
    assert gone() is None
    model(torch.ones(2, 4))  # the stale wrapper only calls through
    assert model.__dict__["forward"] is stale
    # 2 x 4 fp32 rows: linear's input and relu's output, 32 bytes each
    assert measured(activations_probe.ActivationsProbe(), model, 2, 1) == {ACTIVATIONS_BYTES: 64, ACTIVATIONS_PEAK_BYTES: 64}
    assert model.__dict__["forward"] is users_forward


@measures
def test_a_wrapper_left_inside_someone_elses_measures_nothing_once_its_probe_moved_on():
    first, second = small_model(), small_model()
    probe = activations_probe.ActivationsProbe()
    probe.arm(first, 1)
    ours = first.forward
    first.forward = lambda *args: ours(*args)  # wrapped again by someone else, while armed
    probe.disarm()  # ours stays inside theirs
    probe.arm(second, 2)
    first_loss = first(torch.ones(3, 4)).sum()  # the old wrapper, inside the other: not measured
    second(torch.ones(2, 4)).sum().backward()  # (were the first counted, the second would join it)
    first_loss.backward()
    probe.before_optimizer_step()
    assert probe.figures(2) == {ACTIVATIONS_BYTES: 64, ACTIVATIONS_PEAK_BYTES: 64}  # the second model's only


@measures
def test_a_model_compiled_inside_another_after_arming_is_traced_through():
    model = small_model()
    outer = torch.nn.Sequential(model)
    probe = activations_probe.ActivationsProbe()
    probe.arm(model, 1)
    torch._dynamo.reset()
    compiled = torch.compile(outer, backend="eager", fullgraph=True)  # dynamo traces our wrapper
    compiled(torch.ones(2, 4)).sum().backward()
    probe.before_optimizer_step()
    assert probe.figures(1) == {} and "forward" not in model.__dict__
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
