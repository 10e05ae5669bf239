"""Gradient accumulation in the step plan: the micro-batches after the first traced with the
gradients alive, as each engine keeps them (the tiny Llama of test_engines.py, fp32, batch 2 x 16,
on the CPU). The same figures against real runs: tests/training/test_accumulation_runs.py."""

from __future__ import annotations

import json

import pytest
import transformers
import torch
from transformers import TrainingArguments

from helpers import requires_torch
from test_engines import build

from trainer_memcb.cli import main
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.trace import traced_micro_batches

# The exact figures here were counted on torch 2.13 and transformers 5. On transformers 4.57 the
# models hold 16 to 32 bytes of buffers more or less (rotary's original_inv_freq is an attribute
# there) and torch 2.6's fake process group cannot run FSDP2's all-gather, so the oldest pass does
# not hold these figures (tests/plan/test_engines.py computes that difference for its own).
pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
    or int(transformers.__version__.split(".")[0]) < 5,
    reason="figures counted on torch 2.13 and transformers 5; the oldest releases differ by model buffers")


GRADIENTS = 460_032  # the tiny Llama's fp32 gradients, every parameter's
# One micro-batch's batch: int64 input_ids, attention_mask and labels, 2 x 16 (x 4 at 64 tokens).
# The Trainer fetches every micro-batch of a step before the first runs and keeps them to its end
# (`get_batch_samples`), so each micro-batch after the first adds one to every peak of the step.
MICRO_BATCH, MICRO_BATCH_64 = 3 * 2 * 16 * 8, 3 * 2 * 64 * 8
AUTO_ZERO = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
             "stage3_param_persistence_threshold": "auto"}


def plan(seq_len=16, **flags):
    deepspeed = flags.pop("deepspeed", None)
    settings = resolve_settings(deepspeed=deepspeed, hidden_size=64, batch_size=2, optimizer="adamw_torch", **flags)
    step, _ = plan_step_memory(build, seq_len=seq_len, settings=settings, device_type="cpu", model_states=False)
    assert step.step.problem is None, step.step.problem
    assert sum(step.step.peak_parts.values()) == step.step.peak_bytes
    return step


def test_the_traced_micro_batches_are_the_first_the_second_and_the_last():
    assert [traced_micro_batches(n) for n in (1, 2, 3, 4, 16)] == [(1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 16)]
    for bad in (0, -1, True, 2.0, "4"):
        with pytest.raises(ValueError, match="gradient_accumulation_steps=.*at least 1"):
            traced_micro_batches(bad)


def test_one_process_peaks_in_the_second_micro_batch_with_every_gradient_alive():
    single = plan()
    assert (single.step.peak_bytes, single.step.peak_phase, single.step.peak_micro_batch) == (2_004_888, "optimizer step", None)
    assert (single.settings.gradient_accumulation_steps, single.step.micro_batch_peak_bytes) == (1, [])
    two, four = plan(gradient_accumulation_steps=2), plan(gradient_accumulation_steps=4)
    # The first micro-batch is the step without accumulation (its forward and backward, the
    # optimizer state alive); the second and every later one holds every gradient beside it.
    assert two.step.micro_batch_peak_bytes == [[1, 1_849_248 + MICRO_BATCH], [2, 2_270_752 + MICRO_BATCH]]
    assert four.step.micro_batch_peak_bytes == [[1, 1_849_248 + 3 * MICRO_BATCH], [2, 2_270_752 + 3 * MICRO_BATCH],
                                           [4, 2_270_752 + 3 * MICRO_BATCH]]
    assert single.step.forward_backward_peak_bytes == 1_849_248
    for step, others in ((two, 1), (four, 3)):
        assert (step.step.peak_bytes, step.step.peak_phase, step.step.peak_micro_batch) == (2_270_752 + others * MICRO_BATCH,
                                                                             "backward", 2)
        assert step.step.peak_parts["gradients"] == GRADIENTS
        # Every micro-batch's batch (the running one's input_ids, saved for backward, are
        # activations then) and the model's buffers (64 bytes).
        assert step.step.peak_parts["batch_and_buffers"] == 2 * 256 + others * MICRO_BATCH + 64
    assert four.step.optimizer_step_peak_bytes == single.step.optimizer_step_peak_bytes + 3 * MICRO_BATCH


def test_ddp_accumulates_beside_its_buckets_with_or_without_the_bucket_view():
    # Under no_sync the reducer's hooks do nothing: the gradients are fresh tensors beside the
    # buckets until the last micro-batch copies them in (the view then makes them the buckets).
    plain = plan(world_size=2, sharding="ddp", gradient_accumulation_steps=2)
    view = plan(world_size=2, sharding="ddp", gradient_as_bucket_view=True, gradient_accumulation_steps=2)
    assert plain.step.peak_bytes == view.step.peak_bytes == 2_730_784 + MICRO_BATCH
    assert plan(world_size=2, sharding="ddp", gradient_as_bucket_view=True).step.peak_bytes == 2_270_752
    assert plain.step.peak_micro_batch == view.step.peak_micro_batch == 2
    assert view.step.peak_parts["gradients"] == 2 * GRADIENTS  # the buckets and the gradients beside them


@requires_torch("2.13", "the FSDP2 plan needs torch 2.13's fake collectives (tests/plan/test_engines.py)")
def test_fsdp2_keeps_the_first_micro_batchs_gradients_unsharded():
    single = plan(world_size=2, sharding="fsdp-full-shard")
    step = plan(world_size=2, sharding="fsdp-full-shard", gradient_accumulation_steps=2)
    assert (single.step.peak_bytes, step.step.peak_bytes, step.step.peak_micro_batch) == (1_621_792, 1_966_880 + MICRO_BATCH, 2)
    # The first micro-batch reduce-scatters nothing (set_requires_gradient_sync(False)).
    assert step.step.micro_batch_peak_bytes == [[1, 1_589_024 + MICRO_BATCH], [2, 1_966_880 + MICRO_BATCH]]
    assert step.step.peak_parts["unsharded_gradients"] == GRADIENTS


@pytest.mark.parametrize("stage, single, accumulating, micro_batch", [
    (1, 2_839_252, 3_315_668 + MICRO_BATCH_64, 2),  # whole gradients until the boundary, and the bucket kept
    (2, 2_839_252, 3_069_396 + MICRO_BATCH_64, 2),  # the first micro-batch's gradient partition kept
    (3, 3_315_668, 3_315_668 + MICRO_BATCH_64, 1),  # accumulated in place in the gradient partition
])
def test_zero_keeps_the_gradients_between_micro_batches_its_way(stage, single, accumulating, micro_batch):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": dict(AUTO_ZERO if stage == 3 else {"reduce_bucket_size": "auto"}, stage=stage,
                                        overlap_comm=stage == 3)}
    step = plan(seq_len=64, world_size=2, deepspeed=config)
    assert (step.settings.gradient_accumulation_steps, step.step.peak_bytes, step.step.peak_micro_batch) == (2, accumulating, micro_batch)
    assert plan(seq_len=64, world_size=2, deepspeed=dict(config, gradient_accumulation_steps=1)).step.peak_bytes == single
    if stage == 2:
        assert step.step.peak_parts["gradients"] == 230_144  # rank 0's partition (its gradients' values)


def test_the_accumulation_is_read_from_the_trainers_arguments_and_the_deepspeed_config():
    args = TrainingArguments("unused", report_to=[], use_cpu=True, gradient_accumulation_steps=4)
    settings = resolve_settings(args)
    assert (settings.gradient_accumulation_steps, settings.sources["gradient_accumulation_steps"]) == (4, "training args")
    # "auto" is the Trainer's: the arguments' value; a number in the config wins.
    auto = resolve_settings(args, deepspeed={"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}})
    assert auto.gradient_accumulation_steps == 4
    given = resolve_settings(args, deepspeed={"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}})
    assert (given.gradient_accumulation_steps, given.sources["gradient_accumulation_steps"]) == (2, "deepspeed config")


def test_the_command_line_flag(tiny_llama_dir, capsys):
    common = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16",
              "--attn-implementation", "sdpa", "--device-type", "cpu"]
    assert main(common + ["--gradient-accumulation-steps", "4", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    settings, step = document["settings"], document["step"]
    assert (settings["gradient_accumulation_steps"], step["peak_micro_batch"], step["peak_bytes"]) == \
        (4, 2, 2_270_752 + 3 * MICRO_BATCH)
    assert ["gradient_accumulation_steps", 4, "flag"] in settings["used"]
    assert main(common + ["--gradient-accumulation-steps", "4"]) == 0
    assert "in the backward of micro-batch 2 of 4" in capsys.readouterr().out
    for bad in ("0", "-2", "two"):
        assert main(common + ["--gradient-accumulation-steps", bad]) == 2
        error = capsys.readouterr().err
        assert f"--gradient-accumulation-steps: {bad!r} is not a positive integer" in error
        assert "Traceback" not in error
    # A step-plan option: refused without the step plan.
    assert main(["estimate", tiny_llama_dir, "--gradient-accumulation-steps", "4"]) == 2
    assert "--gradient-accumulation-steps has no effect without --batch-size or --max-batch-size" in capsys.readouterr().err


def test_zero2_with_offload_accumulates_in_host_buffers_of_the_partitions_parameters():
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": "auto", "offload_optimizer": {"device": "cpu"}}}
    single = plan(seq_len=64, world_size=2, deepspeed=dict(config, gradient_accumulation_steps=1))
    step = plan(seq_len=64, world_size=2, deepspeed=dict(config, gradient_accumulation_steps=2))
    # `accumulated_grads_in_cpu`: each of rank 0's partition's parameters whole (230,144 bytes), on
    # the host; the device's peak is the same but for the second micro-batch's batch (the gradients
    # leave for the host as they are reduced).
    assert step.step.host_bytes["offload_buffers"] - single.step.host_bytes["offload_buffers"] == 230_144
    assert (single.step.peak_bytes, step.step.peak_bytes) == (2_214_732, 2_214_732 + MICRO_BATCH_64)
