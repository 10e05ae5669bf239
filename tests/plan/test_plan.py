"""The model-states plan: hand-computed layouts, the ZeRO paper's Table 1, accelerate's estimate, the CLI,
and ZeRO-3's partitioned parameters (item: ds_shape). DeepSpeed's estimators stand beside the
engine-traced step plan in tests/plan/test_engine_references_7b.py."""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import trainer_memcb.plan.answers.model_states
import trainer_memcb.plan.model.param_shapes
import trainer_memcb.plan.answers.sharding
from trainer_memcb.cli import main
from trainer_memcb.plan.answers.model_states import layout_model_states, param_specs, plan_model_states
from trainer_memcb.plan.settings.setup import Setup
from trainer_memcb.utils.units import parse_bytes
from trainer_memcb.plan.answers.sharding import fsdp_local_shape, fsdp_padded_shard_numel, zero12_gradient_numel
from trainer_memcb.plan.optimizers.whatif import what_if

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b")


def load_references():
    spec = importlib.util.spec_from_file_location("references", os.path.join(REPO_ROOT, "benchmarks", "references.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def two_layers() -> nn.Module:
    # Weights 7x4 and 3x7, biases 7 and 3: 28 + 7 + 21 + 3 = 59 values in 4 tensors.
    return nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3))


def adamw(values: int, tensors: int, element_size: int = 4) -> int:
    return 2 * values * element_size + 4 * tensors  # exp_avg, exp_avg_sq, a 4-byte step each


@pytest.mark.parametrize("module", [trainer_memcb.plan.answers.model_states, trainer_memcb.plan.model.param_shapes,
                                    trainer_memcb.plan.answers.sharding, trainer_memcb.utils.units])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted >= 1 and result.failed == 0


def test_one_process_and_ddp_hold_everything_whole():
    for sharding in ("none", "ddp"):
        (entry,) = plan_model_states(two_layers(), "adamw", Setup(world_size=2, sharding=sharding)).optimizers
        assert (entry.params_bytes, entry.grads_bytes, entry.master_weights_bytes) == (59 * 4, 59 * 4, 0)
        assert entry.optimizer_state_bytes == adamw(59, 4) == 488
        assert entry.model_states_bytes == entry.device_bytes == 236 + 236 + 488
        assert entry.cpu_bytes == entry.cpu_bytes_per_node == 0


def test_frozen_parameters_count_as_parameters_only():
    model = two_layers()
    model[0].requires_grad_(False)
    (entry,) = plan_model_states(model, "adamw", Setup()).optimizers
    assert (entry.params_bytes, entry.grads_bytes, entry.optimizer_state_bytes) == (236, 24 * 4, adamw(24, 2))


def test_a_margin_of_exactly_zero_fits_and_one_byte_less_does_not():
    # `fits` is `device_bytes <= device_memory`: memory equal to the device bytes fits, margin 0.
    (entry,) = plan_model_states(two_layers(), "adamw", Setup()).optimizers
    assert entry.device_bytes == 236 + 236 + 488 and (entry.fits, entry.margin_bytes) == (None, None)
    for memory, fits, margin in ((960, True, 0), (959, False, -1), (961, True, 1)):
        (entry,) = plan_model_states(two_layers(), "adamw", Setup(), device_memory=memory).optimizers
        assert (entry.fits, entry.margin_bytes) == (fits, margin)
    # The same with a frozen reference model beside it: its 236 bytes of parameters on the device too.
    for memory, fits, margin in ((1196, True, 0), (1195, False, -1)):
        (entry,) = plan_model_states(two_layers(), "adamw", Setup(), device_memory=memory,
                                     reference_model=True).optimizers
        assert (entry.device_bytes, entry.fits, entry.margin_bytes) == (1196, fits, margin)


def test_bnb_8bit_plans_embeddings_in_32bit_as_the_trainer_registers_them():
    # With optim="adamw_bnb_8bit" the Trainer registers nn.Embedding weights for 32-bit state.
    pytest.importorskip("bitsandbytes")
    model = nn.Sequential(nn.Embedding(128, 64), nn.Linear(64, 64))
    (entry,) = plan_model_states(model, "adamw_bnb_8bit", Setup()).optimizers
    # Embedding, 8,192 values: 32-bit, 8N. Weight, 4,096 values: 8-bit, 2N + 2 x 4 x 16 block scales.
    # Bias, 64 values (under min_8bit_size): 8N. The two shared quantization maps: 2 x 1,024.
    assert entry.optimizer_state_bytes == 8 * 8192 + (2 * 4096 + 8 * 16) + 8 * 64 + 2 * 1024 == 76_416
    # Under FSDP on 2 processes (the plan's stand-in shards): the embedding's 4,096-value shard is
    # still 32-bit; the weight's 2,048 and the bias's 32 are under min_8bit_size.
    (sharded,) = plan_model_states(model, "adamw_bnb_8bit", Setup(world_size=2, sharding="fsdp-full-shard")).optimizers
    assert sharded.optimizer_state_bytes == 8 * 4096 + 8 * 2048 + 8 * 32 + 2 * 1024 == 51_456


def test_fsdp_pads_every_shard_to_ceil_rows_over_w_and_the_first_rank_steps_over_the_most():
    # Rows 7 -> 4 per rank, 3 -> 2: padded shards 4x4 + 4 + 2x7 + 2 = 36 values on every rank.
    for sharding in ("fsdp-full-shard", "fsdp-shard-grad-op"):
        (entry,) = plan_model_states(two_layers(), "adamw", Setup(world_size=2, sharding=sharding)).optimizers
        assert (entry.params_bytes, entry.grads_bytes) == (36 * 4, 36 * 4)
        assert entry.optimizer_state_bytes == adamw(36, 4) == 304  # the FSDP2 job's first rank
    # Shard-grad-op also holds the all-gathered parameters from forward to backward: 2 padded shards.
    assert entry.transient_bytes == {"unsharded_params_bytes": 2 * 36 * 4}
    (offloaded,) = plan_model_states(two_layers(), "adamw", Setup(world_size=4, nodes=2, sharding="fsdp-full-shard",
                                                                   offload_params=True)).optimizers
    # 7 -> 2 rows, 3 -> 1: 8 + 2 + 7 + 1 = 18 values; everything on the CPU, 2 processes a node.
    assert offloaded.device_bytes == 0
    assert offloaded.cpu_bytes == 18 * 4 * 2 + adamw(18, 4) and offloaded.cpu_bytes_per_node == 2 * offloaded.cpu_bytes


def test_fsdp_takes_a_0_dim_parameter_as_one_row():
    assert fsdp_local_shape((), world_size=4) == (1,)
    assert fsdp_padded_shard_numel((), world_size=4) == 1
    assert fsdp_local_shape((7, 4), world_size=2) == (4, 4) and fsdp_local_shape((3,), world_size=4) == (1,)


def test_zero_partitions_follow_deepspeed():
    ds = "deepspeed-bf16"
    # ZeRO-1/2 over the Trainer's two groups: weights 28 + 21 = 49 values padded to 52 (a multiple of
    # 2 x 2), 26 a rank; biases 7 + 3 = 10 padded to 12, 6 a rank.
    (zero1,) = plan_model_states(two_layers(), "adamw", Setup(world_size=2, sharding="zero1", precision=ds)).optimizers
    assert zero1.params_bytes == (52 + 12) * 2
    # The gradients, as runs show them: every parameter that overlaps the partition, whole, plus
    # the padding zeros. Rank 0: the 28-value weight and the 7-value bias (35); rank 1: both weights,
    # 3 zeros, both biases and 2 zeros (64), the fullest.
    assert [zero12_gradient_numel([[28, 21], [7, 3]], 2, rank) for rank in (0, 1)] == [35, 64]
    assert zero1.grads_bytes == 64 * 2
    assert (zero1.optimizer_state_bytes, zero1.master_weights_bytes) == (adamw(32, 2), 32 * 4)
    assert zero1.transient_bytes == {"fp32_grad_partition_bytes": 26 * 4}  # one group's at a time
    (zero2,) = plan_model_states(two_layers(), "adamw", Setup(world_size=2, sharding="zero2", precision=ds)).optimizers
    assert (zero2.params_bytes, zero2.grads_bytes) == (128, 128)  # DeepSpeedZeroOptimizer: as ZeRO-1
    # All in one group: 59 values padded to 60, 30 a rank; rank 0 touches 28 + 7, rank 1 7 + 21 + 3 + 1.
    (one,) = plan_model_states(two_layers(), "adamw", Setup(world_size=2, sharding="zero2", precision=ds),
                               param_groups="one").optimizers
    assert (one.params_bytes, one.grads_bytes, one.master_weights_bytes) == (60 * 2, 35 * 2, 30 * 4)
    layout = layout_model_states(param_specs(two_layers()), Setup(world_size=2, sharding="zero2", precision=ds), rank=1)
    assert layout.grads_bytes == 32 * 2
    whole = layout_model_states(param_specs(two_layers()), Setup(world_size=2, sharding="zero1", precision=ds),
                                whole_zero_grads=True)  # BF16_Optimizer
    assert whole.grads_bytes == 59 * 2
    with pytest.raises(ValueError, match="param_groups='two' is not one of: trainer, one"):
        plan_model_states(two_layers(), "adamw", Setup(), param_groups="two")
    with pytest.raises(ValueError, match="rank=2: expected 0 to 1"):
        layout_model_states(param_specs(two_layers()), Setup(world_size=2, sharding="zero2"), rank=2)
    # A raw parameter count has no boundaries: as in the ZeRO paper, whole under P_os, partitioned under P_os+g.
    for sharding, grad_numel in (("zero1", 59), ("zero2", 30)):
        (counted,) = plan_model_states(59, "adamw", Setup(world_size=2, sharding=sharding, precision=ds)).optimizers
        assert counted.grads_bytes == grad_numel * 2
    # ZeRO-3: ceil(numel / 2) of each: 14 + 4 + 11 + 2 = 31, in one sub-group per param group.
    (zero3,) = plan_model_states(two_layers(), "adamw", Setup(world_size=2, sharding="zero3", precision=ds)).optimizers
    assert (zero3.params_bytes, zero3.grads_bytes, zero3.master_weights_bytes) == (31 * 2, 31 * 2, 31 * 4)
    assert zero3.optimizer_state_bytes == adamw(31, 2)
    # Offload: optimizer state and master weights on the CPU; ZeRO-3 parameters too.
    (offload,) = plan_model_states(two_layers(), "adamw", Setup(world_size=2, sharding="zero3", precision=ds,
                                                                 offload_optimizer=True, offload_params=True)).optimizers
    assert offload.device_bytes == 31 * 2 and offload.cpu_bytes == 31 * 2 + adamw(31, 2) + 31 * 4
    assert offload.cpu_bytes_per_node == 2 * offload.cpu_bytes


def test_precisions():
    model = two_layers()
    fp32 = plan_model_states(model, "adamw", Setup(precision="fp32")).optimizers[0]
    for autocast in ("autocast-bf16", "autocast-fp16"):  # the Trainer's bf16=True: weights stay fp32
        assert plan_model_states(model, "adamw", Setup(precision=autocast)).optimizers[0] == fp32
    bf16 = plan_model_states(model, "adamw", Setup(precision="bf16")).optimizers[0]
    assert (bf16.params_bytes, bf16.grads_bytes, bf16.optimizer_state_bytes, bf16.master_weights_bytes) == (
        118, 118, adamw(59, 4, element_size=2), 0)
    stage0 = plan_model_states(model, "adamw", Setup(precision="deepspeed-fp16")).optimizers[0]
    assert (stage0.params_bytes, stage0.optimizer_state_bytes, stage0.master_weights_bytes) == (118, adamw(59, 1), 236)


@pytest.mark.parametrize("kwargs, message", [
    ({"sharding": "zero4"}, "sharding='zero4' is not one of"),
    ({"precision": "fp8"}, "precision='fp8' is not one of"),
    ({"world_size": 0}, "world_size=0: expected a whole number"),
    ({"world_size": 6, "nodes": 4}, "world_size=6 is not a multiple of nodes=4"),
    ({"sharding": "fsdp-full-shard", "precision": "deepspeed-bf16"}, "is DeepSpeed's"),
    ({"sharding": "ddp", "offload_optimizer": True}, "offload_optimizer is DeepSpeed ZeRO's"),
    ({"sharding": "zero2", "offload_params": True}, "offload_params needs sharding zero3 or fsdp"),
])
def test_bad_setups_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Setup(**kwargs)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80 GB") == 80 * 10**9 and parse_bytes("4096B") == 4096
    assert parse_bytes(4096) == 4096  # an int is bytes
    with pytest.raises(ValueError, match="'80 apples' is not a size"):
        parse_bytes("80 apples")
    with pytest.raises(ValueError, match="'4096' has no unit"):  # 80 is more likely GiB than bytes
        parse_bytes("4096")


def test_the_zero_paper_table_1_from_a_raw_parameter_count():
    references = load_references()
    for nd, ours, printed in references.paper_rows():
        assert [references.as_printed(value, paper) for value, paper in zip(ours, printed)] == list(printed), nd
    # Nd = 64 exactly: 2 + 2 + 12 / 64 bytes a parameter with P_os (AdamW's 4-byte step aside).
    (row,) = [ours for nd, ours, _ in references.paper_rows() if nd == 64]
    partition = 7_500_000_000 // 64  # a multiple of 2: no padding
    assert row[1] == 2 * 7_500_000_000 + 2 * 7_500_000_000 + 12 * partition + 4 == 31_406_250_004


def test_accelerate_training_using_adam_for_bert_base_cased():
    row = load_references().accelerate_row()
    # accelerate: 4 x (parameters + buffers) bytes in fp32; ours: weights + gradients + AdamW's two
    # moments and a 4-byte step per tensor, buffers not being model states.
    assert row["params"] == 108_310_272 and row["buffers_bytes"] == 8_192 and row["param_tensors"] == 199
    assert row["accelerate"] == 16 * row["params"] + 4 * row["buffers_bytes"]
    assert row["ours"] == 16 * row["params"] + 4 * row["param_tensors"] == 1_732_965_148
    assert row["accelerate"] - row["ours"] == 31_972


def partitioned_like_zero3(model: nn.Module) -> nn.Module:
    """Stand-ins for DeepSpeed ZeRO-3's partitioned parameters (deepspeed is not installable here):
    what `zero.Init` leaves, an empty `(0,)` tensor carrying `ds_shape` and `ds_numel`."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            stand_in = nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=param.requires_grad)
            stand_in.ds_shape, stand_in.ds_numel = param.shape, param.numel()
            setattr(module, name, stand_in)
    return model


def test_zero3_partitioned_parameters_are_taken_at_their_real_size():
    model = partitioned_like_zero3(two_layers())
    assert all(param.shape == (0,) for param in model.parameters())
    result = what_if(model, ["adamw"])
    assert (result.total_params, result.trainable_params) == (59, 59)
    assert result.optimizers[0].estimate.num_bytes == adamw(59, 4)
    assert [spec.shape for spec in param_specs(model)] == [(7, 4), (7,), (3, 7), (3,)]
    (entry,) = plan_model_states(model, "adamw", Setup(world_size=2, sharding="zero3")).optimizers
    assert entry.params_bytes == 31 * 4 and entry.optimizer_state_bytes == adamw(31, 2)


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "trainer_memcb", *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT))


def test_cli_plan_for_llama_2_7b_at_64_processes_with_zero3(capsys):
    assert main(["estimate", LLAMA, "--world-size", "64", "--nodes", "8", "--zero", "3", "--precision",
                 "deepspeed-bf16", "--optimizers", "adamw", "--device-memory", "80GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["setup"]["sharding"] == "zero3" and plan["total_params"] == 6_738_415_616
    (entry,) = plan["optimizers"]
    partitions = 210_575_488 // 2  # the sum of ceil(numel / 64) over the 291 tensors
    assert (entry["params_bytes"], entry["grads_bytes"], entry["master_weights_bytes"]) == (
        2 * partitions, 2 * partitions, 4 * partitions)
    assert entry["optimizer_state_bytes"] == 8 * partitions + 8  # a `step` for each of the Trainer's two groups
    assert entry["model_states_bytes"] == entry["device_bytes"] == 16 * partitions + 8
    # fits? is answered against the memory less the CUDA context (426 MiB without --gpu) and the
    # reserve (0 by default).
    context = 446_693_376
    assert (plan["device_memory_bytes"], plan["reserve_bytes"], plan["cuda_context_bytes"]) == (80 * 2**30, 0, context)
    assert entry["fits"] is True and entry["margin_bytes"] == 80 * 2**30 - context - entry["device_bytes"]
    assert main(["estimate", LLAMA, "--world-size", "8", "--sharding", "ddp", "--optimizers", "adamw",
                 "--device-memory", "80GiB"]) == 3  # 3: it does not fit
    text = capsys.readouterr().out
    short = 16 * 6_738_415_616 + 4 * 291 - 80 * 2**30 + context  # weights, gradients, AdamW's moments and steps
    assert short == 22_361_998_476
    assert "does not fit, 20.83 GiB (22,361,998,476) short" in text and "Not counted: activations" in text


@pytest.mark.parametrize("argv, message", [
    (["--zero", "3", "--sharding", "ddp"], "not allowed with argument"),
    (["--sharding", "fsdp-full-shard", "--precision", "deepspeed-bf16"], "trainer-memcb: error: precision="),
    (["--device-memory", "lots"], "trainer-memcb: error: argument --device-memory: size 'lots' is not a size"),
    (["--world-size", "3", "--nodes", "2"], "trainer-memcb: error: world_size=3 is not a multiple of nodes=2"),
])
def test_cli_plan_usage_errors_are_one_line_and_exit_2(argv, message):
    done = run_cli("estimate", os.path.join(REPO_ROOT, "examples", "models", "tiny-distilbert"), *argv)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
