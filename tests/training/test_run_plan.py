"""`plan_for_trainer`: the step plan of a run's own settings, from the live model, its arguments and
one batch's shapes, equal to the byte to `plan_step_memory` asked for the same settings directly,
and the live model left exactly as it was."""

from __future__ import annotations

import doctest

import pytest
import torch
from transformers import DistilBertForSequenceClassification

import trainer_memcb.training.run_plan as run_plan
from helpers import tiny_classifier, training_args
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.training.run_plan import batch_dims, plan_for_trainer, plan_reserved_bytes, trained_module


def direct_plan(model: torch.nn.Module, optim: str, batch_size: int = 4, seq_len: int = 8, **settings):
    """The plan asked for directly: the model built from its config on the meta device, the
    settings given as plain arguments (no TrainingArguments, no stand-in)."""
    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return DistilBertForSequenceClassification(model.config)

    plan, _ = plan_step_memory(build, batch_size=batch_size, seq_len=seq_len, optimizer=optim, device_type="cpu",
                               **settings)
    return plan


def test_the_runs_plan_equals_the_plan_asked_for_directly_to_the_byte(tmp_path):
    model = tiny_classifier()
    args = training_args(str(tmp_path))
    plan = plan_for_trainer(model, args, {"input_ids": torch.zeros(4, 8, dtype=torch.long), "labels": torch.zeros(4)})
    direct = direct_plan(model, args.optim.value)
    assert plan.step.problem is None and (plan.settings.batch_size, plan.settings.seq_len, plan.settings.engine) == (4, 8, "none")
    assert plan.step.peak_bytes == direct.step.peak_bytes
    assert plan.step.peak_parts == direct.step.peak_parts


def test_the_batchs_shapes_override_the_arguments_batch_and_checkpointing_comes_from_them(tmp_path):
    model = tiny_classifier()
    args = training_args(str(tmp_path), per_device_train_batch_size=2, gradient_checkpointing=True)
    plan = plan_for_trainer(model, args, {"input_ids": (3, 6)})
    direct = direct_plan(model, args.optim.value, batch_size=3, seq_len=6, gradient_checkpointing=True)
    assert (plan.settings.batch_size, plan.settings.seq_len, plan.settings.gradient_checkpointing) == (3, 6, True)
    assert plan.step.peak_bytes == direct.step.peak_bytes


def test_the_live_model_is_left_as_it_was(tmp_path):
    """The stand-in gets its own config: preparing it as the Trainer does (use_cache, the attention
    path, checkpointing) changes nothing of the model being trained, which gains no hook."""
    model = tiny_classifier()
    model.config.use_cache = True
    attention = model.config._attn_implementation
    params = [(name, param.data_ptr(), param.requires_grad) for name, param in model.named_parameters()]
    plan_for_trainer(model, training_args(str(tmp_path), gradient_checkpointing=True), {"input_ids": (4, 8)})
    assert model.config.use_cache is True and model.config._attn_implementation == attention
    assert [(name, param.data_ptr(), param.requires_grad) for name, param in model.named_parameters()] == params
    assert model.training and "forward" not in model.__dict__
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())
    assert not any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def test_a_seq_len_given_serves_when_no_batch_says_it(tmp_path):
    model = tiny_classifier()
    args = training_args(str(tmp_path))
    assert plan_for_trainer(model, args, seq_len=8).step.peak_bytes == direct_plan(model, args.optim.value).step.peak_bytes
    with pytest.raises(ValueError, match="takes tokens: give --seq-len"):
        plan_for_trainer(model, args)


def test_batch_dims_reads_each_kind_of_batch():
    assert batch_dims({"input_ids": (2, 16), "attention_mask": (2, 16), "labels": (2, 16)}) == {
        "batch_size": 2, "seq_len": 16}
    assert batch_dims({"inputs_embeds": (2, 5, 64)}) == {"batch_size": 2, "seq_len": 5}
    assert batch_dims({"input_ids": (2, 16), "decoder_input_ids": (2, 7), "labels": (2, 7)}) == {
        "batch_size": 2, "seq_len": 16, "target_len": 7}
    assert batch_dims({"input_features": (3, 80, 3000), "labels": (3, 12)}) == {"batch_size": 3, "target_len": 12}
    assert batch_dims({"pixel_values": (2, 3, 224, 200)}) == {}  # not square: the config's size is planned
    assert batch_dims({"labels": "not a shape"}) == {}


def test_the_trained_module_is_found_inside_the_compile_wrapper():
    model = torch.nn.Linear(2, 2)
    assert trained_module(torch.compile(model, backend="eager")) is model
    holder = torch.nn.Module()
    holder.module = model  # DDP and DeepSpeed's engine hold the model as `module`
    assert trained_module(holder) is model


def test_the_planned_reserved_bytes_are_the_allocators_replay_on_cuda_and_none_on_the_cpu(tmp_path):
    args, batch = training_args(str(tmp_path)), {"input_ids": (4, 8)}
    assert plan_reserved_bytes(plan_for_trainer(tiny_classifier(), args, batch, device_type="cpu")) is None
    cuda = plan_for_trainer(tiny_classifier(), args, batch, device_type="cuda")
    # The replay reserves whole segments (2 MiB small-pool ones at least), above the allocated peak.
    assert cuda.device.reserved_peak_bytes % (2 * 1024 ** 2) == 0 and cuda.device.reserved_peak_bytes >= cuda.step.peak_bytes
    assert plan_reserved_bytes(cuda) == cuda.device.reserved_peak_bytes


def test_docstring_examples_run():
    results = doctest.testmod(run_plan)
    assert (results.failed, results.attempted) == (0, 10)
