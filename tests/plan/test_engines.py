"""The step plan per engine: FSDP2 against torch's FSDPMemTracker on the same fake step, DDP's
buckets, DeepSpeed ZeRO's partitions and buffers, and the settings they are read from."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import installed_version, requires_torch

from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.utils.units import format_bytes

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_reference import fsdp_memtracker_peak  # noqa: E402

BATCH, SEQ = 2, 16
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=256)
# The tiny Llama's parameters: embedding and head 2 x 16,384, two layers of 41,088, the final norm 64.
NUMEL = 115_008


def build():
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


# The model's buffers, in every plan's peak: the rotary embedding's inv_freq (32 bytes), and on
# transformers 5 its original_inv_freq too, a buffer there (an attribute on 4.57). The figures of
# these tests are transformers 5's, the real runs' (64 bytes); this is what the installed one adds.
def buffers_beyond_transformers_5s():
    return sum(b.numel() * b.element_size() for b in build().buffers()) - 64


def plan_with(settings):
    plan, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.problem is None, plan.step.problem
    assert sum(plan.step.peak_parts.values()) == plan.step.peak_bytes  # one moment: the parts sum to the peak
    return plan


@requires_torch("2.13", "torch 2.6's fake process group has no fake kernel for c10d._allgather_base_ (tried: the plan "
                "then says the step cannot run under fake tensors); 2.13's has")
@pytest.mark.parametrize("sharding,replicate", [("fsdp-full-shard", 1), ("fsdp-shard-grad-op", 1), ("fsdp-full-shard", 2)])
def test_fsdp2_peak_equals_fsdp_memtracker_on_the_same_fake_step(sharding, replicate):
    settings = resolve_settings(world_size=4, sharding=sharding, replicate=replicate, batch_size=BATCH,
                                optimizer="adamw_torch")
    plan = plan_with(settings)
    tracker = fsdp_memtracker_peak(build, settings, BATCH, SEQ)
    assert plan.settings.engine == "fsdp2"
    # The same moment, the same bytes: the tracker's total and the plan's differ only by the
    # 0-dim num_items_in_batch the plan passes as the Trainer does (4 bytes), which the tracker's
    # step makes inside its own window too but files among the inputs it was not told of.
    assert abs(plan.step.peak_bytes - tracker["Total"]) <= 4, (plan.step.peak_bytes, tracker)
    parts = plan.step.peak_parts
    assert parts["unsharded_parameters"] == tracker["_FSDPRefType.UNSHARDED_PARAM"]
    assert parts["engine_buffers"] == tracker["_FSDPRefType.ALL_GATHER"] + tracker["_FSDPRefType.REDUCE_SCATTER"]
    assert parts["optimizer_state"] == tracker["_FSDPRefType.OPT"]
    assert parts["parameters"] == tracker["_FSDPRefType.SHARDED_PARAM"]


@requires_torch("2.13", "torch 2.6's fake process group has no fake kernel for c10d._allgather_base_ (tried: the plan "
                "then says the step cannot run under fake tensors); 2.13's has")
def test_fsdp2_offload_leaves_the_host_s_parts_out_of_the_device_s_peak():
    settings = resolve_settings(world_size=2, sharding="fsdp-full-shard", fsdp_cpu_offload=True, batch_size=BATCH,
                                optimizer="adamw_torch")
    plan = plan_with(settings)  # the parts, the host's left out, sum to the peak
    alone = plan_with(resolve_settings(world_size=2, sharding="fsdp-full-shard", batch_size=BATCH,
                                       optimizer="adamw_torch"))
    assert set(plan.step.host_bytes) == {"parameters", "gradients", "optimizer_state"}
    assert plan.step.host_bytes["optimizer_state"] == alone.step.peak_parts["optimizer_state"]
    assert not {"parameters", "gradients", "optimizer_state"} & {k for k, v in plan.step.peak_parts.items() if v}


def test_a_torch_without_the_fake_collective_is_named_as_the_reason():
    # torch 2.6's fake process group has no fake kernel for the all-gather FSDP2 runs; 2.13's has.
    settings = resolve_settings(world_size=4, sharding="fsdp-full-shard", batch_size=BATCH, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu", model_states=False)
    if installed_version("torch") >= (2, 13):
        assert plan.step.problem is None
    else:
        assert plan.step.problem == (f"the step cannot run under fake tensors (this torch ({torch.__version__}) has no "
                                "fake kernel for the collective c10d._allgather_base_.default, which the "
                                "fsdp-full-shard step runs; torch 2.13 has one)")


@requires_torch("2.13", "the FSDP2 rows need torch 2.13's fake collectives (see above)")
def test_fsdp2_under_the_trainers_bf16_gathers_bf16_parameters_from_fp32_shards():
    # The Trainer's bf16=True on FSDP2: accelerate's MixedPrecisionPolicy(param_dtype=bf16,
    # reduce_dtype=bf16) beside autocast. Without the policy the plan gathered fp32 parameters:
    # 1,289,056 where a real run on 4 processes peaks at 828,512 (tests/training/test_engine_runs_wide.py).
    bf16 = plan_with(resolve_settings({"bf16": True, "fsdp": "full_shard"}, world_size=4, batch_size=BATCH,
                                      optimizer="adamw_torch"))
    fp32 = plan_with(resolve_settings(world_size=4, sharding="fsdp-full-shard", batch_size=BATCH,
                                      optimizer="adamw_torch"))
    assert (bf16.settings.engine, bf16.settings.precision) == ("fsdp2", "autocast-bf16")
    # The shards and AdamW's state stay fp32; the all-gather buffer (a layer's 41,088 values) and
    # the gathered parameters (the root's 32,832 values and a layer's) are bf16, half the fp32 row's.
    assert (bf16.step.peak_parts["parameters"], bf16.step.peak_parts["optimizer_state"]) == (NUMEL, 230_100)
    assert (fp32.step.peak_parts["engine_buffers"], bf16.step.peak_parts["engine_buffers"]) == (4 * 41_088, 2 * 41_088)
    assert (fp32.step.peak_parts["unsharded_parameters"], bf16.step.peak_parts["unsharded_parameters"]) == (
        4 * (32_832 + 41_088), 2 * (32_832 + 41_088))
    assert bf16.step.peak_bytes == 828_512
    assert any(note.startswith("FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)")
               for note in bf16.step.notes), bf16.step.notes
    assert not any("MixedPrecisionPolicy" in note for note in fp32.step.notes)


def test_ddp_buckets_are_a_second_copy_of_the_gradients_unless_they_are_the_gradients():
    beside = plan_with(resolve_settings(world_size=2, sharding="ddp", batch_size=BATCH, optimizer="adamw_torch"))
    view = plan_with(resolve_settings(world_size=2, sharding="ddp", gradient_as_bucket_view=True, batch_size=BATCH,
                                      optimizer="adamw_torch"))
    single = plan_with(resolve_settings(batch_size=BATCH, optimizer="adamw_torch"))
    assert beside.settings.engine == view.settings.engine == "ddp"
    # gradient_as_bucket_view=False: the buckets (4 bytes x every trainable value) beside .grad.
    assert beside.step.peak_parts["engine_buffers"] == 4 * NUMEL
    assert beside.step.peak_bytes == single.step.peak_bytes + 4 * NUMEL
    # True: the buckets are the gradients, alive from the wrapping on; at the backward's peak the
    # head's fresh gradient (256 x 64 values) is beside them, until it is copied into its view.
    assert "engine_buffers" not in view.step.peak_parts or view.step.peak_parts["engine_buffers"] == 0
    assert view.step.peak_parts["gradients"] == 4 * NUMEL + 256 * 64 * 4


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, True), (3, True)])
def test_zero_states_and_buffers_from_the_deepspeed_config(stage, overlap):
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, "overlap_comm": overlap,
                                                            "reduce_bucket_size": "auto"}}
    if stage == 3:  # the Trainer's "auto": 10 x hidden_size = 640 values; the five norms (64) stay whole
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = "auto"
    settings = resolve_settings(deepspeed=ds, world_size=2, hidden_size=64, batch_size=BATCH, optimizer="adamw_torch")
    assert settings.zero["reduce_bucket_size"] == 64 * 64  # the Trainer's "auto": hidden_size squared
    plan = plan_with(settings)
    parts = plan.step.peak_parts
    assert plan.settings.engine == "zero"
    # fp32 master partition: half of the 115,008 values on each of two ranks; AdamW's two moments of
    # it and one 4-byte step per param group (decay, no decay).
    assert parts["master_weights"] == 4 * NUMEL // 2
    assert parts["optimizer_state"] == 2 * 4 * NUMEL // 2 + 2 * 4
    assert plan.step.peak_phase == "optimizer step"
    # ZeRO-1/2 drop their reduce buckets at the end of backward (_release_ipg_buffers), so none is
    # alive at the step; ZeRO-3 keeps its one (made at init) throughout.
    buckets = 64 * 64 * 2 if stage == 3 else 0  # bf16 values
    assert parts.get("engine_buffers", 0) == buckets
    if stage < 3:
        assert parts["parameters"] == 2 * NUMEL  # ZeRO-1/2 keep every 16-bit parameter
    else:
        # Every parameter is its bf16 half (the flat `fp16_partitioned_groups_flat`). The five
        # 64-value norms, under the persistence threshold, are whole beside theirs between steps,
        # but not at the step: it releases them first (stage3.py `_partition_all_parameters`).
        assert parts["parameters"] == NUMEL // 2 * 2


def test_settings_from_training_args_json_and_deepspeed_config_with_flags_over_them(tmp_path):
    args_file = tmp_path / "training_args.json"
    args_file.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8, "bf16": True,
                                     "optim": "adamw_torch_fused", "max_grad_norm": 0.5, "gradient_checkpointing": True}))
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                   "bf16": {"enabled": "auto"},
                                   "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                         "stage3_prefetch_bucket_size": "auto",
                                                         "stage3_param_persistence_threshold": "auto"}}))
    settings = resolve_settings(str(args_file), deepspeed=str(ds_file), hidden_size=4096, world_size=8, batch_size=2)
    assert (settings.batch_size, settings.gradient_accumulation_steps, settings.precision, settings.optimizer,
            settings.max_grad_norm, settings.gradient_checkpointing, settings.sharding) == (
        2, 8, "deepspeed-bf16", "adamw_torch_fused", 0.5, True, "zero3")
    assert settings.zero["reduce_bucket_size"] == 4096 * 4096
    assert settings.zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert settings.zero["stage3_param_persistence_threshold"] == 40960
    assert settings.overlap_comm is True  # DeepSpeed's default for stage 3
    assert settings.sources["batch_size"] == "flag"
    assert settings.sources["gradient_accumulation_steps"] == "training args"
    assert settings.sources["sharding"] == "deepspeed config"
    assert settings.sources["zero.reduce_bucket_size"] == "deepspeed config auto (Trainer: from hidden_size)"
    # Neither file nor flag gives it: DeepSpeed's default, said so.
    assert dict((name, source) for name, _, source in settings.used())["zero.stage3_max_live_parameters"] == "default"


def test_the_trainers_arguments_on_several_processes_without_an_engine_config_run_ddp():
    args = {"per_device_train_batch_size": 2, "fsdp": "", "deepspeed": None}
    settings = resolve_settings(args, world_size=2)
    assert (settings.sharding, settings.sources["sharding"]) == (
        "ddp", "training args (Trainer: several processes, no deepspeed or fsdp)")
    # One process, an engine named by a flag or a config, or no Trainer arguments: as before.
    assert resolve_settings(args).sharding == "none"
    assert resolve_settings(world_size=2).sharding == "none"
    assert resolve_settings(args, world_size=2, sharding="fsdp-full-shard").sharding == "fsdp-full-shard"
    assert resolve_settings(args, world_size=2, deepspeed={"zero_optimization": {"stage": 2}}).sharding == "zero2"
    assert resolve_settings(args, world_size=2, fsdp_config={"reshard_after_forward": True}).sharding == "fsdp-full-shard"


def test_settings_refuse_pickles_unknown_flags_and_unfillable_autos(tmp_path):
    with pytest.raises(ValueError, match="only JSON is read"):
        resolve_settings(str(tmp_path / "training_args.bin"))
    with pytest.raises(ValueError, match=r"unknown settings \['bucket_size'\]"):
        resolve_settings(bucket_size=3)
    with pytest.raises(ValueError, match="reduce_bucket_size=\"auto\""):
        resolve_settings(deepspeed={"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}})


def test_fsdp_config_as_the_trainer_takes_it():
    settings = resolve_settings({"fsdp": "shard_grad_op offload"}, world_size=4)
    assert (settings.sharding, settings.reshard_after_forward, settings.fsdp_cpu_offload) == (
        "fsdp-shard-grad-op", False, True)
    settings = resolve_settings(fsdp_config={"reshard_after_forward": True, "cpu_offload": False}, world_size=4)
    assert (settings.sharding, settings.sources["sharding"]) == ("fsdp-full-shard", "fsdp config")
    assert (settings.gradient_checkpointing, settings.sources.get("gradient_checkpointing")) == (False, None)
    # FSDP's own activation checkpointing (accelerate wraps each layer), as the Trainer passes it.
    settings = resolve_settings(fsdp_config={"activation_checkpointing": "true", "version": 2}, world_size=4)
    assert (settings.gradient_checkpointing, settings.sources["gradient_checkpointing"]) == (True, "fsdp config")
    with pytest.raises(ValueError, match=r"fsdp config version=1: only FSDP2 \(version 2, the Trainer's default\)"):
        resolve_settings(fsdp_config={"version": 1}, world_size=4)


def test_plan_step_memory_reads_the_trainers_arguments_and_explicit_arguments_win():
    from transformers import TrainingArguments

    args = TrainingArguments("unused", report_to=[], per_device_train_batch_size=3, optim="adamw_torch",
                             max_grad_norm=0.0)
    plan, _ = plan_step_memory(build, seq_len=SEQ, args=args, device_type="cpu", model_states=False)
    used = {name: (value, source) for name, value, source in plan.settings.used}
    assert plan.settings.batch_size == 3 and used["batch_size"] == (3, "training args")
    assert used["optimizer"] == ("adamw_torch", "training args") and used["max_grad_norm"] == (0.0, "training args")
    plan, _ = plan_step_memory(build, seq_len=SEQ, args=args, batch_size=1, device_type="cpu", model_states=False)
    assert plan.settings.batch_size == 1 and dict((n, s) for n, _, s in plan.settings.used)["batch_size"] == "flag"


# The model-states table of a step plan, per engine: each state's most during the step and its
# figure at the optimizer step, from the same trace as the peak (4-byte fp32 values unless ZeRO's bf16).
ZERO_DS = {stage: {"bf16": {"enabled": True}, "zero_optimization": dict(
    {"stage": stage, "overlap_comm": stage > 1, "reduce_bucket_size": "auto"},
    **({"stage3_param_persistence_threshold": "auto"} if stage == 3 else {}))} for stage in (1, 2, 3)}
STATES_CASES = {
    # name: (settings, the most each state holds, the figures at the optimizer step where they differ)
    "none": (dict(), dict(parameters=4 * NUMEL, gradients=4 * NUMEL), {}),
    # gradient_as_bucket_view=False: the gradients and the buckets' copy of them, to the end of the step.
    "ddp": (dict(world_size=2, sharding="ddp"), dict(parameters=4 * NUMEL, gradients=8 * NUMEL), {}),
    # True: the buckets are the gradients; the head's fresh gradient (256 x 64 values) lives beside
    # them until it is copied into its bucket view.
    "ddp-view": (dict(world_size=2, sharding="ddp", gradient_as_bucket_view=True),
                 dict(parameters=4 * NUMEL, gradients=4 * NUMEL + 256 * 64 * 4), dict(gradients=4 * NUMEL)),
    # FSDP2 on 4: the shards (115,008 bytes), then in forward the root's unsharded parameters
    # (131,328: embedding, head, norm), both layers' (2 x 164,352, one prefetched) and one layer's
    # all-gather buffer (164,352). Gradients at layer 0's reduce-scatter: its input (164,352) and the
    # layer's unsharded gradients (164,352), the head's and the final norm's unsharded ones (65,792)
    # and layer 1's sharded ones (41,088). The optimizer step holds the shards alone.
    "fsdp-full-shard": (dict(world_size=4, sharding="fsdp-full-shard"),
                        dict(parameters=NUMEL + 131_328 + 3 * 164_352, gradients=2 * 164_352 + 65_792 + 41_088),
                        dict(parameters=NUMEL, gradients=NUMEL)),
    # Shard-grad-op: every layer stays unsharded from its forward on (460,032), and two all-gather
    # buffers meet.
    "fsdp-shard-grad-op": (dict(world_size=4, sharding="fsdp-shard-grad-op"),
                           dict(parameters=NUMEL + 4 * NUMEL + 2 * 164_352, gradients=2 * 164_352 + 65_792 + 41_088),
                           dict(parameters=NUMEL, gradients=NUMEL)),
    # ZeRO-1 on 2, no overlap_comm: every bf16 gradient whole (230,016) until the reduction, beside the
    # reduce bucket (64 x 64 bf16: 8,192) and the 16-bit gradient partition the first reduction makes
    # (115,072); at the step the partition and the decay group's fp32 gradient partition (57,344
    # values): the buckets are gone by then (`_release_ipg_buffers` at the end of backward).
    "zero1": (dict(deepspeed=ZERO_DS[1], world_size=2, hidden_size=64),
              dict(parameters=2 * NUMEL, gradients=2 * NUMEL + 8_192 + 115_072),
              dict(gradients=115_072 + 57_344 * 4)),
    # ZeRO-2 with overlap_comm: the two buckets are released at the end of backward, before the fp32
    # gradient partition is made; the most is at the step.
    "zero2": (dict(deepspeed=ZERO_DS[2], world_size=2, hidden_size=64),
              dict(parameters=2 * NUMEL, gradients=115_072 + 57_344 * 4), {}),
    # ZeRO-3: the bf16 halves and the whole norms (115,648), and in backward every other parameter gathered
    # beside its partition (229,376 bytes: each is reused within stage3_max_reuse_distance, so kept
    # whole from its forward to its backward); the 16-bit gradient partition (115,008), the bucket
    # and the fp32 gradient partition of one sub-group. At the step the partitions alone (115,008):
    # `_partition_all_parameters` releases the whole norms too (640 bytes).
    "zero3": (dict(deepspeed=ZERO_DS[3], world_size=2, hidden_size=64),
              dict(parameters=115_648 + 229_376, gradients=115_008 + 8_192 + 57_344 * 4), dict(parameters=115_008)),
}


@requires_torch("2.13", "the FSDP2 rows need torch 2.13's fake collectives (see above)")
@pytest.mark.parametrize("name", list(STATES_CASES))
def test_the_model_states_table_of_a_step_is_each_states_most_during_that_engines_step(name):
    from trainer_memcb.cli.plan_table import plan_tables
    from trainer_memcb.plan.step.timeline import MODEL_STATES
    from trainer_memcb.plan.answers.step_memory import states_during_step

    given, most, at_step = STATES_CASES[name]
    settings = resolve_settings(batch_size=BATCH, optimizer="adamw_torch", **given)
    plan, rules = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu")
    assert plan.step.problem is None and not hasattr(plan, "transient_bytes")
    zero = name.startswith("zero")
    # AdamW's two fp32 moments and a 4-byte step per tensor (21; ZeRO: per flat partition, 2) of
    # what this process steps over; ZeRO's fp32 master partition, half of the values.
    shards = {"fsdp-full-shard": 4, "fsdp-shard-grad-op": 4}.get(name, 2 if zero else 1)
    expected = dict(most, optimizer_state=8 * NUMEL // shards + 4 * (2 if zero else 21),
                    master_weights=4 * NUMEL // 2 if zero else 0)
    assert plan.step.model_states_most_bytes == expected
    assert plan.step.model_states_host_bytes == dict.fromkeys(MODEL_STATES, 0)
    assert plan.step.model_states_at_optimizer_step_bytes == dict(expected, **at_step)
    # The peak's parts, each in its state, never exceed the table's figures; a peak in the optimizer
    # step is the table's figures at the optimizer step, to the byte.
    peak = dict.fromkeys(MODEL_STATES, 0)
    for part, state in (("parameters", "parameters"), ("unsharded_parameters", "parameters"),
                        ("gradients", "gradients"), ("unsharded_gradients", "gradients"),
                        ("fp32_gradients", "gradients"), ("optimizer_state", "optimizer_state"),
                        ("master_weights", "master_weights")):
        peak[state] += plan.step.peak_parts.get(part, 0)
    buffers = plan.step.peak_parts.get("engine_buffers", 0)  # FSDP2's forward peak: one all-gather buffer
    peak["parameters" if name.startswith("fsdp") else "gradients"] += buffers
    assert all(peak[state] <= expected[state] for state in MODEL_STATES), (peak, expected)
    if plan.step.peak_phase == "optimizer step":
        assert peak == plan.step.model_states_at_optimizer_step_bytes
    # The table's row: those figures, their sum, the device's share, fits? from them.
    [row] = states_during_step(rules, plan).optimizers
    assert (row.params_bytes, row.grads_bytes, row.optimizer_state_bytes, row.master_weights_bytes) == tuple(
        expected[state] for state in MODEL_STATES)
    assert row.model_states_bytes == row.device_bytes == sum(expected.values()) and row.cpu_bytes == 0
    assert (row.engine, row.transient_bytes) == (plan.settings.engine, {})
    table = plan_tables(states_during_step(rules, plan))[1]
    cell = table.rows[0][2]
    if "gradients" in at_step:
        assert cell == (f"{format_bytes(expected['gradients'])} ({expected['gradients']:,}); "
                        f"{format_bytes(at_step['gradients'])} ({at_step['gradients']:,}) at the optimizer step")
    else:
        assert cell == f"{format_bytes(expected['gradients'])} ({expected['gradients']:,})"


@requires_torch("2.13", "the FSDP2 rows need torch 2.13's fake collectives (see above)")
def test_the_model_states_table_of_an_offloaded_fsdp2_step_puts_the_shards_on_the_host():
    from trainer_memcb.plan.answers.step_memory import states_during_step

    settings = resolve_settings(world_size=4, sharding="fsdp-full-shard", fsdp_cpu_offload=True, batch_size=BATCH,
                                optimizer="adamw_torch")
    plan, rules = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu")
    # On the host: the shards, their gradients and the state; on the device what FSDP2 gathers
    # (as the full shard's row above, less the shards) and the unsharded gradients with the
    # reduce-scatter input.
    assert plan.step.model_states_host_bytes == dict(parameters=NUMEL, gradients=NUMEL, optimizer_state=230_100,
                                                master_weights=0)
    assert plan.step.model_states_most_bytes == dict(parameters=131_328 + 3 * 164_352,
                                                gradients=2 * 164_352 + 65_792, optimizer_state=0, master_weights=0)
    [row] = states_during_step(rules, plan).optimizers
    assert (row.cpu_bytes, row.device_bytes) == (2 * NUMEL + 230_100, 131_328 + 3 * 164_352 + 2 * 164_352 + 65_792)


def test_states_during_step_docstring_example_runs():
    import doctest

    from trainer_memcb.plan.answers import step_memory

    [test] = doctest.DocTestFinder().find(step_memory.states_during_step, "states_during_step",
                                          globs=vars(step_memory).copy())
    result = doctest.DocTestRunner().run(test)
    assert result.attempted >= 5 and result.failed == 0


def test_zero2_offload_keeps_its_partitions_and_staging_on_the_host_and_the_peak_on_the_device():
    # deepspeed 0.19.8's DeepSpeedZeroOptimizer with offload_optimizer (torch AdamW as the client
    # optimizer): on the host the fp32 master partition, AdamW's state of it, the fp32 gradient
    # partition kept between steps, and the offload buffers: the partition's bf16 copy (115,008) and
    # a staging buffer of the largest parameter (16,384 bf16 values: 32,768).
    ds = {"bf16": {"enabled": True}, "zero_force_ds_cpu_optimizer": False,
          "zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_bucket_size": "auto",
                                "offload_optimizer": {"device": "cpu"}}}
    settings = resolve_settings(deepspeed=ds, world_size=2, hidden_size=64, batch_size=BATCH, optimizer="adamw_torch")
    plan = plan_with(settings)
    assert plan.step.host_bytes == {"master_weights": 4 * NUMEL // 2, "optimizer_state": 2 * 4 * NUMEL // 2 + 2 * 4,
                               "fp32_gradients": 4 * NUMEL // 2, "offload_buffers": 2 * NUMEL // 2 + 32_768}
    # The optimizer steps on the host, its temporaries there too: the device's peak is in backward,
    # where the bf16 parameters, the activations and the device staging buffer (32,768) meet the
    # head's backward, its gradient made (2 x 32,768 among the temporaries at that moment); the
    # bucket (8,192) is not there yet: DeepSpeed makes it at the first gradient's hook
    # (`process_gradients` → `setup_buckets`), made at the start of backward it was (553,036, now
    # 544,844).
    assert plan.step.peak_phase == "backward"
    buffers = buffers_beyond_transformers_5s()
    assert plan.step.peak_bytes == plan.step.forward_backward_peak_bytes == 544_844 + buffers > plan.step.optimizer_step_peak_bytes
    assert plan.step.peak_parts["parameters"] == 2 * NUMEL and plan.step.peak_parts["engine_buffers"] == 32_768
    assert plan.step.peak_parts["other"] >= 2 * 32_768
    assert not set(plan.step.host_bytes) & set(plan.step.peak_parts)


def test_zero3_offload_counts_the_16_bit_partitions_where_deepspeed_makes_them():
    # deepspeed 0.19.8 stage 3: with offload_optimizer, `grad_partitions_flat_buffer` is made on
    # `self.device`, the CPU; with offload_param too, every 16-bit parameter partition lives in a flat
    # host buffer (`_create_param_groups_fp16_flat_cpu_memory`), a parameter on the device only while
    # gathered. Of the tiny Llama's 115,008 fp32 values each partition holds half: 57,504 x 4 bytes.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist_scripts"))
    from zero_step_profile import ds_config  # the real runs' own configs

    def zero3(offload_param):
        ds = ds_config(3, True, offload=True, offload_param=offload_param)
        return plan_with(resolve_settings(deepspeed=ds, world_size=2, batch_size=BATCH, optimizer="adamw_torch"))

    both, optimizer_only = zero3(True), zero3(False)
    partition = 4 * NUMEL // 2
    assert optimizer_only.step.host_bytes["offload_buffers"] == partition  # the 16-bit gradient partition
    assert both.step.host_bytes["offload_buffers"] == 2 * partition  # and the parameters' partitions
    buffers = buffers_beyond_transformers_5s()
    assert both.step.peak_bytes == optimizer_only.step.peak_bytes - partition == 906_956 + buffers
    # The model-states table files the host's partitions under their states.
    assert both.step.model_states_host_bytes["parameters"] == partition
    assert both.step.model_states_host_bytes["gradients"] == optimizer_only.step.model_states_host_bytes["gradients"] == 2 * partition
    # The same storages at the same moment, filed by where they live (on the CPU, one memory: the
    # real run of the pair reads their sum, tests/training/test_zero_runs_more.py).
    assert both.step.peak_bytes + sum(both.step.host_bytes.values()) == \
        optimizer_only.step.peak_bytes + sum(optimizer_only.step.host_bytes.values()) == 2_287_060 + buffers
