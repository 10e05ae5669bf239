"""CUDA's kernels against the CPU trace: each difference held to the bytes its source rule gives.

The shapes the CUDA kernels return are checked against torch's own meta kernels, run on fake CUDA
tensors (which the CPU build makes): what the plan adds is what torch says the kernel returns.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer_memcb.plan.device.cuda_kernels import (
    blas_workspaces_bytes, cublas_workspace_bytes, cublaslt_workspace_bytes, flash_backward_workspace_bytes,
    sdpa_backend, sdpa_saved_bytes, sdpa_saved_bytes_over_cpu)
from trainer_memcb.plan.device.gpus import gpu_preset

SHAPE = dict(batch=2, heads=4, seq_len_q=40, seq_len_k=40, dtype="bfloat16")


def backend(gpu: str, dtype: str = "bfloat16", head_dim: int = 128, **kwargs) -> str:
    kwargs.setdefault("has_mask", False)
    return sdpa_backend(dtype, head_dim, compute_capability=gpu_preset(gpu).compute_capability, **kwargs)


def test_bf16_causal_training_takes_cudnn_on_hopper_and_flash_on_ampere_and_ada() -> None:
    chosen = {gpu: backend(gpu, is_causal=True) for gpu in ("H100", "H200", "A100-80GB", "A10G", "L4", "RTX-4090")}
    assert chosen == {"H100": "cudnn", "H200": "cudnn", "A100-80GB": "flash", "A10G": "flash", "L4": "flash",
                      "RTX-4090": "flash"}


def test_an_older_cudnn_leaves_hopper_to_flash() -> None:
    assert backend("H100", cudnn_version=91002) == "flash"


def test_a_mask_sends_flash_to_memory_efficient() -> None:
    assert backend("A100-80GB", has_mask=True) == "efficient"


def test_turing_and_volta_run_memory_efficient_in_fp16_and_math_in_bf16() -> None:
    assert [backend("T4", "float16"), backend("V100-32GB", "float16")] == ["efficient", "efficient"]
    assert [backend("T4", "bfloat16"), backend("V100-32GB", "bfloat16")] == ["math", "math"]


def test_fp32_is_memory_efficient_where_the_head_dim_is_aligned() -> None:
    assert backend("A100-80GB", "float32", head_dim=64) == "efficient"
    assert backend("A100-80GB", "float32", head_dim=66) == "math"  # 66 % 4 on sm80
    assert backend("V100-16GB", "float32", head_dim=66) == "efficient"  # alignment 1 without tensor cores


def test_flash_refuses_training_with_head_dim_above_192_on_sm86_and_sm89() -> None:
    assert backend("RTX-3090", head_dim=200) == "efficient"
    assert backend("RTX-3090", head_dim=200, requires_grad=False) == "flash"
    assert backend("RTX-3090", head_dim=232) == "flash"
    assert backend("RTX-3090", head_dim=232, dropout_p=0.1) == "efficient"


def test_flash_refuses_causal_when_query_and_key_lengths_differ() -> None:
    assert backend("A100-80GB", is_causal=True, seq_len_q=8, seq_len_k=16) == "efficient"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype 'float64' is not one of float16, bfloat16, float32"):
        sdpa_backend("float64", 64, has_mask=False, compute_capability=(8, 0))
    with pytest.raises(ValueError, match=r"compute_capability must be \(major, minor\), got 80"):
        sdpa_backend("float16", 64, has_mask=False, compute_capability=80)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dropout_p must be in"):
        sdpa_backend("float16", 64, has_mask=False, dropout_p=1.5, compute_capability=(8, 0))
    with pytest.raises(ValueError, match="backend 'xformers' is not one of flash, efficient, cudnn, math, cpu"):
        sdpa_saved_bytes("xformers", **SHAPE)


def meta_logsumexp_bytes(op: str) -> int:
    """The logsumexp torch's meta kernel returns for q, k, v of SHAPE on fake CUDA tensors."""
    with FakeTensorMode():
        q = torch.empty(2, 4, 40, 64, device="cuda", dtype=torch.bfloat16)
        if op == "flash":
            lse = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)[1]
        elif op == "efficient":
            lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True)[1]
        else:
            lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, True)[1]
        assert lse.dtype == torch.float32
        return lse.numel() * lse.element_size()


@pytest.mark.parametrize("op, expected", [("flash", 1280), ("cudnn", 1280), ("efficient", 2048)])
def test_the_saved_logsumexp_is_what_torchs_meta_kernels_return(op, expected) -> None:
    assert sdpa_saved_bytes(op, **SHAPE) == meta_logsumexp_bytes(op) == expected


def test_what_each_backend_saves_beyond_the_cpu_trace() -> None:
    over = {b: sdpa_saved_bytes_over_cpu(b, **SHAPE) for b in ("flash", "cudnn", "efficient", "math")}
    # efficient: 40 rows padded to 64 (kAlignLSE 32); math: bf16 probabilities 2*4*40*40*2 less the lse.
    assert over == {"flash": 0, "cudnn": 0, "efficient": 2 * 4 * 24 * 4, "math": 25_600 - 1_280}


def test_flash_backward_workspaces() -> None:
    # softmax_d 1*32*512*4 + dq_accum 1*512*32*128*4
    assert flash_backward_workspace_bytes(batch=1, heads=32, heads_kv=32, seq_len_q=512, seq_len_k=512,
                                          head_dim=128, dtype="bfloat16") == 65_536 + 8_388_608
    # 100 rows round to 128, head dim 80 to 96; 8 kv heads for 32: dk/dv expanded 2*1*100*32*80*2
    assert flash_backward_workspace_bytes(batch=1, heads=32, heads_kv=8, seq_len_q=100, seq_len_k=100,
                                          head_dim=80, dtype="bfloat16") == (32 * 128 * 4 + 128 * 32 * 96 * 4
                                                                            + 2 * 100 * 32 * 80 * 2)
    # above 192 the head dim rounds to 256
    assert flash_backward_workspace_bytes(batch=1, heads=1, heads_kv=1, seq_len_q=128, seq_len_k=128,
                                          head_dim=200, dtype="float16") == 128 * 4 + 128 * 256 * 4
    with pytest.raises(ValueError, match=r"heads \(32\) must be a multiple of heads_kv \(5\)"):
        flash_backward_workspace_bytes(batch=1, heads=32, heads_kv=5, seq_len_q=8, seq_len_k=8, head_dim=64,
                                       dtype="float16")


def test_the_cublas_workspace_is_32_mib_on_hopper_and_4096x2_plus_16x8_kib_elsewhere() -> None:
    sizes = {gpu: cublas_workspace_bytes(gpu_preset(gpu).compute_capability) for gpu in ("H100", "A100-80GB", "T4")}
    assert sizes == {"H100": 33_554_432, "A100-80GB": 8_519_680, "T4": 8_519_680}


def test_cublas_workspace_config_is_read_as_torch_reads_it() -> None:
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 33_554_432
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8:4096:2"}) == 8_519_680
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "garbage"}) == 33_554_432


def test_the_cublaslt_workspace() -> None:
    assert cublaslt_workspace_bytes((8, 0)) == 1_048_576
    assert cublaslt_workspace_bytes((8, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4_194_304
    # capped at the cuBLAS workspace
    assert cublaslt_workspace_bytes((8, 0), {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == 8_519_680
    assert cublaslt_workspace_bytes((8, 0), {"CUBLASLT_WORKSPACE_SIZE": "x"}) == 1_048_576
    assert cublaslt_workspace_bytes((8, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0


def test_both_workspaces_per_handle_and_stream() -> None:
    assert blas_workspaces_bytes((9, 0)) == 33_554_432 + 1_048_576
    assert blas_workspaces_bytes((8, 0), handle_streams=2) == 2 * (8_519_680 + 1_048_576)
    with pytest.raises(ValueError, match="handle_streams must be a non-negative int, got -1"):
        blas_workspaces_bytes((8, 0), handle_streams=-1)
