"""cuDNN attention's memory as ATen and the cuDNN frontend allocate it
(plan/device/cudnn_attention.py), and the CUDA step plan holding it (plan/step/cuda_sdpa.py).

The sizes are derived here by hand from the sources the module docstring names:
`run_cudnn_SDP_bprop` (aten/src/ATen/native/cudnn/MHA.cpp) allocates `get_workspace_size()` bytes
through the caching allocator after `_cudnn_attention_backward` has made dq, dk and dv, and frees
them when it returns; the frontend's part of it is `CompositeSDPABackwardNode`'s `dQ_accum`, float32
[B, H, Lq, Dqk], and `softmax_sum`, float32 [B, H, Lq, 1]. What is mocked: the cuDNN kernels (no
GPU here); the engine's own workspace, which cuDNN reports on the GPU only, is taken as none.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from helpers import requires_torch, requires_transformers

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.device import cudnn_attention
from trainer_memcb.plan.device.cudnn_attention import (cudnn_backward_allocations, cudnn_backward_held,
                                                       cudnn_backward_workspace_bytes, cudnn_forward_workspace_bytes)
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.cuda_sdpa import gpu_sdpa_backend

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

H100 = (9, 0)


def test_the_backward_workspace_is_dq_accum_and_softmax_sum_in_float32():
    # B=2, H=4, L=128, D=64: dQ_accum 2*4*128*64 float32 = 262,144 bytes, softmax_sum 2*4*128
    # float32 = 4,096 bytes; one allocation of both.
    assert cudnn_backward_workspace_bytes(batch=2, heads=4, seq_len_q=128, head_dim=64) == 262_144 + 4_096 == 266_240
    assert cudnn_backward_allocations(batch=2, heads=4, seq_len_q=128, head_dim=64) == [("workspace", 266_240)]
    # The forward's frontend part is the ALiBi slopes only, which ATen never asks for.
    assert cudnn_forward_workspace_bytes(batch=2, heads=4, seq_len_q=128, head_dim=64) == 0


@pytest.mark.parametrize("name, value", [("batch", 0), ("heads", 2.0), ("seq_len_q", True), ("head_dim", -1)])
def test_a_shape_that_is_not_a_whole_number_is_refused_naming_it(name, value):
    shape = dict(batch=2, heads=4, seq_len_q=128, head_dim=64)
    shape[name] = value
    with pytest.raises(ValueError, match=f"{name}={value!r}: expected a whole number of at least 1"):
        cudnn_backward_workspace_bytes(**shape)


def test_grad_out_is_copied_only_where_its_innermost_stride_is_not_1():
    # `run_cudnn_SDP_bprop` (cuDNN 9.5.1 and later): `permute_to_matching_layout(o, dO_)` where
    # dO's innermost stride is not 1, a copy in the output's layout held until it returns.
    query = torch.empty(2, 4, 128, 64, dtype=torch.bfloat16)
    as_transformers_passes_it = torch.empty(2, 128, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert cudnn_backward_held(query, as_transformers_passes_it) == [("workspace", 266_240)]
    innermost_strided = torch.empty(2, 4, 64, 128, dtype=torch.bfloat16).transpose(2, 3)
    assert cudnn_backward_held(query, innermost_strided) == [("grad_out", 2 * 4 * 128 * 64 * 2), ("workspace", 266_240)]


BATCH, SEQ, LAYERS, HEADS, HEAD_DIM = 2, 256, 2, 8, 128


def llama() -> torch.nn.Module:
    # Wide heads over a narrow hidden size and a small vocabulary: the attention backward of the
    # last layer is the step's peak.
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         head_dim=HEAD_DIM, num_key_value_heads=HEADS, vocab_size=32)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _h100_step(build: Callable[[], torch.nn.Module]):
    settings = resolve_settings(batch_size=BATCH, optimizer="adamw_torch", precision="bf16")
    plan, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cuda", model_states=False,
                               gpu="h100")
    assert plan.step.problem is None, plan.step.problem
    return plan.step


def test_an_h100_step_holds_the_cudnn_backward_workspace_at_its_peak(monkeypatch):
    query = torch.empty(BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    assert gpu_sdpa_backend(query, query, None, 0.0, True, False, H100) == "cudnn"  # cuDNN 9.24 on sm90, bf16
    # dQ_accum [2, 8, 256, 128] float32 (2,097,152) and softmax_sum [2, 8, 256] float32 (16,384).
    workspace = BATCH * HEADS * SEQ * HEAD_DIM * 4 + BATCH * HEADS * SEQ * 4
    assert workspace == 2_113_536

    held = []
    monkeypatch.setattr(cudnn_attention, "cudnn_backward_held",
                        lambda query, grad_out: held.append(cudnn_backward_held(query, grad_out)) or held[-1])
    with_workspace = _h100_step(llama)
    assert held == [[("workspace", workspace)]] * LAYERS  # one per layer; transformers' grad_out needs no copy
    monkeypatch.setattr(cudnn_attention, "cudnn_backward_held", lambda query, grad_out: [])
    without = _h100_step(llama)

    assert with_workspace.peak_phase == without.peak_phase == "backward"
    assert with_workspace.peak_bytes - without.peak_bytes == workspace
    assert with_workspace.peak_parts["other"] - without.peak_parts["other"] == workspace
    assert with_workspace.activations_bytes == without.activations_bytes  # held while the kernel runs, not saved


@requires_torch("2.13", "the step's figure as the newest releases trace it")
@requires_transformers("5.0", "the step's figure as the newest releases trace it")
def test_the_h100_step_s_peak_with_the_cudnn_workspace():
    assert _h100_step(llama).peak_bytes == 19_473_120
