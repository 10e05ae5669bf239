"""Evaluation's memory in real Trainer runs: logged == an independent walk of the loop's containers
== the plan, to the byte; the forward's logged peak == the plan's; every wrapper removed."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from transformers import (
    DistilBertConfig,
    DistilBertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers import trainer_pt_utils

from helpers import installed_version, requires_transformers
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.plan.answers.eval_memory import eval_settings_from_args, plan_eval_memory
from trainer_memcb.training.figures import EVALUATION_KEYS

# Real runs (torchrun jobs, or a dozen Trainer evaluations): minutes here, run by .ci/run.
pytestmark = pytest.mark.slow

CONTAINER_KEYS = ("containers_device_bytes", "containers_host_bytes", "concat_peak_bytes", "host_concat_peak_bytes")
VOCAB, SEQ = 96, 12


def llama_config() -> LlamaConfig:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return config


def classifier_config() -> DistilBertConfig:
    config = DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
                              max_position_embeddings=SEQ, num_labels=3)
    config._attn_implementation = "eager"
    return config


MODELS: Dict[str, Tuple[Callable[[], Any], Any]] = {
    "llama": (llama_config, LlamaForCausalLM),
    "classifier": (classifier_config, DistilBertForSequenceClassification),
}


class Tokens(torch.utils.data.Dataset):
    """`size` samples of `SEQ` tokens (or of `lengths[i]` tokens), labelled as the head wants."""

    def __init__(self, kind: str, size: int, lengths: Optional[List[int]] = None) -> None:
        generator = torch.Generator().manual_seed(0)
        self.kind, self.lengths = kind, lengths or [SEQ] * size
        self.ids = [torch.randint(0, VOCAB, (length,), generator=generator) for length in self.lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        labels = self.ids[index] if self.kind == "llama" else torch.tensor(index % 3)
        return {"input_ids": self.ids[index], "labels": labels}


def pad_per_batch(features: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Pads each batch to its own longest sequence: later batches are longer, so the loop pads."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    for row, feature in enumerate(features):
        ids[row, : len(feature["input_ids"])] = feature["input_ids"]
        labels[row, : len(feature["labels"])] = feature["labels"]
    return {"input_ids": ids, "labels": labels}


# -- an independent walk of the containers, from the test's side -------------------------------------


def _tensor_storages(value: Any, found: Dict[int, int]) -> Dict[int, int]:
    if isinstance(value, torch.Tensor):
        found[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensor_storages(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensor_storages(item, found)
    return found


def _array_memory(value: Any, found: Dict[int, int]) -> Dict[int, int]:
    if isinstance(value, np.ndarray):
        while isinstance(value.base, np.ndarray):
            value = value.base
        found[value.ctypes.data] = value.nbytes
    elif isinstance(value, (list, tuple)):
        for item in value:
            _array_memory(item, found)
    return found


def _numpified(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * (4 if value.dtype == torch.bfloat16 else value.element_size())
    if isinstance(value, (list, tuple)):
        return sum(_numpified(item) for item in value)
    return 0


class Walker:
    """Wraps `EvalLoopContainer` from the test's side and walks every container the loop makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.containers: List[Any] = []
        self.device = self.concat = self.host_concat = 0
        cls = trainer_pt_utils.EvalLoopContainer
        init, add, flush = cls.__init__, cls.add, cls.to_cpu_and_numpy
        walker = self

        def walked_init(container: Any, *args: Any, **kwargs: Any) -> None:
            init(container, *args, **kwargs)
            walker.containers.append(container)

        def walked_add(container: Any, tensors: Any) -> None:
            held = walker._device_now()
            new = _tensor_storages(tensors, {})
            add(container, tensors)
            walker.concat = max(walker.concat, sum({**held, **new, **_tensor_storages(container.tensors, {})}.values()))

        def walked_flush(container: Any) -> None:
            walker.device = max(walker.device, sum(walker._device_now().values()))
            concatenates = container.tensors is not None and container.do_nested_concat and container.arrays is not None
            new = _numpified(container.tensors) if concatenates else 0
            before = walker._host_now()
            flush(container)
            walker.host_concat = max(walker.host_concat, sum({**before, **walker._host_now()}.values()) + new)

        monkeypatch.setattr(cls, "__init__", walked_init)
        monkeypatch.setattr(cls, "add", walked_add)
        monkeypatch.setattr(cls, "to_cpu_and_numpy", walked_flush)

    def _device_now(self) -> Dict[int, int]:
        found: Dict[int, int] = {}
        for container in self.containers:
            _tensor_storages(container.tensors, found)
        return found

    def _host_now(self) -> Dict[int, int]:
        found: Dict[int, int] = {}
        for container in self.containers:
            _array_memory(container.arrays, found)
        return found

    def figures(self) -> Dict[str, int]:
        # The host side only grows: what the containers hold after the loop is their fullest.
        return {"containers_device_bytes": self.device, "containers_host_bytes": sum(self._host_now().values()),
                "concat_peak_bytes": self.concat, "host_concat_peak_bytes": self.host_concat}


# -- the runs ------------------------------------------------------------------------------------------


def argmax(logits: Any, labels: Any) -> Any:
    return logits.argmax(dim=-1)


def count_metric(prediction: Any) -> Dict[str, float]:
    return {"seen": float(len(prediction.label_ids))}


def evaluate(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kind: str, samples: int = 10,
             lengths: Optional[List[int]] = None, metrics: bool = True, preprocess: Any = None,
             **overrides: Any) -> Tuple[Dict[str, Any], Dict[str, int], TrainingArguments]:
    make_config, cls = MODELS[kind]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_eval_batch_size=4, report_to=[],
                             disable_tqdm=True, **overrides)
    trainer = Trainer(model=cls(make_config()), args=args, eval_dataset=Tokens(kind, samples, lengths),
                      data_collator=pad_per_batch if lengths else None,
                      compute_metrics=count_metric if metrics else None, preprocess_logits_for_metrics=preprocess,
                      callbacks=[OptimizerMemoryCallback(eval_keys="all")])
    walker = Walker(monkeypatch)
    logged = trainer.evaluate()
    monkeypatch.undo()
    return logged, walker.figures(), args


def planned(kind: str, args: TrainingArguments, samples: int, logits: Optional[str] = None) -> Any:
    make_config, cls = MODELS[kind]

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return cls(make_config())

    return plan_eval_memory(build, eval_settings_from_args(args, samples, SEQ, logits))


# (name, model, TrainingArguments overrides, run options, the plan's --eval-logits)
RUNS = [
    ("llama", "llama", {}, {}, None),
    ("llama, eval_accumulation_steps=2", "llama", {"eval_accumulation_steps": 2}, {}, None),
    ("llama, argmax preprocess", "llama", {}, {"preprocess": argmax}, "argmax"),
    ("llama, no concat, accumulation 2", "llama", {"eval_do_concat_batches": False, "eval_accumulation_steps": 2},
     {}, None),
    ("llama, inputs for metrics", "llama", {"include_for_metrics": ["inputs"]}, {}, None),
    ("llama, no compute_metrics", "llama", {}, {"metrics": False}, "none"),
    ("classifier", "classifier", {}, {}, None),
    ("classifier, eval_accumulation_steps=1, 9 samples", "classifier", {"eval_accumulation_steps": 1},
     {"samples": 9}, None),
]


@pytest.mark.parametrize("name,kind,overrides,options,logits", RUNS, ids=[run[0] for run in RUNS])
def test_logged_equals_walked_equals_planned(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, name: str, kind: str,
                                             overrides: Dict[str, Any], options: Dict[str, Any],
                                             logits: Optional[str]) -> None:
    logged, walked, args = evaluate(tmp_path, monkeypatch, kind, **options, **overrides)
    assert {key: logged[f"eval_{key}"] for key in CONTAINER_KEYS} == walked
    plan = planned(kind, args, options.get("samples", 10), logits)
    assert {key: getattr(plan, key) for key in CONTAINER_KEYS} == walked
    assert walked["containers_device_bytes"] > 0 and walked["containers_host_bytes"] > 0


@requires_transformers("5.0", "measured on transformers 5.24, whose Trainer sets use_cache=False and passes "
                       "num_items_in_batch in prediction_step; 4.57's evaluation forward is not measured here")
@pytest.mark.parametrize("kind", ["llama", "classifier"])
def test_the_logged_forward_peak_equals_the_planned(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    logged, _, args = evaluate(tmp_path, monkeypatch, kind)
    # Eager attention: the fake forward allocates what the real one does, storage by storage.
    assert logged["eval_forward_peak_bytes"] == planned(kind, args, 10).forward_peak_bytes > 0


def test_full_logits_are_samples_x_seq_x_vocab_x_4_and_argmax_x_8(tmp_path: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    logged, _, _ = evaluate(tmp_path, monkeypatch, "llama")
    # 10 samples: logits 10 x 12 x 96 x 4, labels 10 x 12 x 8, losses 10 x 4 (the last batch's cut to 2).
    assert logged["eval_containers_device_bytes"] == 10 * SEQ * VOCAB * 4 + 10 * SEQ * 8 + 10 * 4
    logged, _, _ = evaluate(tmp_path, monkeypatch, "llama", preprocess=argmax)
    assert logged["eval_containers_device_bytes"] == 10 * SEQ * 8 + 10 * SEQ * 8 + 10 * 4


def test_padding_that_grows_is_walked_to_the_byte(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = [4, 4, 5, 5, 7, 7, 8, 8, 12, 12]  # batches of 4: longest 5, 8, 12: each concatenation pads
    for overrides in ({}, {"eval_accumulation_steps": 1}, {"eval_do_concat_batches": False}):
        logged, walked, _ = evaluate(tmp_path, monkeypatch, "llama", lengths=lengths, **overrides)
        assert {key: logged[f"eval_{key}"] for key in CONTAINER_KEYS} == walked
    logged, walked, _ = evaluate(tmp_path, monkeypatch, "llama", lengths=lengths)
    # Padded to 12 tokens in the end: the same bytes as fixed-length samples of 12.
    assert walked["containers_device_bytes"] == 10 * 12 * VOCAB * 4 + 10 * 12 * 8 + 10 * 4


def test_training_entries_carry_no_evaluation_keys_and_evaluation_entries_the_short_pair(tmp_path: Any) -> None:
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=2, logging_steps=1, eval_strategy="steps",
                             eval_steps=1, report_to=[], disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=Tokens("llama", 8),
                      eval_dataset=Tokens("llama", 6), compute_metrics=count_metric,
                      callbacks=[OptimizerMemoryCallback()])
    trainer.train()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    training = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(evaluations) == 2 and len(training) == 2
    for entry in evaluations:
        assert entry["eval_containers_device_bytes"] == 6 * SEQ * VOCAB * 4 + 6 * SEQ * 8 + 6 * 4
        assert "eval_containers_host_bytes" in entry
        assert "eval_concat_peak_bytes" not in entry  # not in the short set
    for entry in training:
        assert not any(key.endswith(EVALUATION_KEYS) for key in entry)


def test_every_wrapper_is_removed_even_when_the_evaluation_raises(tmp_path: Any) -> None:
    cls = trainer_pt_utils.EvalLoopContainer
    add, flush = cls.add, cls.to_cpu_and_numpy

    def failing(prediction: Any) -> Dict[str, float]:
        raise RuntimeError("metrics failed")

    model = LlamaForCausalLM(llama_config())
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                                          per_device_eval_batch_size=4),
                      eval_dataset=Tokens("llama", 6), compute_metrics=failing,
                      callbacks=[OptimizerMemoryCallback()])
    with pytest.raises(RuntimeError, match="metrics failed"):
        trainer.evaluate()
    assert (cls.add, cls.to_cpu_and_numpy) == (add, flush)
    assert "forward" not in model.__dict__
    trainer.compute_metrics = count_metric
    logged = trainer.evaluate()  # the next one is measured afresh
    assert logged["eval_containers_device_bytes"] == 6 * SEQ * VOCAB * 4 + 6 * SEQ * 8 + 6 * 4
    assert (cls.add, cls.to_cpu_and_numpy) == (add, flush)
    assert "forward" not in model.__dict__


def test_a_failing_measurement_warns_once_and_leaves_the_keys_out(tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_memcb.training import evaluation_probe

    def broken(value: Any) -> Any:  # a fault injected into the walk: the loop must not notice
        raise RuntimeError("walk failed")

    monkeypatch.setattr(evaluation_probe, "device_blocks", broken)
    trainer = Trainer(model=LlamaForCausalLM(llama_config()),
                      args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                      eval_dataset=Tokens("llama", 6), compute_metrics=count_metric,
                      callbacks=[OptimizerMemoryCallback(eval_keys="all")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = trainer.evaluate(), trainer.evaluate()
    messages = [str(w.message) for w in caught if "containers failed" in str(w.message)]
    assert len(messages) == 1 and "walk failed" in messages[0]
    for logged in (first, second):
        assert logged["eval_seen"] == 6.0
        assert not any(f"eval_{key}" in logged for key in CONTAINER_KEYS)
        assert logged["eval_forward_peak_bytes"] > 0  # measured apart, still there


def test_evaluation_false_measures_nothing(tmp_path: Any) -> None:
    trainer = Trainer(model=LlamaForCausalLM(llama_config()),
                      args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                      eval_dataset=Tokens("llama", 6), compute_metrics=count_metric,
                      callbacks=[OptimizerMemoryCallback(eval_keys="all", evaluation=False)])
    logged = trainer.evaluate()
    assert not any(key.endswith(EVALUATION_KEYS) for key in logged)
    with pytest.raises(ValueError, match="evaluation='yes'"):
        OptimizerMemoryCallback(evaluation="yes")


def test_when_evaluation_holds_the_most_the_summary_report_and_tensorboard_say_so(tmp_path: Any,
                                                                                     capsys: Any) -> None:
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    from trainer_memcb.cli import main

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2,
                             per_device_eval_batch_size=8, max_steps=2, logging_steps=1, eval_strategy="steps",
                             eval_steps=2, report_to=["tensorboard"], disable_tqdm=True, save_strategy="no")
    # 64 samples of 96 x 12 fp32 logits: 294,912 bytes gathered, against a model of about 30,000 parameters.
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=Tokens("llama", 4),
                      eval_dataset=Tokens("llama", 64), compute_metrics=count_metric,
                      callbacks=[OptimizerMemoryCallback()])
    trainer.train()
    summary = json.loads((tmp_path / "optimizer_memory.json").read_text())
    phases = summary["phases"]
    assert (phases["phase"], phases["cause"]) == ("evaluation", "evaluation containers")
    assert summary["evaluation"]["containers_device_bytes"] == 64 * SEQ * VOCAB * 4 + 64 * SEQ * 8 + 64 * 4
    assert phases["evaluation_bytes"] == (phases["parts"]["model_states_bytes"] - phases["parts"]["model_grads_bytes"]
                                          + summary["evaluation"]["forward_peak_bytes"]
                                          + summary["evaluation"]["concat_peak_bytes"])
    assert phases["text"].startswith("Evaluation held the most")
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "Evaluation's memory, the largest evaluation" in out and "the logits its containers gathered" in out
    # The TensorBoard view: a chart of evaluation beside the training step, with both phases' tags.
    folder = next((tmp_path / "runs").iterdir())
    accumulator = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    accumulator.Reload()
    (point,) = accumulator.Tensors("custom_scalars__config__")[-1:]
    content = layout_pb2.Layout()
    content.ParseFromString(point.tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in content.category for chart in category.chart}
    assert charts
    # The default short set: evaluation entries carry the containers' device and host bytes. The
    # activations are measured from torch 2.8 on (it can say which saved-tensor hooks are active).
    activations = ["^train/activations_peak_bytes$"] if installed_version("torch") >= (2, 8) else []
    assert charts["eval: evaluation beside the training step (bytes)"] == [
        "^train/model_states_bytes$", *activations, "^eval/containers_device_bytes$"]
    assert charts["eval: evaluation's containers and forward (bytes)"] == [
        "^eval/containers_device_bytes$", "^eval/containers_host_bytes$"]
