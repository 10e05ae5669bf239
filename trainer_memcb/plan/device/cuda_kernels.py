"""Where CUDA's kernels save or allocate other bytes than the CPU kernels the step is traced on.

The step plan runs on fake CPU tensors. torch's CUDA build cannot trace a training step on a
machine without a GPU: under `FakeTensorMode`, fake `device="cuda"` tensors are made and
multiplied, and the forward of a transformers Llama runs, but the backward stops in the autograd
engine with "hasPrimaryContext expects a valid device index, but got device_index=0" (torch
2.14.1+cu130, no driver), and `scaled_dot_product_attention` takes the math backend there because
`check_flash_attention_hardware_support` and `check_mem_efficient_hardware_support`
(`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`) refuse when `at::cuda::is_available()`
is false. So each difference is written here from torch's source, as pure functions of the
shapes, and the plan adds them to the CPU trace.

The differences, each with its function:

- `sdpa_backend`: the backend `select_sdp_backend` (`sdp_utils.cpp`) takes on a GPU of a given
  compute capability: cuDNN first on sm90/sm10x when the cuDNN is newer than 9.15.0
  (`check_prefer_cudnn_attention`), otherwise the default order of `Context.h`
  (flash, memory-efficient, math, cuDNN), each refused by its checks.
- `sdpa_saved_bytes`: what that backend saves for backward beyond q, k, v and the output: flash
  and cuDNN a float32 logsumexp [B, H, Lq] (the CPU flash kernel the trace runs saves the same);
  memory-efficient one padded to a multiple of 32 rows (`kAlignLSE`, `attention.cu`; the meta
  kernel returns [B, H, ceil(Lq/32)*32]); math the attention probabilities [B, H, Lq, Lk].
- `flash_backward_workspace_bytes`: the float32 buffers FlashAttention-2's backward allocates
  through the caching allocator (`flash_api.cpp`, `mha_bwd`): `softmax_d` [B, H, Lq128] and
  `dq_accum` [B, Lq128, H, D32], Lq128 = Lq rounded up to 128, D32 = D rounded up to 32 (256
  above 192); with fewer key/value heads than query heads, `dk_expanded` and `dv_expanded`.
- `cublas_workspace_bytes`, `cublaslt_workspace_bytes`: the workspaces ATen gives cuBLAS and
  cuBLASLt once per (handle, stream), allocated through the caching allocator and kept
  (`aten/src/ATen/cuda/CublasHandlePool.cpp`, `getChosenWorkspaceSize`,
  `getCUDABlasLtWorkspaceSize`, `setWorkspaceForHandle`, `getCUDABlasLtWorkspace`).

The source read is PyTorch's main branch as stored at the time of writing (CublasHandlePool.cpp at
commit 26a39059, sdp_utils.cpp at 001f694a); the torch 2.14.1 CUDA wheel's meta kernels were run
to confirm the logsumexp shapes. Older releases differ in details not modelled here (cuDNN's
place in the order, the cuBLASLt workspace shared with cuBLAS's).
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Optional, Tuple

__all__ = [
    "SDPA_BACKENDS",
    "sdpa_backend",
    "sdpa_saved_bytes",
    "sdpa_saved_bytes_over_cpu",
    "flash_backward_workspace_bytes",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "blas_workspaces_bytes",
]

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
_HALF = ("float16", "bfloat16")
_DTYPES = _HALF + ("float32",)
_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# attention.cu / kernel_forward.h: the memory-efficient kernel's logsumexp rows are padded to 32.
K_ALIGN_LSE = 32
FLOAT32_BYTES = 4


def _check_dtype(dtype: str) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    return name


def _check_cc(compute_capability: Tuple[int, int]) -> Tuple[int, int]:
    if (not isinstance(compute_capability, tuple) or len(compute_capability) != 2
            or not all(isinstance(v, int) and v >= 0 for v in compute_capability)):
        raise ValueError(f"compute_capability must be (major, minor), got {compute_capability!r}")
    return compute_capability


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _minimum_gemm_alignment(cc: Tuple[int, int], half: bool) -> int:
    """`minimum_gemm_alignment` (sdp_utils.cpp): the head dim the memory-efficient kernel needs."""
    major = cc[0]
    use_tensor_cores = major >= 8 or (major >= 7 and half)
    alignment = 4 if major >= 8 else 1
    if use_tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def _cudnn_ok(dtype: str, head_dim: int, dropout_p: float, cc: Tuple[int, int], requires_grad: bool,
              cudnn_version: int) -> bool:
    """`use_cudnn_attention`'s checks on the parameters the plan knows (`check_cudnn_tensor_shapes`,
    `check_cudnn_dropout`, `check_cudnn_d256_bprop_head_dim`, fp16/bf16 only)."""
    if dtype not in _HALF or dropout_p * 16.0 != math.floor(dropout_p * 16.0):
        return False
    sm90_or_sm10x = (cc[0] == 9 and cc[1] == 0) or cc[0] == 10
    d256 = sm90_or_sm10x and cudnn_version > 92200
    if head_dim % 8 or head_dim > (256 if d256 else 128):
        return False
    if requires_grad and d256 and not (head_dim <= 128 or head_dim == 256):
        return False
    return True


def sdpa_backend(dtype: str, head_dim: int, *, has_mask: bool, dropout_p: float = 0.0,
                 is_causal: bool = False, compute_capability: Tuple[int, int],
                 seq_len_q: Optional[int] = None, seq_len_k: Optional[int] = None,
                 requires_grad: bool = True, cudnn_version: int = 92400) -> str:
    """The backend `scaled_dot_product_attention` takes on a GPU: "flash", "efficient", "cudnn" or "math".

    Follows `select_sdp_backend` (`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`) with every
    backend enabled: the order is cuDNN, flash, efficient, math when `check_prefer_cudnn_attention`
    holds (cuDNN newer than 9.15.0 on compute capability 9.x or 10.x, CUDA 13 builds), otherwise
    flash, efficient, math (cuDNN comes after math, so it is never reached).

    Args:
        dtype: "float16", "bfloat16" or "float32" (a `torch.dtype`'s str works too).
        head_dim: the last dimension of q, k and v (taken equal).
        has_mask: an `attn_mask` is passed (flash refuses any mask; cuDNN is taken to accept
            one, its layout and mask checks are not modelled).
        dropout_p, is_causal: as passed to `scaled_dot_product_attention`.
        compute_capability: the GPU's (major, minor), e.g. `gpu_preset("H100").compute_capability`.
        seq_len_q, seq_len_k: flash refuses `is_causal` when they differ.
        requires_grad: training (flash refuses some head dims in training on sm86/sm89).
        cudnn_version: the cuDNN torch loads (`torch.backends.cudnn.version()`; 92400 for the
            torch 2.14.1 cu130 wheel).

    Example:
        >>> sdpa_backend("bfloat16", 128, has_mask=False, is_causal=True, compute_capability=(8, 0))
        'flash'
    """
    dtype = _check_dtype(dtype)
    cc = _check_cc(compute_capability)
    _positive(head_dim=head_dim)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    half = dtype in _HALF
    major, minor = cc
    in_sm80_sm121 = (8, 0) <= cc <= (12, 1)
    in_sm50_sm121 = (5, 0) <= cc <= (12, 1)

    def flash_ok() -> bool:
        if not (half and not has_mask and head_dim <= 256 and in_sm80_sm121):
            return False
        if requires_grad and ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)):
            # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
            if not (head_dim <= 192 or (dropout_p == 0.0 and head_dim > 224)):
                return False
        if is_causal and seq_len_q is not None and seq_len_k is not None and seq_len_q != seq_len_k:
            return False  # check_flash_causal_non_square_seqlens
        return True

    def efficient_ok() -> bool:
        if not in_sm50_sm121:
            return False
        if dtype == "bfloat16" and major < 8:  # bf16 needs sm80 (less_than_sm80 dtypes: fp32, fp16)
            return False
        return head_dim % _minimum_gemm_alignment(cc, half) == 0

    prefer_cudnn = cudnn_version > 91500 and major in (9, 10)
    if prefer_cudnn and _cudnn_ok(dtype, head_dim, dropout_p, cc, requires_grad, cudnn_version):
        return "cudnn"
    if flash_ok():
        return "flash"
    if efficient_ok():
        return "efficient"
    return "math"


def sdpa_saved_bytes(backend: str, *, batch: int, heads: int, seq_len_q: int, seq_len_k: int,
                     dtype: str) -> int:
    """Bytes the backend saves for backward beyond q, k, v and the output (`backend` "cpu" is the
    CPU flash kernel the trace runs).

    flash, cuDNN and the CPU flash kernel save a float32 logsumexp [B, H, Lq]; memory-efficient one
    of [B, H, ceil(Lq/32)*32]; math the softmax probabilities [B, H, Lq, Lk] in `dtype` (its
    dropout mask, when dropout is on, is not counted). The few bytes of a dropout RNG state are
    not counted.

    Example:
        >>> sdpa_saved_bytes("efficient", batch=2, heads=4, seq_len_q=16, seq_len_k=16, dtype="bfloat16")
        1024
    """
    dtype = _check_dtype(dtype)
    _positive(batch=batch, heads=heads, seq_len_q=seq_len_q, seq_len_k=seq_len_k)
    if backend in ("flash", "cudnn", "cpu"):
        return batch * heads * seq_len_q * FLOAT32_BYTES
    if backend == "efficient":
        return batch * heads * (-(-seq_len_q // K_ALIGN_LSE) * K_ALIGN_LSE) * FLOAT32_BYTES
    if backend == "math":
        return batch * heads * seq_len_q * seq_len_k * _ELEMENT_BYTES[dtype]
    raise ValueError(f"backend {backend!r} is not one of {', '.join(SDPA_BACKENDS + ('cpu',))}")


def sdpa_saved_bytes_over_cpu(backend: str, **shape: int) -> int:
    """What the GPU's backend saves beyond the CPU trace, per attention call (`sdpa_saved_bytes`'s
    arguments): 0 for flash and cuDNN, the padding of the logsumexp for memory-efficient."""
    return sdpa_saved_bytes(backend, **shape) - sdpa_saved_bytes("cpu", **shape)  # type: ignore[arg-type]


def flash_backward_workspace_bytes(*, batch: int, heads: int, heads_kv: int, seq_len_q: int,
                                   seq_len_k: int, head_dim: int, dtype: str) -> int:
    """Bytes FlashAttention-2's backward allocates beside the gradients (`flash_api.cpp`, `mha_bwd`).

    `softmax_d` float32 [B, H, round_up(Lq, 128)] and `dq_accum` float32
    [B, round_up(Lq, 128), H, D'] with D' = round_up(D, 32), or 256 above 192 (`loop` is always
    true, non-deterministic); with grouped keys and values (`heads_kv < heads`), `dk_expanded`
    and `dv_expanded` [B, Lk, H, D] in `dtype`, summed into dk and dv afterwards.

    Example:
        >>> flash_backward_workspace_bytes(batch=1, heads=32, heads_kv=32, seq_len_q=512, seq_len_k=512,
        ...                                head_dim=128, dtype="bfloat16")
        8454144
    """
    dtype = _check_dtype(dtype)
    _positive(batch=batch, heads=heads, heads_kv=heads_kv, seq_len_q=seq_len_q, seq_len_k=seq_len_k,
              head_dim=head_dim)
    if heads % heads_kv:
        raise ValueError(f"heads ({heads}) must be a multiple of heads_kv ({heads_kv})")
    seq_q_rounded = -(-seq_len_q // 128) * 128
    head_rounded = -(-head_dim // 32) * 32 if head_dim <= 192 else 256
    total = batch * heads * seq_q_rounded * FLOAT32_BYTES  # softmax_d
    total += batch * seq_q_rounded * heads * head_rounded * FLOAT32_BYTES  # dq_accum
    if heads_kv != heads:
        total += 2 * batch * seq_len_k * heads * head_dim * _ELEMENT_BYTES[dtype]
    return total


_WORKSPACE_CONFIG = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_bytes(compute_capability: Tuple[int, int], env: Optional[Mapping[str, str]] = None) -> int:
    """The cuBLAS workspace ATen allocates per (handle, stream) (`parseChosenWorkspaceSize`).

    `CUBLAS_WORKSPACE_CONFIG` (":SIZE:COUNT" pairs, SIZE in KiB) when set and parseable; otherwise
    32 MiB on compute capability 9.0 (Hopper) and ":4096:2:16:8" (8,519,680 bytes) elsewhere.

    Example:
        >>> cublas_workspace_bytes((9, 0)), cublas_workspace_bytes((8, 0))
        (33554432, 8519680)
    """
    cc = _check_cc(compute_capability)
    default = 4096 * 8 * 1024 if cc == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = (env or {}).get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = _WORKSPACE_CONFIG.findall(config)
    if not pairs:  # torch warns "Could not parse CUBLAS_WORKSPACE_CONFIG" and takes the default
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublaslt_workspace_bytes(compute_capability: Tuple[int, int], env: Optional[Mapping[str, str]] = None) -> int:
    """The cuBLASLt workspace per (handle, stream) (`getCUDABlasLtWorkspaceSize`): `CUBLASLT_WORKSPACE_SIZE`
    KiB (1024 by default), at most the cuBLAS workspace; 0 when `TORCH_CUBLASLT_UNIFIED_WORKSPACE`
    is set true (cuBLASLt then shares cuBLAS's, `getCUDABlasLtWorkspace`).

    Example:
        >>> cublaslt_workspace_bytes((8, 0))
        1048576
    """
    env = env or {}
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return 0
    kib = 1024
    value = env.get("CUBLASLT_WORKSPACE_SIZE")
    if value is not None:
        try:
            kib = int(value)
        except ValueError:  # torch warns "invalid CUBLASLT_WORKSPACE_SIZE" and keeps 1024
            kib = 1024
    return min(kib * 1024, cublas_workspace_bytes(compute_capability, env))


def blas_workspaces_bytes(compute_capability: Tuple[int, int], *, handle_streams: int = 1,
                          env: Optional[Mapping[str, str]] = None) -> int:
    """Both workspaces for `handle_streams` (handle, stream) pairs: one pair for a training step on
    one stream (the forward and backward run on the current stream; the autograd engine's device
    thread takes its own handle from the pool, so a step that runs backward holds two pairs).

    Example:
        >>> blas_workspaces_bytes((9, 0), handle_streams=2)
        69206016
    """
    if not isinstance(handle_streams, int) or handle_streams < 0:
        raise ValueError(f"handle_streams must be a non-negative int, got {handle_streams!r}")
    per_pair = cublas_workspace_bytes(compute_capability, env) + cublaslt_workspace_bytes(compute_capability, env)
    return handle_streams * per_pair
