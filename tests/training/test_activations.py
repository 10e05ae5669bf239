"""Activations measured in real runs: `activations_bytes` and `activations_peak_bytes` in the
Trainer's entries and the loop logger's figures, exact to the byte.

Each run is a real Trainer (or accelerate loop) on the CPU with a tiny Llama or the tiny DistilBERT.
The independent count replays the very inputs the logged micro-batch's forward received (recorded
by a forward pre-hook of the test's own) through the same model, in the same mode, under a plain
`saved_tensors_hooks` walk (`helpers.independent_saved_bytes`) that keeps every saved tensor and
adds up the distinct storages that are not parameters. Nothing is mocked except where a test breaks the counter on purpose.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from accelerate import Accelerator
from transformers import (
    DistilBertConfig,
    DistilBertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
)

import trainer_memcb.training.activations_probe as activations_probe
from helpers import (
    VOCAB_SIZE,
    TinyDataset,
    entries_with,
    independent_saved_bytes,
    installed_version,
    requires_torch,
    training_args,
)
from test_callback_logging import train_recording_warnings
from trainer_memcb import OptimizerMemoryCallback, OptimizerMemoryLogger
from trainer_memcb.state.saved_tensors import SavedTensorsCounter
from trainer_memcb.training.figures import (
    ACTIVATIONS_BYTES,
    ACTIVATIONS_PEAK_BYTES,
    ACTIVATION_KEYS,
    DEVICE_PEAK_ALLOCATED_BYTES,
    KEY_DESCRIPTIONS,
)

LLAMA_SEQUENCE = 16
# Measuring needs to see which saved-tensor hooks are active (so that the user's own keep working).
measures = requires_torch("2.8", "torch._C._autograd._top_saved_tensors_default_hooks, to see saved-tensor hooks "
                          "of the user's own; on an older torch the activations are left out with one warning")
# The Trainer's gradient checkpointing is non-reentrant from transformers 5 on (reentrant in 4.x,
# whose blocks recompute after the counter has left, so their peak is the forward's).
NON_REENTRANT_CHECKPOINTING = (installed_version("transformers") or (0,)) >= (5,)


def tiny_llama(attn: str = "eager", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LLAMA_SEQUENCE,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


def tiny_distilbert(attn: str = "eager", seed: int = 0) -> DistilBertForSequenceClassification:
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=VOCAB_SIZE, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=8,
        num_labels=2, attn_implementation=attn,
    )
    return DistilBertForSequenceClassification(config)


class TokenDataset(torch.utils.data.Dataset):
    """Causal-LM samples: input ids and the same ids as labels."""

    def __init__(self, size: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, VOCAB_SIZE, (size, LLAMA_SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


MODELS = {"llama": (tiny_llama, TokenDataset), "distilbert": (tiny_distilbert, TinyDataset)}


# -- the independent count and the recorder -----------------------------------------------------


def replayed_peak(model: torch.nn.Module, inputs: Dict[str, Any]) -> int:
    """The saved-bytes peak of one forward and backward of `model` on `inputs`, by a counter of
    its own around them."""
    counter = SavedTensorsCounter(exclude=list(model.parameters()), watch_recomputation=True)
    with counter:
        loss = model(**inputs).loss
    loss.backward()
    counter.close()
    model.zero_grad()
    return counter.peak_bytes


class ForwardRecorder:
    """Records, for each forward of `model`, its inputs and whether the probe's wrapper was on."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: List[Dict[str, Any]] = []
        self.armed: List[bool] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        self.armed.append(is_measuring(module))
        self.calls.append({key: value.detach().clone() if isinstance(value, torch.Tensor) else value
                           for key, value in kwargs.items()})

    def remove(self) -> None:
        self._handle.remove()


@contextlib.contextmanager
def class_forward(model: torch.nn.Module):
    """The model's class forward, without any instance-level wrapper, for the duration."""
    wrapper = model.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if wrapper is not None:
            model.__dict__["forward"] = wrapper


def is_measuring(model: torch.nn.Module) -> bool:
    return activations_probe.is_activations_wrapper(model.__dict__.get("forward"))


def assert_nothing_left(model: torch.nn.Module) -> None:
    """No wrapper, no module hook, no saved-tensors hooks: the model as it was."""
    assert "forward" not in model.__dict__
    assert dict(model._forward_pre_hooks) == {} and dict(model._forward_hooks) == {}
    if activations_probe.ACTIVATIONS_SUPPORTED:  # an older torch cannot say
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def activation_figures(entry: Dict[str, Any]) -> Dict[str, int]:
    return {key: entry[key] for key in ACTIVATION_KEYS if key in entry}


def train(model: torch.nn.Module, dataset: torch.utils.data.Dataset, output_dir: str,
          callback: Optional[OptimizerMemoryCallback] = None, **overrides: Any) -> Tuple[Trainer, ForwardRecorder, List[str]]:
    callback = callback or OptimizerMemoryCallback(what_if=())
    trainer = Trainer(model=model, args=training_args(output_dir, **overrides), train_dataset=dataset,
                      callbacks=[callback])
    recorder = ForwardRecorder(model)
    try:
        found_warnings = train_recording_warnings(trainer)
    finally:
        recorder.remove()
    return trainer, recorder, found_warnings


# -- exact bytes in real Trainer runs -----------------------------------------------------------


@measures
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logged_steps_carry_the_bytes_an_independent_walk_counts(tmp_path, name, attn, checkpointing, precision):
    make_model, make_dataset = MODELS[name]
    model = make_model(attn)
    if precision == "bf16":
        model.to(torch.bfloat16)
    trainer, recorder, found_warnings = train(model, make_dataset(), str(tmp_path), max_steps=3,
                                              logging_steps=2, gradient_checkpointing=checkpointing)
    assert found_warnings == []
    # Steps 1 and 3 are not logged: nothing was installed for them; step 2 is.
    assert recorder.armed == [False, True, False]
    training = entries_with(trainer.state.log_history, "loss")
    assert [entry["step"] for entry in training] == [2]
    model.train()  # the Trainer's mode during the step (it leaves the model in it; said here)
    expected = independent_saved_bytes(model, recorder.calls[1])
    figures = activation_figures(training[0])
    assert figures[ACTIVATIONS_BYTES] == expected
    if not checkpointing:  # backward only frees what forward saved
        assert figures[ACTIVATIONS_PEAK_BYTES] == expected
    else:  # non-reentrant checkpointing: the blocks' recomputation during backward holds more for a while
        assert figures[ACTIVATIONS_PEAK_BYTES] == replayed_peak(model, recorder.calls[1]) >= expected
        if NON_REENTRANT_CHECKPOINTING:
            assert figures[ACTIVATIONS_PEAK_BYTES] > expected
    assert DEVICE_PEAK_ALLOCATED_BYTES not in figures  # on CUDA only
    assert_nothing_left(model)


@measures
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bf16_autocast_is_measured_as_it_runs(tmp_path, attn):
    # TrainingArguments(bf16=True) on the CPU: accelerate runs the forward under autocast, whose
    # bf16 copies of the weights are saved for backward (they are not the parameters' storages).
    model = tiny_llama(attn)
    trainer, recorder, found_warnings = train(model, TokenDataset(), str(tmp_path), max_steps=1, bf16=True)
    assert found_warnings == []
    model.train()
    expected = independent_saved_bytes(model, recorder.calls[0], autocast=torch.bfloat16)
    figures = activation_figures(entries_with(trainer.state.log_history, "loss")[0])
    assert figures == {ACTIVATIONS_BYTES: expected, ACTIVATIONS_PEAK_BYTES: expected}
    with class_forward(model):  # without accelerate's autocast wrapper, if it is still on the model
        fp32 = independent_saved_bytes(model, recorder.calls[0])
    assert fp32 != expected  # autocast changed what was saved: the run and the replay ran under it
    assert not is_measuring(model)


@measures
def test_gradient_accumulation_reports_the_last_micro_batch(tmp_path):
    # 6 samples in batches of 4: each optimizer step accumulates a batch of 4, then one of 2.
    model = tiny_llama()
    trainer, recorder, _ = train(model, TokenDataset(6), str(tmp_path), max_steps=1, gradient_accumulation_steps=2)
    assert [call["input_ids"].shape[0] for call in recorder.calls] == [4, 2]
    assert recorder.armed == [True, True]
    model.train()
    first, last = (independent_saved_bytes(model, call) for call in recorder.calls)
    assert first != last
    figures = activation_figures(entries_with(trainer.state.log_history, "loss")[0])
    assert figures == {ACTIVATIONS_BYTES: last, ACTIVATIONS_PEAK_BYTES: last}
    assert_nothing_left(model)


def r_drop_loss(first: Any, second: Any) -> torch.Tensor:
    """R-Drop: both forwards' losses and the symmetric KL divergence of their predictions."""
    log_p, log_q = first.logits.log_softmax(-1), second.logits.log_softmax(-1)
    kl = torch.nn.functional.kl_div
    return (first.loss + second.loss + kl(log_p, log_q, log_target=True, reduction="batchmean")
            + kl(log_q, log_p, log_target=True, reduction="batchmean"))


class RDropTrainer(Trainer):
    """Two forwards of the same batch with gradients (different dropout masks), one backward."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        first, second = model(**inputs), model(**inputs)
        loss = r_drop_loss(first, second)
        return (loss, first) if return_outputs else loss


def saved_bytes_of_forwards_together(model: torch.nn.Module, calls: List[Dict[str, Any]]) -> int:
    """The distinct non-parameter storages that several forwards save for one backward, by a plain
    `saved_tensors_hooks` walk around all of them that keeps every saved tensor."""
    params = {param.untyped_storage().data_ptr() for param in model.parameters()}
    kept: List[torch.Tensor] = []
    sizes: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor)
        if tensor.untyped_storage().data_ptr() not in params:
            sizes[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = [model(**call) for call in calls]
    assert all(output.loss is not None for output in outputs)
    return sum(sizes.values())


def replayed_r_drop_peak(model: torch.nn.Module, inputs: Dict[str, Any]) -> int:
    """The saved-bytes peak of R-Drop's two forwards and their backward, by one counter of its own
    around both forwards (the loss computed outside it, as in the run)."""
    counter = SavedTensorsCounter(exclude=list(model.parameters()), watch_recomputation=True)
    with counter:
        first, second = model(**inputs), model(**inputs)
    r_drop_loss(first, second).backward()
    counter.close()
    model.zero_grad()
    return counter.peak_bytes


@measures
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_several_forwards_of_one_micro_batch_are_counted_together(tmp_path, checkpointing):
    # R-Drop calls the model twice before one backward: backward needs what both forwards saved.
    # With 2 micro-batches per step, the second micro-batch's two forwards are the ones reported.
    model = tiny_distilbert()
    trainer = RDropTrainer(model=model, args=training_args(str(tmp_path), max_steps=1, gradient_accumulation_steps=2,
                                                           gradient_checkpointing=checkpointing),
                           train_dataset=TinyDataset(8), callbacks=[OptimizerMemoryCallback(what_if=())])
    recorder = ForwardRecorder(model)
    try:
        assert train_recording_warnings(trainer) == []
    finally:
        recorder.remove()
    assert len(recorder.calls) == 4 and recorder.armed == [True] * 4
    model.train()
    third, fourth = recorder.calls[2:]
    assert third.keys() == fourth.keys() and all(torch.equal(third[key], fourth[key]) for key in third)
    one = independent_saved_bytes(model, third)
    # One batch object for both, as compute_loss passes it: its tensors are saved once.
    together = saved_bytes_of_forwards_together(model, [third, third])
    assert one < together < 2 * one  # the batch's own tensors (ids, mask) are saved by both, counted once
    figures = activation_figures(entries_with(trainer.state.log_history, "loss")[0])
    assert figures[ACTIVATIONS_BYTES] == together
    if not checkpointing:
        assert figures[ACTIVATIONS_PEAK_BYTES] == together
    else:  # the blocks' recomputation during backward: the counter watches it to the end
        assert figures[ACTIVATIONS_PEAK_BYTES] == replayed_r_drop_peak(model, third) > together
    assert_nothing_left(model)


@measures
def test_keys_absent_before_the_first_logged_step_from_evaluations_and_when_turned_off(tmp_path):
    model = tiny_distilbert()
    overrides = dict(max_steps=2, logging_steps=2, eval_strategy="steps", eval_steps=1)
    trainer = Trainer(model=model, args=training_args(str(tmp_path / "on"), **overrides), train_dataset=TinyDataset(),
                      eval_dataset=TinyDataset(8), callbacks=[OptimizerMemoryCallback(what_if=())])
    trainer.train()
    history = trainer.state.log_history
    evaluations = entries_with(history, "eval_loss")
    assert [entry["step"] for entry in evaluations] == [1, 2]
    assert all(not any("activations" in key or "device_peak" in key for key in entry) for entry in evaluations)
    assert [entry["step"] for entry in entries_with(history, ACTIVATIONS_BYTES)] == [2]
    assert_nothing_left(model)

    model = tiny_distilbert()
    trainer, recorder, _ = train(model, TinyDataset(), str(tmp_path / "off"), max_steps=2,
                                 callback=OptimizerMemoryCallback(what_if=(), activations=False))
    assert recorder.armed == [False, False]
    assert [entry["step"] for entry in entries_with(trainer.state.log_history, "optimizer_state_bytes")] == [1, 2]
    assert entries_with(trainer.state.log_history, ACTIVATIONS_BYTES) == []


@measures
@pytest.mark.parametrize("overrides, logged", [
    (dict(max_steps=5, logging_steps=3, logging_first_step=True), [1, 3]),
    (dict(num_train_epochs=2, logging_strategy="epoch"), [2, 4]),  # 8 samples in batches of 4
    (dict(max_steps=3, logging_strategy="epoch"), [2, 3]),  # the run's last step closes an epoch early
    (dict(max_steps=2, logging_strategy="no"), []),
])
def test_the_steps_measured_are_the_steps_the_trainer_logs(tmp_path, overrides, logged):
    model = tiny_distilbert()
    overrides.setdefault("logging_steps", 1)
    trainer, recorder, _ = train(model, TinyDataset(8), str(tmp_path), **overrides)
    steps = [entry["step"] for entry in entries_with(trainer.state.log_history, ACTIVATIONS_BYTES)]
    assert steps == logged
    assert [index + 1 for index, armed in enumerate(recorder.armed) if armed] == logged
    assert_nothing_left(model)


# -- removed whatever happens -------------------------------------------------------------------


class FailingForward(torch.nn.Module):
    """Wraps a model; its forward raises on the given call."""

    def __init__(self, inner: torch.nn.Module, fail_at: int) -> None:
        super().__init__()
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def forward(self, **inputs: Any) -> Any:
        self.calls += 1
        output = self.inner(**inputs)
        if self.calls == self.fail_at:
            raise RuntimeError("forward failed on purpose")
        return output


@measures
def test_a_forward_that_raises_while_measured_leaves_nothing_installed(tmp_path):
    model = FailingForward(tiny_distilbert(), fail_at=2)
    callback = OptimizerMemoryCallback(what_if=())
    trainer = Trainer(model=model, args=training_args(str(tmp_path), max_steps=3, remove_unused_columns=False),
                      train_dataset=TinyDataset(),
                      callbacks=[callback])
    recorder = ForwardRecorder(model)
    with pytest.raises(RuntimeError, match="^forward failed on purpose$") as raised:
        trainer.train()
    recorder.remove()
    assert raised.value.__context__ is None  # the user's own error, nothing of ours chained to it
    assert recorder.armed == [True, True]
    assert_nothing_left(model)
    # The same callback trains again afterwards, and measures.
    model.fail_at = 0
    trainer.train()
    assert [entry["step"] for entry in entries_with(trainer.state.log_history, ACTIVATIONS_BYTES)] == [1, 2, 3]
    assert_nothing_left(model)


@measures
def test_one_callback_serves_a_second_trainer(tmp_path):
    callback = OptimizerMemoryCallback(what_if=())
    llama, bert = tiny_llama(), tiny_distilbert()
    first, first_recorder, _ = train(llama, TokenDataset(), str(tmp_path / "a"), callback=callback, max_steps=1)
    second, second_recorder, _ = train(bert, TinyDataset(), str(tmp_path / "b"), callback=callback, max_steps=1)
    for trainer, recorder, model in ((first, first_recorder, llama), (second, second_recorder, bert)):
        model.train()
        expected = independent_saved_bytes(model, recorder.calls[0])
        figures = activation_figures(entries_with(trainer.state.log_history, "loss")[0])
        assert figures == {ACTIVATIONS_BYTES: expected, ACTIVATIONS_PEAK_BYTES: expected}
        assert_nothing_left(model)


class BrokenCounter:
    def __init__(self, exclude: Any = (), **options: Any) -> None:
        raise RuntimeError("counter broken on purpose")


@measures
def test_a_counter_that_fails_warns_once_and_training_finishes(tmp_path, monkeypatch):
    monkeypatch.setattr(activations_probe, "SavedTensorsCounter", BrokenCounter)
    model = tiny_distilbert()
    trainer, _, found_warnings = train(model, TinyDataset(), str(tmp_path), max_steps=3)
    assert found_warnings == ["trainer_memcb: measuring the activations failed "
                              "(RuntimeError('counter broken on purpose')); they are left out"]
    assert trainer.state.global_step == 3
    assert entries_with(trainer.state.log_history, ACTIVATIONS_BYTES) == []
    assert len(entries_with(trainer.state.log_history, "optimizer_state_bytes")) == 3
    assert_nothing_left(model)


@measures
def test_the_users_own_saved_tensors_hooks_still_apply_and_are_counted_through(tmp_path):
    model = tiny_distilbert()
    packed: List[int] = []

    def pack(tensor: torch.Tensor) -> Any:
        packed.append(1)
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        trainer, recorder, found_warnings = train(model, TinyDataset(), str(tmp_path), max_steps=2, logging_steps=2)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks
        calls_in_training = len(packed)
    assert found_warnings == []
    assert recorder.armed == [False, True]
    model.train()
    expected = independent_saved_bytes(model, recorder.calls[1])
    # The user's pack hook saw every saved tensor of both steps, the measured one included.
    assert calls_in_training > 0 and calls_in_training % 2 == 0
    figures = activation_figures(entries_with(trainer.state.log_history, "loss")[0])
    assert figures == {ACTIVATIONS_BYTES: expected, ACTIVATIONS_PEAK_BYTES: expected}
    assert_nothing_left(model)


@pytest.mark.skipif(activations_probe.ACTIVATIONS_SUPPORTED, reason="this torch measures the activations: the "
                    "tests above cover it")
def test_an_older_torch_says_so_once_at_info_and_leaves_the_activations_out(tmp_path, caplog):
    model = tiny_distilbert()
    with caplog.at_level("INFO", logger=activations_probe.__name__):
        trainer, recorder, found_warnings = train(model, TinyDataset(), str(tmp_path), max_steps=2)
    assert found_warnings == []  # a documented limit of this torch, not a failure: no warning
    assert [record.getMessage() for record in caplog.records if record.name == activations_probe.__name__] == [
        f"trainer_memcb: this torch ({torch.__version__}) cannot say which saved-tensor hooks are active, which "
        "measuring the activations needs (torch 2.8 and newer can); they are left out"]
    assert recorder.armed == [False, False]
    assert entries_with(trainer.state.log_history, ACTIVATIONS_BYTES) == []
    assert len(entries_with(trainer.state.log_history, "optimizer_state_bytes")) == 2
    assert_nothing_left(model)


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(activations="yes"), "activations='yes': expected True (measure the activations on logged steps) or False"),
    (dict(activations=None), "activations=None: expected True"),
    (dict(activations=1), "activations=1: expected True"),
    (dict(reset_device_peak="no"), "reset_device_peak='no': expected True (reset CUDA's peak statistics"),
    (dict(reset_device_peak=0), "reset_device_peak=0: expected True"),
])
def test_bad_option_values_raise_value_errors_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}".replace("(", r"\(").replace(")", r"\)")):
        OptimizerMemoryCallback(**kwargs)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match=f"^{message}".replace("(", r"\(").replace(")", r"\)")):
        OptimizerMemoryLogger(optimizer, **kwargs)


def test_the_keys_are_described_with_their_unit():
    for key in ACTIVATION_KEYS:
        assert KEY_DESCRIPTIONS[key].startswith("bytes: ")
        assert key in OptimizerMemoryCallback.KEYS and key in OptimizerMemoryLogger.KEYS
        assert f"`{key}`" in OptimizerMemoryCallback.__doc__


@measures
def test_the_probe_docstring_example_runs():
    import doctest

    assert doctest.testmod(activations_probe, raise_on_error=True).attempted > 0


# -- the custom loop ----------------------------------------------------------------------------


@measures
def test_the_loop_logger_measures_the_last_micro_batch_of_logged_steps(tmp_path, fresh_accelerator_state):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    loader = torch.utils.data.DataLoader(TokenDataset(24), batch_size=4)  # 6 micro-batches: 3 steps
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    memory = OptimizerMemoryLogger(optimizer, accelerator, logging_steps=2, max_steps=3, model=model)
    recorder = ForwardRecorder(model)
    returned: List[Dict[str, int]] = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
            figures = memory()
            if accelerator.sync_gradients:
                returned.append(figures)
    recorder.remove()
    # Optimizer steps 1, 2, 3 (micro-batches 1-2, 3-4, 5-6): step 2 and the last step are logged.
    assert [bool(figures) for figures in returned] == [False, True, True]
    assert recorder.armed == [False, False, True, True, True, True]
    model.train()
    for figures, call in ((returned[1], recorder.calls[3]), (returned[2], recorder.calls[5])):
        expected = independent_saved_bytes(model, call)
        assert activation_figures(figures) == {ACTIVATIONS_BYTES: expected, ACTIVATIONS_PEAK_BYTES: expected}
    # An evaluation's entry carries no activation keys.
    entry = memory.add_to({"eval_loss": 1.0}, prefix="eval")
    assert not any(key.startswith("eval_activations") for key in entry)
    assert "eval_optimizer_state_bytes" in entry
    assert_nothing_left(model)  # max_steps reached: nothing armed for a step that will not come


@measures
def test_the_loop_logger_without_a_model_or_turned_off_measures_nothing(fresh_accelerator_state):
    model = tiny_distilbert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"input_ids": TinyDataset().input_ids[:4], "labels": TinyDataset().labels[:4]}
    for memory in (OptimizerMemoryLogger(optimizer), OptimizerMemoryLogger(optimizer, model=model, activations=False)):
        assert "forward" not in model.__dict__
        model(**batch).loss.backward()
        optimizer.step()
        assert ACTIVATIONS_BYTES not in memory() and "optimizer_state_bytes" in memory.add_to({})
    # Armed for the step after the last one counted, with no max_steps: save_summary removes it.
    memory = OptimizerMemoryLogger(optimizer, model=model)
    assert is_measuring(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memory.save_summary("/nonexistent/\0bad")  # fails to write, still disarms
    assert_nothing_left(model)
