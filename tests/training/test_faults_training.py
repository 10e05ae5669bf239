"""The training side under hostile conditions: each case is something that once broke a run, leaked
memory, wrote where it should not, or logged another run's figure.

Real Trainers on the tiny model, real optimizers (a few of our own, small), real files; nothing is
mocked. The reporters' side of the key names (TensorBoard, W&B, MLflow, DVCLive read back after a
run) is in test_reporters.py.
"""

from __future__ import annotations

import gc
import json
import os
import warnings
import weakref
from typing import Any, Dict, List, Optional

import pytest
import torch
from transformers import Trainer, TrainerCallback

from helpers import TinyDataset, entries_with, tiny_classifier, training_args
from test_callback_logging import adamw_figures, figures_in, train_recording_warnings
from trainer_memcb import OptimizerMemoryCallback, OptimizerMemoryLogger, measure_optimizer_state
from trainer_memcb.training.figures import (
    BREAKDOWN_KEY_PREFIXES,
    KEY_DESCRIPTIONS,
    MEASURED_BYTES,
    MEASURED_ELEMENTS,
    breakdown_key,
    with_prefix,
)
from trainer_memcb.training.summary import SUMMARY_FILE_NAME

def tiny_trainer(output_dir: str, callbacks: List[Any], **overrides: Any) -> Trainer:
    settings: Dict[str, Any] = dict(max_steps=2)
    settings.update(overrides)
    optimizers = settings.pop("optimizers", (None, None))
    return Trainer(
        model=tiny_classifier(), args=training_args(output_dir, **settings), train_dataset=TinyDataset(16),
        eval_dataset=TinyDataset(8, seed=1), optimizers=optimizers, callbacks=callbacks,
    )


# -- the log hook calls only what is ours ---------------------------------------------------------


class ForeignCallback(TrainerCallback):
    """Another library's callback that happens to have methods of the names the hook calls and once
    called: the hook asks only instances of its own base class, never by a method's name."""

    def __init__(self) -> None:
        self.calls = 0

    def contribute_to_log(self) -> None:  # takes no arguments: called with ours, it raises
        self.calls += 1

    contribute_to_trainer_log = contribute_to_log


def _comparable(history: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """A log history without the wall-clock figures, which differ from run to run."""
    timing = ("runtime", "per_second", "total_flos")
    return [{key: value for key, value in entry.items() if not key.endswith(timing)} for entry in history]


def test_a_foreign_callback_with_the_old_method_name_is_never_called_and_its_run_is_untouched(tmp_path):
    from transformers import Trainer as TrainerClass

    OptimizerMemoryCallback()  # installs the hook on Trainer.log for the whole process
    hooked_log = TrainerClass.log
    assert hasattr(hooked_log, "__wrapped__")

    foreign = ForeignCallback()
    trainer = tiny_trainer(str(tmp_path / "hooked"), [foreign])
    assert train_recording_warnings(trainer) == []  # before: TypeError at the first logged step
    trainer.evaluate()
    assert foreign.calls == 0
    hooked_history = _comparable(trainer.state.log_history)

    # The same run with transformers' own Trainer.log: the same entries, key for key, value for value.
    TrainerClass.log = hooked_log.__wrapped__
    try:
        plain = tiny_trainer(str(tmp_path / "plain"), [ForeignCallback()])
        plain.train()
        plain.evaluate()
    finally:
        TrainerClass.log = hooked_log
    assert hooked_history == _comparable(plain.state.log_history)
    assert len(entries_with(hooked_history, "loss")) == 2 and len(entries_with(hooked_history, "eval_loss")) == 1

    # Beside ours in one Trainer, the foreign one is still left alone and ours still logs.
    foreign = ForeignCallback()
    both = tiny_trainer(str(tmp_path / "both"), [foreign, OptimizerMemoryCallback()])
    assert train_recording_warnings(both) == []
    assert foreign.calls == 0
    model = both.model
    for entry in entries_with(both.state.log_history, "loss"):
        assert figures_in(entry) == adamw_figures(model)


# -- figures belong to their Trainer --------------------------------------------------------------


def test_one_callback_shared_by_two_trainers_logs_each_ones_own_optimizer(tmp_path):
    callback = OptimizerMemoryCallback(summary_file=None, what_if=())
    first = tiny_trainer(str(tmp_path / "adamw"), [callback])
    second = tiny_trainer(str(tmp_path / "adafactor"), [callback], optim="adafactor")
    assert train_recording_warnings(first) == []
    assert train_recording_warnings(second) == []
    adamw = adamw_figures(first.model)[MEASURED_BYTES]
    adafactor = measure_optimizer_state(second.optimizer).num_bytes
    assert (adamw, adafactor) == (29808, 2512)
    assert [entry[MEASURED_BYTES] for entry in entries_with(first.state.log_history, "loss")] == [adamw, adamw]
    assert [entry[MEASURED_BYTES] for entry in entries_with(second.state.log_history, "loss")] == [adafactor] * 2

    # In turn: the first Trainer evaluates after the second trained, at the same step number.
    assert first.state.global_step == second.state.global_step == 2
    assert first.evaluate()[f"eval_{MEASURED_BYTES}"] == adamw  # before: the second's 2512
    assert second.evaluate()[f"eval_{MEASURED_BYTES}"] == adafactor
    # A third Trainer, never trained, has no optimizer yet: nothing to log, not the last one's.
    fresh = tiny_trainer(str(tmp_path / "fresh"), [callback])
    assert [key for key in fresh.evaluate() if "optimizer" in key] == []  # before: the Adafactor's figures


class EvaluateAnother(TrainerCallback):
    """Interleaves two Trainers: at each step end of one, the other one evaluates."""

    def __init__(self, other: Trainer) -> None:
        self.other = other
        self.results: List[Dict[str, float]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.results.append(self.other.evaluate())


def test_one_callback_shared_by_interleaved_trainers_logs_each_ones_own_optimizer(tmp_path):
    callback = OptimizerMemoryCallback(summary_file=None, what_if=())
    other = tiny_trainer(str(tmp_path / "adafactor"), [callback], optim="adafactor", max_steps=1)
    assert train_recording_warnings(other) == []
    adafactor = measure_optimizer_state(other.optimizer).num_bytes
    interleave = EvaluateAnother(other)
    # The evaluating callback comes first, so the other Trainer logs between this one's step end
    # (where the callback measures) and this one's log entry.
    main = tiny_trainer(str(tmp_path / "adamw"), [interleave, callback], max_steps=3)
    assert train_recording_warnings(main) == []
    adamw = adamw_figures(main.model)[MEASURED_BYTES]
    assert [entry[MEASURED_BYTES] for entry in entries_with(main.state.log_history, "loss")] == [adamw] * 3
    assert [result[f"eval_{MEASURED_BYTES}"] for result in interleave.results] == [adafactor] * 3


def test_the_callback_does_not_keep_an_optimizer_alive_after_its_trainer_is_gone(tmp_path):
    callback = OptimizerMemoryCallback(breakdown=("key",))
    trainer = tiny_trainer(str(tmp_path), [callback])
    assert train_recording_warnings(trainer) == []
    optimizer = trainer.optimizer.optimizer  # the torch AdamW inside accelerate's wrapper
    state_tensor = next(iter(optimizer.state.values()))["exp_avg"]
    gone = [weakref.ref(trainer.optimizer), weakref.ref(optimizer), weakref.ref(state_tensor)]
    del trainer, optimizer, state_tensor
    gc.collect()
    assert [ref() is None for ref in gone] == [True, True, True]  # before: all held by the callback
    assert callback is not None


def test_without_the_callback_the_optimizer_is_collected_too(tmp_path):
    # The control for the test above: nothing else in a Trainer run keeps the optimizer alive.
    trainer = tiny_trainer(str(tmp_path), [])
    trainer.train()
    gone = weakref.ref(trainer.optimizer.optimizer)
    del trainer
    gc.collect()
    assert gone() is None


class _NoWeakReferences:
    __slots__ = ()  # no __weakref__ slot: weakref.ref() refuses it


def test_an_object_without_weak_references_is_held_until_released():
    from trainer_memcb.training.per_optimizer import PerOptimizer

    numbers = iter(range(1, 10))
    records = PerOptimizer(lambda optimizer: next(numbers))
    plain, odd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), _NoWeakReferences()
    assert [records.setdefault(plain), records.setdefault(odd), records.setdefault(plain)] == [1, 2, 1]
    records.release(plain)  # held weakly: stays until collected
    assert len(records) == 2 and records.get(plain) == 1
    records.release(odd)
    assert len(records) == 1 and records.get(odd) is None
    del plain
    gc.collect()
    assert len(records) == 0


# -- key names every reporter can store ------------------------------------------------------------


# State keys, dtypes and devices as they come: odd ones included, each must give one safe part.
HOSTILE_PARTS = ["exp_avg", "exp_avg_sq", "step", "float32", "cuda:0", "a/b", "a.b", "..", ".", "", "/", "x" * 3]


def loggable_keys() -> List[str]:
    """Every key the library can put in a log entry, as the Trainer and its reporters name it."""
    unprefixed = list(KEY_DESCRIPTIONS)
    for name in BREAKDOWN_KEY_PREFIXES:
        unprefixed += [breakdown_key(name, part) for part in HOSTILE_PARTS]
    entry_keys = unprefixed + list(with_prefix(dict.fromkeys(unprefixed, 0), "eval")) + list(
        with_prefix(dict.fromkeys(unprefixed, 0), "test")) + ["loss", "eval_loss", "learning_rate"]
    # The reporters' own spelling: transformers' rewrite_logs (TensorBoard, W&B) gives train/...,
    # eval/..., test/...; DVCLive's Hugging Face naming turns every train_ and eval_ into train/, eval/.
    reported = [f"train/{key}" for key in unprefixed] + [
        key.replace("eval_", "eval/", 1).replace("test_", "test/", 1) for key in entry_keys if key.startswith(("eval_", "test_"))
    ] + [key.replace("train_", "train/").replace("eval_", "eval/") for key in entry_keys]
    return sorted(set(entry_keys + reported))


@pytest.mark.parametrize("separator", ["/", "."])
def test_no_logged_key_is_a_path_prefix_of_another(separator):
    keys = loggable_keys()
    assert len(keys) > 100
    paths = {tuple(key.split(separator)) for key in keys}
    clashes = sorted(
        (separator.join(shorter), separator.join(longer))
        for shorter in paths for longer in paths if len(shorter) < len(longer) and longer[: len(shorter)] == shorter
    )
    assert clashes == []  # before: optimizer_state_bytes under optimizer_state_bytes/by_key/exp_avg


def test_breakdown_part_names_are_safe_and_distinct_for_real_parts():
    assert breakdown_key("key", "exp_avg") == "optimizer_state_bytes_by_key/exp_avg"
    assert breakdown_key("dtype", "bfloat16") == "optimizer_state_bytes_by_dtype/bfloat16"
    assert breakdown_key("device", "cuda:0") == "optimizer_state_bytes_by_device/cuda_0"
    for part in HOSTILE_PARTS:
        name = breakdown_key("key", part).split("/", 1)[1]
        assert name and set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"), part


# -- the end-of-training summary -------------------------------------------------------------------


def test_a_failed_summary_write_leaves_no_partial_file_and_training_completes(tmp_path):
    output_dir = tmp_path / "run"
    (output_dir / SUMMARY_FILE_NAME).mkdir(parents=True)  # the summary's place is taken by a folder
    trainer = tiny_trainer(str(output_dir), [OptimizerMemoryCallback()])
    (warning,) = train_recording_warnings(trainer)
    assert warning.startswith("trainer_memcb: writing the optimizer memory summary failed")
    assert trainer.state.global_step == 2
    assert sorted(os.listdir(output_dir)) == [SUMMARY_FILE_NAME]  # before: also optimizer_memory.json.partial
    assert os.listdir(output_dir / SUMMARY_FILE_NAME) == []


def test_the_summary_is_never_written_through_a_symbolic_link(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("keep me\n", encoding="utf-8")
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / SUMMARY_FILE_NAME).symlink_to(outside)
    trainer = tiny_trainer(str(output_dir), [OptimizerMemoryCallback()])
    (warning,) = train_recording_warnings(trainer)
    assert warning.startswith("trainer_memcb: writing the optimizer memory summary failed")
    assert "symbolic link" in warning
    assert outside.read_text(encoding="utf-8") == "keep me\n"
    assert os.path.islink(output_dir / SUMMARY_FILE_NAME)  # before: replaced by the summary
    assert sorted(os.listdir(output_dir)) == [SUMMARY_FILE_NAME]


def test_a_planted_partial_file_link_is_not_written_through(tmp_path):
    # The old way wrote `<summary>.partial` first: a link planted under that name sent the
    # summary to its target.
    outside = tmp_path / "outside.json"
    outside.write_text("keep me\n", encoding="utf-8")
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / f"{SUMMARY_FILE_NAME}.partial").symlink_to(outside)
    trainer = tiny_trainer(str(output_dir), [OptimizerMemoryCallback()])
    assert train_recording_warnings(trainer) == []
    assert outside.read_text(encoding="utf-8") == "keep me\n"  # before: the summary
    with open(output_dir / SUMMARY_FILE_NAME, encoding="utf-8") as handle:
        assert json.load(handle)["measured"]["num_bytes"] == adamw_figures(trainer.model)[MEASURED_BYTES]
    assert not os.path.islink(output_dir / SUMMARY_FILE_NAME)


# -- the custom-loop logger --------------------------------------------------------------------------


def test_a_step_that_is_not_a_whole_number_warns_once_and_never_raises():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    memory = OptimizerMemoryLogger(optimizer)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert memory(step="5") == {}  # before: TypeError inside the user's loop
        assert memory(step=2.5) == {}
        assert memory(step=None)[MEASURED_BYTES] == 88
        assert memory(step=4)[MEASURED_BYTES] == 88
    messages = [str(warning.message) for warning in caught if str(warning.message).startswith("trainer_memcb:")]
    assert messages == ["trainer_memcb: step='5' is not a whole number; the figures of this call are left out"]


# -- a sparse tensor in the state --------------------------------------------------------------------


class SparseMaskSGD(torch.optim.SGD):
    """SGD with momentum that also keeps, for each matrix, a sparse COO mask of its first row."""

    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() == 2 and "mask" not in self.state[param]:
                    columns = param.shape[1]
                    indices = torch.stack([torch.zeros(columns, dtype=torch.int64), torch.arange(columns)])
                    self.state[param]["mask"] = torch.sparse_coo_tensor(indices, torch.ones(columns), param.shape)
        return loss


def test_a_sparse_tensor_in_the_state_is_counted_by_its_indices_and_values(tmp_path):
    model = tiny_classifier()
    optimizer = SparseMaskSGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = Trainer(
        model=model, args=training_args(str(tmp_path), max_steps=2), train_dataset=TinyDataset(16),
        optimizers=(optimizer, None), callbacks=[OptimizerMemoryCallback(breakdown=("key", "dtype"))],
    )
    found = train_recording_warnings(trainer)  # before: "measuring ... failed", figure left out
    # The SGD rule knows no `mask`: measured against estimate, that is the one thing said.
    assert len(found) == 1 and "state the rule does not know: +3,520 bytes" in found[0] and "keys mask" in found[0]
    matrices = [param for param in model.parameters() if param.dim() == 2]
    # A mask over C columns: int64 indices (2 x C) and fp32 values (C).
    mask_bytes = sum(2 * 8 * param.shape[1] + 4 * param.shape[1] for param in matrices)
    mask_elements = sum(3 * param.shape[1] for param in matrices)
    momentum_bytes = 4 * 3714
    assert (len(matrices), mask_bytes, momentum_bytes) == (10, 3520, 14856)
    for entry in entries_with(trainer.state.log_history, "loss"):
        assert entry[MEASURED_BYTES] == momentum_bytes + mask_bytes
        assert entry[MEASURED_ELEMENTS] == 3714 + mask_elements
        assert entry[breakdown_key("key", "mask")] == mask_bytes
        assert entry[breakdown_key("key", "momentum_buffer")] == momentum_bytes
        assert entry[breakdown_key("dtype", "int64")] == sum(16 * param.shape[1] for param in matrices) == 2816


def test_compressed_sparse_tensors_are_counted_by_their_index_and_value_storages():
    param = torch.nn.Parameter(torch.zeros(3, 4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    # Built from fresh tensors, so each storage is exactly its tensor (a converted tensor may keep
    # its indices as views into a larger buffer, which then counts whole).
    values = torch.tensor([1.0, 2.0])
    optimizer.state[param]["csr"] = torch.sparse_csr_tensor(  # crow 4 x int64, col 2 x int64, values 2 x fp32
        torch.tensor([0, 1, 1, 2]), torch.tensor([1, 0]), values.clone(), (3, 4))
    optimizer.state[param]["csc"] = torch.sparse_csc_tensor(  # ccol 5 x int64, row 2 x int64, values 2 x fp32
        torch.tensor([0, 1, 2, 2, 2]), torch.tensor([2, 0]), values.clone(), (3, 4))
    measured = measure_optimizer_state(optimizer)
    assert measured.bytes_by_key == {"csr": 8 * 4 + 8 * 2 + 4 * 2, "csc": 8 * 5 + 8 * 2 + 4 * 2}
    assert (measured.num_bytes, measured.num_tensors, measured.num_params_with_state) == (120, 6, 1)
    assert measured.bytes_by_dtype == {"int64": 104, "float32": 16}
