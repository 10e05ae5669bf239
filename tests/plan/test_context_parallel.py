"""Context parallelism: the rules accelerate, transformers and torch apply, each refusal one line;
torch's ring attention as the plan traces it, buffer by buffer, against the layout derived by hand
from torch 2.13's `_context_parallel/_attention.py`; and the step of each rank.

Not checked against a real run: torch's `context_parallel` does not run on this CPU. Its ring is
dispatched from CUDA's flash, memory-efficient and cuDNN attention kernels only, and the CPU's SDPA
kernel has no DTensor sharding rule (`test_torch_s_context_parallel_does_not_run_on_this_cpu` holds
that, so that it fails the day torch runs it here; then a two-process run is the check, as
tests/training/test_tensor_parallel_runs.py runs TP). The plan runs torch's own ring functions with
the flash kernel's meta functions (`trainer_memcb.plan.step.ring_attention`): what is mocked is the
CUDA kernel, whose outputs' sizes its meta function gives.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from helpers import requires_torch

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.settings import resolve_settings

sys.path.insert(0, os.path.dirname(__file__))
from test_engines import build  # noqa: E402

RING = "torch 2.13's ring attention package (torch.distributed.tensor.experimental._context_parallel)"

# -- the rules ---------------------------------------------------------------------------------


def test_cp_is_fsdp2_over_dp_shard_x_cp_with_accelerate_s_default_rotation():
    settings = resolve_settings(parallelism="cp=2,dp_shard=2", batch_size=2, seq_len=64)
    assert (settings.world_size, settings.cp_size, settings.sharding, settings.replicate) == (4, 2, "fsdp-full-shard", 1)
    assert settings.cp_comm_strategy == "allgather"
    assert settings.sources["cp_comm_strategy"] == "default (accelerate's TorchContextParallelConfig)"
    assert ("cp_size", 2, "flag") in settings.used()


def test_the_training_args_parallelism_config_gives_cp_and_its_rotation():
    # As `TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2, dp_shard_size=2,
    # cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"))).to_dict()` writes it.
    written = {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 1, "cp_size": 2, "cp_backend": "torch",
               "sp_size": 1, "sp_backend": "deepspeed", "tp_handler": None,
               "cp_handler": {"cp_comm_strategy": "alltoall"}, "sp_handler": None}
    settings = resolve_settings({"parallelism_config": written, "per_device_train_batch_size": 2})
    assert (settings.world_size, settings.cp_size, settings.cp_comm_strategy) == (4, 2, "alltoall")
    assert settings.sources["cp_comm_strategy"] == "training args (parallelism_config)"


@pytest.mark.parametrize("flags,message", [
    (dict(parallelism="cp=2", sharding="zero3"), "cp=2 with sharding 'zero3': accelerate runs context parallelism "
                                                 "beside FSDP2 only"),
    (dict(parallelism="cp=2", device_type="cpu"), "cp=2 on device_type 'cpu': torch's ring attention runs CUDA's"),
    (dict(parallelism="cp=2", seq_len=30), "cp=2 with seq_len=30: the sequence must divide by 2 x cp = 4 (torch's ring splits each share as if its "
                                           "head-tail load balancer had reordered the tokens, which it does only then: "
                                           "other lengths train with a wrong causal mask"),
    (dict(parallelism="cp=2", cp_comm_strategy="ring"), "cp_comm_strategy='ring': accelerate takes allgather or "
                                                        "alltoall"),
    (dict(parallelism="cp=2", batch_size=1, packing=64), "padding-free packing's documents would attend across their "
                                                            "boundaries"),
    (dict(parallelism="cp=2,dp_replicate=2"), "accelerate refuses context parallelism beside pure data parallelism"),
])
def test_a_cp_layout_the_plan_refuses_is_one_line_naming_the_rule(flags, message):
    with pytest.raises(ValueError) as refused:
        resolve_settings(**dict(dict(batch_size=2), **flags))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_attention_other_than_sdpa_is_refused_as_the_trainer_refuses_it():
    settings = resolve_settings(parallelism="cp=2", batch_size=2, attn_implementation="eager")
    with pytest.raises(ValueError, match="attention 'eager': the Trainer runs context parallelism with SDPA "
                                         "attention only"):
        plan_step_memory(build, seq_len=64, settings=settings, model_states=False)


@requires_torch("2.13", RING)
def test_a_length_the_memory_efficient_ring_cannot_merge_is_the_step_s_problem_named():
    # float32: a GPU takes the memory-efficient kernel, whose logsumexp is padded to 32 rows
    # (`kAlignLSE`); at 64 tokens over cp=2, rank 0's half-query turns have 16 rows, and torch's ring
    # fails merging them (`test_torch_s_memory_efficient_ring_fails_where_a_half_share_is_not_32_rows`).
    settings = resolve_settings(parallelism="cp=2", batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=64, settings=settings, model_states=False)
    assert "context parallelism on torch.float32: the memory-efficient kernel pads its logsumexp to a multiple " \
           "of 32 rows, which torch's ring merges with the output's rows: it runs only where each rank's half " \
           "share of the sequence (L / (2 x cp), here 16 tokens) is a multiple of 32" in plan.step.problem


@requires_torch("2.13", RING)
def test_torch_s_context_parallel_does_not_run_on_this_cpu():
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        tokens, query = torch.zeros(1, 16), torch.zeros(1, 2, 8, 16)
        with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1], no_restore_buffers={tokens}):
            with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu.default does "
                                                          "not have a sharding strategy registered"):
                F.scaled_dot_product_attention(query, query, query, is_causal=True)
    finally:
        dist.destroy_process_group()


# -- torch's ring, buffer by buffer ---------------------------------------------------------------

class _NewStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """(op, bytes) of every storage an op makes, in order; the storages given beforehand left out."""

    def __init__(self, existing):
        super().__init__()
        self.kept = list(existing)  # held, so that no address is reused
        self.seen = {tensor.untyped_storage()._cdata for tensor in existing}
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self.seen:
                self.seen.add(tensor.untyped_storage()._cdata)
                self.kept.append(tensor)
                self.made.append((func.overloadpacket.__name__, tensor.untyped_storage().nbytes()))
        return out


def _ring_storages(rank, rotate, backend="flash", dtype=torch.bfloat16, tokens=8):
    """The storages torch's ring makes on `rank` of cp=2 for one attention of B=1, H=2 (two key and
    value heads), `tokens` local tokens of 16 (D=16) in `dtype`, each turn on `backend`'s kernel
    (memory-efficient's on an H100): forward, then backward."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer_memcb.plan.step.ring_attention import ring_attention, ring_options

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        group = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)).get_group()
        with FakeTensorMode(), ring_options(rotate):
            query, key, value = (torch.empty(1, 2, tokens, 16, dtype=dtype, requires_grad=True) for _ in range(3))
            with _NewStorages([query, key, value]) as forward:
                out = ring_attention(group, query, key, value, None, backend, (9, 0))
            grad = torch.empty_like(out)
            with _NewStorages([query, key, value, out, grad]) as backward:
                torch.autograd.grad(out, (query, key, value), grad)
        return forward.made, backward.made
    finally:
        dist.destroy_process_group()


# The sizes below, derived from torch 2.13's `_templated_ring_attention` and its backward: E = B x H
# x L x D = 256 values, so one local query, key or value is 512 bytes in bf16 (1,024 in float32).
FLASH = "_scaled_dot_product_flash_attention"
# One flash forward: its output (512, bf16), its logsumexp [B, H, L] (64, float32), and the meta
# function's philox seed (16), offset (8) and empty debug mask (0).
FLASH_OUTPUTS = [(FLASH, 512), (FLASH, 64), (FLASH, 16), (FLASH, 8), (FLASH, 0)]
# Rank 1's forward: `cat([key.flatten(), value.flatten()])` (1,024), its all-gather (cp x 1,024),
# turn 0 on the local keys, its output cast to float32 for the merger (`_SDPAMerger.step`, 1,024),
# turn 1 on the first halves of rank 0's keys and values (rank 1 >= i: `key.chunk(2)[0]`), its
# output cast likewise, the merge (`out - sigmoid(block_lse - lse) * (out - block_out)`: [B, H, L, 1]
# float32 64 bytes, [B, H, L, D] float32 1,024; `lse - logsigmoid(lse - block_lse)`: the log-sigmoid's
# output and buffer), the merged output cast back to bf16 (512).
RANK1_FORWARD = ([("cat", 1_024), ("all_gather_into_tensor", 2_048)] + FLASH_OUTPUTS + [("_to_copy", 1_024)]
                 + FLASH_OUTPUTS + [("_to_copy", 1_024), ("sub", 64), ("sigmoid", 64), ("sub", 1_024), ("mul", 1_024),
                                    ("sub", 1_024), ("sub", 64), ("log_sigmoid_forward", 64),
                                    ("log_sigmoid_forward", 64), ("sub", 64), ("_to_copy", 512)])
# FlashAttention-2's backward workspace per turn (`flash_backward_workspace_bytes`): softmax_d
# [1, 2, 128] float32 (1,024) and dq_accum [1, 128, 2, 32] float32 (32,768).
WORKSPACE = 33_792
# Rank 1's backward: three float32 accumulators (`zeros_like`, 1,024 each); the keys and values
# concatenated and all-gathered again; turn 0: the workspace, dq, dk, dv (512 each), the float32 key
# and value gradients concatenated (2,048) and sent on by all-to-all (`dkv_rotater` is always
# ALL_TO_ALL, 2,048); turn 1: the workspace, dq (512) and the halves' dk, dv (256 each), the
# received gradients' first halves added (`_partial_update`: a cat each, 1,024), concatenated and
# sent on (2,048 each); then grad_query cast to bf16 (512) and the received key and value gradients
# cast to bf16 (1,024).
RANK1_BACKWARD = [("zeros_like", 1_024)] * 3 + [
    ("cat", 1_024), ("all_gather_into_tensor", 2_048),
    ("new_empty", WORKSPACE), (FLASH + "_backward", 512), (FLASH + "_backward", 512), (FLASH + "_backward", 512),
    ("cat", 2_048), ("all_to_all_single", 2_048),
    ("new_empty", WORKSPACE), (FLASH + "_backward", 512), (FLASH + "_backward", 256), (FLASH + "_backward", 256),
    ("cat", 1_024), ("cat", 1_024), ("cat", 2_048), ("all_to_all_single", 2_048),
    ("_to_copy", 512), ("_to_copy", 1_024)]


@requires_torch("2.13", RING)
def test_rank_1_s_ring_makes_the_buffers_derived_from_torch_s_source():
    forward, backward = _ring_storages(1, "allgather")
    assert forward == RANK1_FORWARD
    assert backward == RANK1_BACKWARD


@requires_torch("2.13", RING)
def test_alltoall_rotation_sends_one_rank_s_keys_and_values_instead_of_gathering_all():
    forward, backward = _ring_storages(1, "alltoall")
    # `_AllToAllRotater`: `permute_tensor` of the 1,024-byte concatenation, not a cp x 1,024 gather.
    assert forward == [("all_to_all_single", 1_024) if op == "all_gather_into_tensor" else (op, size)
                       for op, size in RANK1_FORWARD]
    assert [item for item in backward if item[0].startswith("all_")][0] == ("all_to_all_single", 1_024)


CUDNN = "_scaled_dot_product_cudnn_attention"
# One cuDNN forward (`_scaled_dot_product_ring_cudnn_attention`'s turn): its output (512, bf16), its
# logsumexp [B, H, L, 1] (64, float32), the meta function's philox seed and offset (8 each); its
# workspace's frontend part is none (ALiBi slopes only).
CUDNN_OUTPUTS = [(CUDNN, 512), (CUDNN, 64), (CUDNN, 8), (CUDNN, 8)]
# The cuDNN backward's workspace per turn (`run_cudnn_SDP_bprop`), made after dq, dk and dv: the
# frontend's dQ_accum [1, 2, 8, 16] float32 (1,024) and softmax_sum [1, 2, 8, 1] float32 (64).
CUDNN_WORKSPACE = 1_088
# Rank 1's forward and backward: the flash ring's buffers, each turn cuDNN's outputs, and in
# backward each turn's gradients followed by its workspace.
RANK1_CUDNN_FORWARD = ([("cat", 1_024), ("all_gather_into_tensor", 2_048)] + CUDNN_OUTPUTS + [("_to_copy", 1_024)]
                       + CUDNN_OUTPUTS + RANK1_FORWARD[-11:])
RANK1_CUDNN_BACKWARD = [("zeros_like", 1_024)] * 3 + [
    ("cat", 1_024), ("all_gather_into_tensor", 2_048),
    (CUDNN + "_backward", 512), (CUDNN + "_backward", 512), (CUDNN + "_backward", 512), ("new_empty", CUDNN_WORKSPACE),
    ("cat", 2_048), ("all_to_all_single", 2_048),
    (CUDNN + "_backward", 512), (CUDNN + "_backward", 256), (CUDNN + "_backward", 256), ("new_empty", CUDNN_WORKSPACE),
    ("cat", 1_024), ("cat", 1_024), ("cat", 2_048), ("all_to_all_single", 2_048),
    ("_to_copy", 512), ("_to_copy", 1_024)]


@requires_torch("2.13", RING)
def test_rank_1_s_ring_on_cudnn_makes_the_buffers_derived_from_torch_s_and_aten_s_source():
    forward, backward = _ring_storages(1, "allgather", "cudnn")
    assert RANK1_FORWARD[-11:][0] == ("_to_copy", 1_024)  # the second turn's output cast, then the merge
    assert forward == RANK1_CUDNN_FORWARD
    assert backward == RANK1_CUDNN_BACKWARD


def test_a_ring_kernel_torch_does_not_run_is_refused_naming_it():
    from trainer_memcb.plan.step.ring_attention import ring_attention

    query = torch.empty(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend 'math': torch's ring runs flash, cudnn, efficient only"):
        ring_attention(None, query, query, query, None, "math")


def _torch_s_efficient_ring(rank, tokens):
    """torch's own `_templated_ring_attention` on memory-efficient turns (as
    `_scaled_dot_product_ring_efficient_attention` calls it), rank `rank` of cp=2, `tokens` local
    tokens in float32: the output's shape, or the error."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer_memcb.plan.step.ring_attention import ring_module, ring_options

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        group = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)).get_group()
        with FakeTensorMode(), ring_options("allgather"):
            query = torch.empty(1, 2, tokens, 16)
            return tuple(ring_module()._templated_ring_attention(
                group, 2, torch.ops.aten._scaled_dot_product_efficient_attention, query, query, query, is_causal=True,
                attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, scale=None)[0].shape)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    finally:
        dist.destroy_process_group()


@requires_torch("2.13", RING)
def test_torch_s_memory_efficient_ring_fails_where_a_half_share_is_not_32_rows():
    # The rule `ring_refusal` states, held on torch's own ring: rank 0's turns after the first take
    # the second half of its queries, whose logsumexp rows (padded to 32) the merge broadcasts against
    # the output's; rank 1's take all its queries. 96 local tokens: halves of 48 rows, padded to 64.
    from trainer_memcb.plan.step.ring_attention import ring_refusal

    assert _torch_s_efficient_ring(0, 128) == _torch_s_efficient_ring(1, 128) == (1, 2, 128, 16)
    assert _torch_s_efficient_ring(0, 96).startswith("Attempting to broadcast a dimension of length 48 at -2! "
                                                     "Mismatching argument at index 1 had torch.Size([1, 2, 48, 1])")
    assert _torch_s_efficient_ring(1, 96) == (1, 2, 96, 16)  # a job of two ranks fails on rank 0 all the same
    assert [ring_refusal("efficient", tokens) is None for tokens in (32, 64, 96, 128)] == [False, True, False, True]
    assert ring_refusal("flash", 96) is None and ring_refusal("cudnn", 96) is None


EFFICIENT = "_scaled_dot_product_efficient_attention"
# Memory-efficient in float32 on an H100, 64 local tokens: E = 2,048 values, 8,192 bytes a query,
# key or value. One forward turn: its output (8,192), its logsumexp [B, H, 64] (64 rows, a multiple
# of 32: 512), the meta function's philox seed and offset (8 each).
EFFICIENT_OUTPUTS = [(EFFICIENT, 8_192), (EFFICIENT, 512), (EFFICIENT, 8), (EFFICIENT, 8)]
# Rank 1's forward: the flash ring's buffers without the float32 casts (`.to(torch.float32)` of a
# float32 tensor is the tensor): the concatenated keys and values (16,384) and their all-gather,
# two turns, the merge on [B, H, 64, 1] (512) and [B, H, 64, D] (8,192) float32 tensors.
RANK1_EFFICIENT_FORWARD = ([("cat", 16_384), ("all_gather_into_tensor", 32_768)] + EFFICIENT_OUTPUTS * 2
                           + [("sub", 512), ("sigmoid", 512), ("sub", 8_192), ("mul", 8_192), ("sub", 8_192),
                              ("sub", 512), ("log_sigmoid_forward", 512), ("log_sigmoid_forward", 512), ("sub", 512)])
# Each backward turn's own allocations after dq, dk and dv (`efficient_backward_allocations`, sm90,
# float32: the kernel does not compute delta): `(grad_out * out)` [B, 64, H, 16] (8,192), its sum
# [B, 64, H] (512), delta, its contiguous transpose (512), then the cutlass kernel's workspace:
# 2 heads x (ceil(64 / 64) x ceil(16 / 64) x (4 + 64 x 64)) float32 = 32,800.
EFFICIENT_HELD = [("new_empty", 8_192), ("new_empty", 512), ("new_empty", 512), ("new_empty", 32_800)]
# Rank 1's backward: float32 accumulators (8,192 each); the keys and values gathered again; turn 0:
# dq, dk, dv (8,192 each), its own allocations, the key and value gradients concatenated (16,384)
# and sent on; turn 1 (all its queries over the first halves of rank 0's keys and values): dq
# (8,192), dk and dv (4,096 each), its own allocations, the received gradients' first halves added
# (a cat each, 8,192), concatenated and sent on. No casts back (float32).
RANK1_EFFICIENT_BACKWARD = [("zeros_like", 8_192)] * 3 + [("cat", 16_384), ("all_gather_into_tensor", 32_768)] + [
    (EFFICIENT + "_backward", 8_192)] * 3 + EFFICIENT_HELD + [("cat", 16_384), ("all_to_all_single", 16_384)] + [
    (EFFICIENT + "_backward", 8_192), (EFFICIENT + "_backward", 4_096), (EFFICIENT + "_backward", 4_096)] \
    + EFFICIENT_HELD + [("cat", 8_192), ("cat", 8_192), ("cat", 16_384), ("all_to_all_single", 16_384)]


@requires_torch("2.13", RING)
def test_rank_1_s_ring_on_memory_efficient_makes_the_buffers_derived_from_torch_s_and_aten_s_source():
    forward, backward = _ring_storages(1, "allgather", "efficient", torch.float32, tokens=64)
    assert forward == RANK1_EFFICIENT_FORWARD
    assert backward == RANK1_EFFICIENT_BACKWARD


@requires_torch("2.13", RING)
def test_rank_0_s_second_cudnn_turn_holds_the_workspace_of_half_its_queries():
    # Rank 0's turn 1 (i > rank): the second half of its queries over rank 1's keys and values;
    # dQ_accum [1, 2, 4, 16] and softmax_sum [1, 2, 4, 1] in float32: 512 + 32 bytes.
    _, backward = _ring_storages(0, "allgather", "cudnn")
    assert [size for op, size in backward if op == "new_empty"] == [CUDNN_WORKSPACE, 544]


# -- the step of each rank ------------------------------------------------------------------------

def _cp_plan(rank, rotate="allgather", layout="cp=2", gpu=None, precision="bf16", seq_len=64):
    settings = resolve_settings(parallelism=layout, rank=rank, batch_size=2, optimizer="adamw_torch",
                                precision=precision, cp_comm_strategy=rotate)
    plan, _ = plan_step_memory(build, seq_len=seq_len, settings=settings, device_type="cuda", model_states=False,
                               **({"gpu": gpu} if gpu else {}))
    assert plan.step.problem is None, plan.step.problem
    assert plan.settings.engine == "cp-fsdp2"
    return plan.step


@requires_torch("2.13", RING + " and the fake process group's collectives that FSDP2 runs")
def test_each_rank_holds_half_the_sequence_and_fsdp2_s_half_of_the_model():
    rank0, rank1, alltoall = _cp_plan(0), _cp_plan(1), _cp_plan(1, "alltoall")
    for step in (rank0, rank1, alltoall):
        # FSDP2 over the cp ranks: half of the tiny Llama's 115,008 bf16 values on each.
        assert step.peak_parts["parameters"] == 115_008
        # input_ids, attention_mask and labels keep their [2, 64] int64 storages (1,024 each:
        # `resize_` to [2, 32] keeps a larger storage), position_ids `arange(64)` (512), the rotary
        # buffers (64); shift_labels (1,024) is saved by the loss, among the activations.
        assert step.peak_parts["batch_and_buffers"] == 3 * 1_024 + 512 + 64
    # The all-gather of each layer's keys and values (2 x [2, 4, 32, 16] bf16 = 16,384 bytes) holds
    # cp of them where all-to-all holds one.
    assert rank1.peak_bytes - alltoall.peak_bytes == 16_384 == rank1.peak_parts["other"] - alltoall.peak_parts["other"]
    # Rank 0's merged output is `_partial_update`'s cat, contiguous in [B, H, L, D], so transformers'
    # `transpose(1, 2).contiguous()` copies it for o_proj; rank 1's keeps flash's [B, L, H, D]
    # strides and is o_proj's input as it is: 2 layers x 8,192 bytes fewer activations.
    assert rank0.activations_bytes - rank1.activations_bytes == 2 * 8_192
    assert (rank0.peak_bytes, rank1.peak_bytes, alltoall.peak_bytes) == (1_275_664, 1_262_864, 1_246_480)
    assert sum(rank0.peak_parts.values()) == rank0.peak_bytes


@requires_torch("2.13", RING + " and the fake process group's collectives that FSDP2 runs")
def test_on_an_h100_the_ring_runs_cudnn_and_holds_its_workspace_at_each_backward_turn(monkeypatch):
    from trainer_memcb.plan.device import cudnn_attention

    held, real = [], cudnn_attention.cudnn_backward_held
    monkeypatch.setattr(cudnn_attention, "cudnn_backward_held",
                        lambda query, grad_out: held.append(real(query, grad_out)) or held[-1])
    rank1 = _cp_plan(1, gpu="h100")
    # Batch 2, 4 heads of 16, 32 local tokens: dQ_accum [2, 4, 32, 16] and softmax_sum [2, 4, 32] in
    # float32 (16,384 + 1,024) at each of rank 1's two turns (the second: all its queries over half
    # of rank 0's keys; rank 0's second turn takes half its queries, the ring test above), two layers.
    assert held == [[("workspace", 17_408)]] * 4
    assert rank1.peak_bytes == 1_145_088 and rank1.peak_phase == "backward"
    # The peak is at a turn's backward, the workspace held: with workspaces twice as large it grows
    # by one workspace, byte for byte.
    monkeypatch.setattr(cudnn_attention, "cudnn_backward_held", lambda query, grad_out: [("workspace", 2 * 17_408)])
    assert _cp_plan(1, gpu="h100").peak_bytes - rank1.peak_bytes == 17_408


@requires_torch("2.13", RING + " and the fake process group's collectives that FSDP2 runs")
def test_on_a_t4_the_ring_runs_memory_efficient_and_holds_its_temporaries_at_each_backward_turn(monkeypatch):
    from trainer_memcb.plan.step import ring_attention

    held, real = [], ring_attention.efficient_backward_allocations
    monkeypatch.setattr(ring_attention, "efficient_backward_allocations",
                        lambda **shape: held.append(real(**shape)) or held[-1])
    rank1 = _cp_plan(1, gpu="t4", precision="fp16", seq_len=128)
    # A T4 (sm75) runs fp16 attention on memory-efficient; 128 tokens over cp=2: halves of 32 rows.
    # Batch 2, 4 heads of 16, 64 local tokens: the kernel computes delta [2, 4, 64] float32 (2,048
    # bytes), and its workspace holds one (4 + 64 x 64)-float32 tile of dq for each of the 8 batch
    # rows and heads (131,200 bytes). Two layers, two turns each.
    assert held == [[("delta", 2_048), ("workspace", 131_200)]] * 4
    assert rank1.peak_bytes == 1_723_008 and rank1.peak_phase == "backward"
    # The peak is at a turn's backward, its workspace held: with one twice as large it grows by one.
    monkeypatch.setattr(ring_attention, "efficient_backward_allocations",
                        lambda **shape: [("delta", 2_048), ("workspace", 2 * 131_200)])
    assert _cp_plan(1, gpu="t4", precision="fp16", seq_len=128).peak_bytes - rank1.peak_bytes == 131_200
