"""Attention as a GPU runs it in the CUDA step plan (plan/step/cuda_sdpa.py): the backend a GPU
takes, the memory-efficient kernel's padded logsumexp, FlashAttention-2's backward workspace, and
no attention probabilities saved where a GPU's fused kernel takes the dropout the CPU's refuses."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn.functional as F

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.device.cuda_kernels import flash_backward_workspace_bytes
from trainer_memcb.plan.device.efficient_attention import efficient_backward_allocations
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.cuda_sdpa import gpu_sdpa_backend, sdpa_as_cuda
from trainer_memcb.plan.step.trace import trace_step

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM  # noqa: E402

A100, V100 = (8, 0), (7, 0)
BATCH, SEQ, LAYERS, HEADS, HEAD_DIM = 2, 16, 2, 4, 16


def llama() -> torch.nn.Module:
    config = LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=256)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def bert(attention_dropout: float) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        config = BertConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, vocab_size=256, max_position_embeddings=64,
                            attention_probs_dropout_prob=attention_dropout)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            return BertForSequenceClassification(config)
    return build


def plan(build: Callable[[], torch.nn.Module], device_type: str, **options: Any):
    settings = resolve_settings(batch_size=BATCH, optimizer="adamw_torch")
    step, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type=device_type, model_states=False,
                               **options)
    assert step.step.problem is None, step.step.problem
    return step


def qkv(dtype: torch.dtype, kv_heads: int = HEADS, seed: int = 0) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    made = {"query": torch.randn(shape, generator=generator),
            "key": torch.randn((BATCH, kv_heads, SEQ, HEAD_DIM), generator=generator),
            "value": torch.randn((BATCH, kv_heads, SEQ, HEAD_DIM), generator=generator)}
    return {name: tensor.to(dtype).requires_grad_() for name, tensor in made.items()}


def test_the_backend_is_the_gpus():
    half, full = qkv(torch.bfloat16), qkv(torch.float32)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    assert gpu_sdpa_backend(half["query"], half["key"], None, 0.1, True, False, A100) == "flash"  # dropout taken
    assert gpu_sdpa_backend(half["query"], half["key"], mask, 0.0, False, False, A100) == "efficient"  # a mask
    assert gpu_sdpa_backend(full["query"], full["key"], None, 0.0, True, False, A100) == "efficient"  # fp32
    assert gpu_sdpa_backend(half["query"], half["key"], None, 0.0, True, False, V100) == "math"  # bf16 before sm80
    grouped = qkv(torch.float32, kv_heads=2)
    assert gpu_sdpa_backend(grouped["query"], grouped["key"], None, 0.0, True, True, A100) == "math"
    assert gpu_sdpa_backend(qkv(torch.float64)["query"], half["key"], None, 0.0, True, False, A100) == "math"


@pytest.mark.parametrize("dtype, masked, grouped", [(torch.float32, False, False), (torch.float32, True, False),
                                                     (torch.bfloat16, False, True)])
def test_the_values_and_gradients_are_the_composites(dtype, masked, grouped):
    """Real tensors: the replaced composite computes what torch's own does (no dropout)."""
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=torch.Generator().manual_seed(1)) > 0.3 if masked else None
    results = []
    for replaced in (False, True):
        inputs = qkv(dtype, kv_heads=2 if grouped else HEADS)
        with sdpa_as_cuda(A100) if replaced else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = F.scaled_dot_product_attention(**inputs, attn_mask=mask, is_causal=not masked, enable_gqa=grouped)
            out.float().square().sum().backward()
        results.append([out] + [inputs[name].grad for name in ("query", "key", "value")])
    for ours, torchs in zip(*results):
        torch.testing.assert_close(ours, torchs, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_memory_efficient_saves_its_logsumexp_padded_to_32_rows():
    # fp32 on an A100: memory-efficient (flash takes 16-bit only). Each layer's logsumexp, float32
    # [2, 4, 16] on the CPU, is [2, 4, 32] there: 512 bytes more per layer.
    cuda, cpu = plan(llama, "cuda"), plan(llama, "cpu")
    assert cuda.step.activations_bytes - cpu.step.activations_bytes == LAYERS * BATCH * HEADS * (32 - SEQ) * 4 == 1024


def _made_in_backward(line, nbytes):
    """The storages of `nbytes` the traced step's backward made."""
    backward = line.events[line.phase_starts["backward"]:line.phase_starts["optimizer step"]]
    return [event for event in backward if event >= 0 and line.sizes[event] == nbytes]


def test_flash_backward_holds_its_workspace_while_it_runs():
    settings = resolve_settings(batch_size=BATCH, optimizer="adamw_torch", precision="bf16")
    lines = {device: trace_step(llama(), dataclasses.replace(settings, seq_len=SEQ, device_type=device), args=None,
                                step_dtype=torch.bfloat16) for device in ("cuda", "cpu")}
    workspace = flash_backward_workspace_bytes(batch=BATCH, heads=HEADS, heads_kv=HEADS, seq_len_q=SEQ,
                                               seq_len_k=SEQ, head_dim=HEAD_DIM, dtype="bfloat16")
    assert workspace == BATCH * HEADS * 128 * 4 + BATCH * 128 * HEADS * 32 * 4 == 135_168

    # One per layer on the GPU, freed before the next is made; none on the CPU.
    made = _made_in_backward(lines["cuda"], workspace)
    assert len(made) == LAYERS and _made_in_backward(lines["cpu"], workspace) == []
    events = lines["cuda"].events
    assert all(events.index(~serial) < events.index(later) for serial, later in zip(made, made[1:]))
    assert lines["cuda"].activations_bytes == lines["cpu"].activations_bytes  # flash saves what the CPU's saves


def test_memory_efficient_backward_holds_delta_and_its_workspace_while_it_runs():
    # fp32 on an A100: memory-efficient, its cutlass kernel 64x64 k32 (dispatch_cutlassB_f32_sm80, the first
    # taking D=16). attention_backward.cu: delta = (grad_out * out).sum(-1).transpose(-2, -1).contiguous(), the
    # product [B, L, H, D] and the sum freed at the statement's end; the workspace (kernel_backward.h), one
    # GradQTempStorage per (batch, head): 4 int32 and a 64x64 float32 tile for the one 64-query block.
    settings = resolve_settings(batch_size=BATCH, optimizer="adamw_torch")
    lines = {device: trace_step(llama(), dataclasses.replace(settings, seq_len=SEQ, device_type=device), args=None,
                                step_dtype=torch.float32) for device in ("cuda", "cpu")}
    product, delta, workspace = BATCH * SEQ * HEADS * HEAD_DIM * 4, BATCH * HEADS * SEQ * 4, BATCH * HEADS * 4100 * 4
    assert (product, delta, workspace) == (8192, 512, 131_200)
    assert efficient_backward_allocations(batch=BATCH, heads=HEADS, seq_len_q=SEQ, seq_len_k=SEQ, head_dim=HEAD_DIM,
                                          head_dim_v=HEAD_DIM, dtype="float32", compute_capability=A100) == [
        ("product", product), ("sum", delta), ("delta", delta), ("~product", 0), ("~sum", 0), ("workspace", workspace)]
    made = _made_in_backward(lines["cuda"], workspace)
    assert len(made) == LAYERS and _made_in_backward(lines["cpu"], workspace) == []
    events = lines["cuda"].events
    # Each layer's workspace freed before the next layer's backward makes its own.
    assert all(events.index(~serial) < events.index(later) for serial, later in zip(made, made[1:]))
    assert len(_made_in_backward(lines["cuda"], product)) - len(_made_in_backward(lines["cpu"], product)) == LAYERS


def test_attention_dropout_saves_no_probabilities_on_the_gpu():
    # The CPU refuses its flash kernel under dropout and saves the probabilities and the dropout's
    # mask ([2, 4, 16, 16] each, per layer); a GPU's fused kernel draws the dropout from a seed.
    with_dropout, without = plan(bert(0.1), "cuda"), plan(bert(0.0), "cuda")
    assert with_dropout.step.activations_bytes == without.step.activations_bytes
    assert plan(bert(0.1), "cpu").step.activations_bytes > plan(bert(0.0), "cpu").step.activations_bytes
