"""`scaled_dot_product_attention` as CUDA runs it, on the CPU trace: the backend a GPU takes, what it
saves for backward and what its backward allocates.

`aten::scaled_dot_product_attention` is a composite op (`aten/src/ATen/native/transformers/attention.cpp`)
that converts a boolean mask to an additive one in the query's dtype (`convert_boolean_attn_mask`)
and calls the backend its device selects. On the CPU the trace runs on, that is the CPU flash
kernel (`_scaled_dot_product_flash_attention_for_cpu`), which saves q, k, v, the output, a float32
logsumexp [B, H, Lq] and the mask, unless dropout is on, where the CPU refuses its flash kernel
(`check_for_dropout`, `sdp_utils_cpp.cpp`) and takes the math path, which saves the attention
probabilities and the dropout's mask: [B, H, Lq, Lk] each, per layer. A GPU takes the backend of
`select_sdp_backend` (`trainer_memcb.plan.device.cuda_kernels.sdpa_backend`): flash and cuDNN
accept dropout and save what the CPU flash kernel saves; memory-efficient pads its logsumexp to a
multiple of 32 rows (`kAlignLSE`); FlashAttention-2's backward allocates `softmax_d` and
`dq_accum` (and expanded key and value gradients with grouped heads) through the caching
allocator for its duration (`flash_backward_workspace_bytes`); math is the composite the CPU
runs too.

`sdpa_as_cuda(compute_capability)` replaces the composite for its duration with one that selects
the backend as a GPU of that compute capability would, and then:

- math: converts the mask and calls `_scaled_dot_product_attention_math`, as the composite does;
- flash, cuDNN, memory-efficient: converts the mask and runs the CPU flash kernel without dropout
  (the GPU kernels draw their dropout from a seed, and save no mask), in an autograd function that
  saves what the CPU flash kernel's backward node saves, the logsumexp in a storage padded to 32
  rows for memory-efficient, and whose backward holds flash's workspace, memory-efficient's
  delta and workspace, or cuDNN's workspace, while it runs.

The memory-efficient backward also holds its float32 `delta` (and, for float32, the temporaries
that compute it) and the float32 workspace of its cutlass kernel while it runs
(`trainer_memcb.plan.device.efficient_attention`): they are made after the CPU kernel has made the
gradients, as the GPU's kernel makes them after its gradients, and freed before the backward
returns.

The cuDNN backward likewise holds its workspace's frontend part (float32 `dQ_accum` [B, H, Lq, D]
and `softmax_sum` [B, H, Lq]) and, where `grad_out`'s innermost stride is not 1, a copy of it,
made after the gradients and freed before the backward returns
(`trainer_memcb.plan.device.cudnn_attention`); its forward's frontend part is none.

Not modelled: the workspace of the engine cuDNN's heuristics pick (not knowable off the GPU) and
the philox seed and offset a GPU kernel keeps with dropout (16 bytes).
Memory-efficient does not take grouped heads (`enable_gqa` with fewer key/value heads): math is
taken there, as transformers avoids by repeating the keys and values when it passes a mask. A torch
whose CPU flash kernel does not take grouped heads either (2.6 takes math for them) gets the keys
and values repeated around the kernel call, in forward and in backward: the plan then also holds
those copies while the kernel runs.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch

from trainer_memcb.plan.device.cuda_kernels import K_ALIGN_LSE, flash_backward_workspace_bytes, sdpa_backend
from trainer_memcb.plan.device import cudnn_attention
from trainer_memcb.plan.device.efficient_attention import efficient_backward_allocations
from trainer_memcb.plan.step.kernel_workspace import hold_while_the_kernel_runs

__all__ = ["cpu_flash_takes_grouped_heads", "gpu_sdpa_backend", "sdpa_as_cuda"]


def gpu_sdpa_backend(query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float,
                     is_causal: bool, enable_gqa: bool, compute_capability: Tuple[int, int]) -> str:
    """The backend a GPU of `compute_capability` takes for these arguments ("math" for a dtype or
    dropout the fused kernels do not take)."""
    try:
        backend = sdpa_backend(str(query.dtype), int(query.shape[-1]), has_mask=attn_mask is not None,
                               dropout_p=float(dropout_p), is_causal=bool(is_causal),
                               compute_capability=compute_capability, seq_len_q=int(query.shape[-2]),
                               seq_len_k=int(key.shape[-2]), requires_grad=torch.is_grad_enabled())
    except ValueError:  # float64, a dropout of 1, ...: the fused kernels refuse them
        return "math"
    if backend == "efficient" and enable_gqa and key.shape[-3] != query.shape[-3]:
        return "math"  # check_batch_size_and_num_heads_dense: no grouped heads for memory-efficient
    return backend


def _additive_mask(attn_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """`convert_boolean_attn_mask`: a boolean mask becomes 0 where True and -inf elsewhere, in `dtype`."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.zeros((), dtype=dtype, device=attn_mask.device)
    return torch.where(attn_mask, zero, torch.full((), float("-inf"), dtype=dtype, device=attn_mask.device))


def cpu_flash_takes_grouped_heads() -> bool:
    """Whether this torch's CPU flash kernel takes fewer key/value heads than query heads (asked of
    `torch._fused_sdp_choice` on tiny real tensors; call it outside a fake mode)."""
    query, grouped = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        return int(torch._fused_sdp_choice(query, grouped, grouped, None, 0.0, False, enable_gqa=True)) == 1
    except Exception:  # a torch without enable_gqa
        return False


def _repeated(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads repeated to `heads`, as grouped-query attention pairs them (head h with h // group)."""
    return tensor.repeat_interleave(heads // tensor.shape[-3], dim=-3)


def _grouped(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of `_repeated`: each group's heads summed back into its key or value head."""
    shape = grad.shape
    return grad.view(*shape[:-3], heads, shape[-3] // heads, *shape[-2:]).sum(-3)


class _FusedAttention(torch.autograd.Function):
    """A fused GPU kernel's forward and backward, as bytes: the CPU flash kernel's tensors, the
    logsumexp padded for memory-efficient, flash's backward workspace."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: Optional[torch.Tensor], is_causal: bool, scale: Optional[float],
                backend: str, repeat_heads: bool, gpu: Tuple[Tuple[int, int], float]) -> torch.Tensor:
        heads = int(query.shape[-3])
        repeat = repeat_heads and key.shape[-3] != heads
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, _repeated(key, heads) if repeat else key, _repeated(value, heads) if repeat else value,
            0.0, is_causal, attn_mask=attn_mask, scale=scale)
        rows = lse.shape[-1]
        padded_rows = -(-rows // K_ALIGN_LSE) * K_ALIGN_LSE
        if backend == "efficient" and padded_rows != rows:
            # One storage of the padded size; the first rows viewed as the logsumexp the CPU
            # kernel's backward reads (contiguous, so that it copies nothing).
            storage = lse.new_empty(lse.numel() // rows * padded_rows)
            padded = storage[:lse.numel()].view(lse.shape)
            padded.copy_(lse)
            lse = padded
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        ctx.is_causal, ctx.scale, ctx.repeat, ctx.cudnn = is_causal, scale, repeat, backend == "cudnn"
        ctx.workspace_bytes, ctx.efficient = 0, []
        if backend == "efficient":
            compute_capability, dropout_p = gpu
            ctx.efficient = efficient_backward_allocations(
                batch=int(query.shape[0]), heads=heads, seq_len_q=int(query.shape[-2]), seq_len_k=int(key.shape[-2]),
                head_dim=int(query.shape[-1]), head_dim_v=int(value.shape[-1]),
                dtype=str(query.dtype).replace("torch.", ""), compute_capability=compute_capability,
                dropout=dropout_p > 0.0)
        if backend == "flash":
            ctx.workspace_bytes = flash_backward_workspace_bytes(
                batch=int(query.shape[0]), heads=int(query.shape[-3]), heads_kv=int(key.shape[-3]),
                seq_len_q=int(query.shape[-2]), seq_len_k=int(key.shape[-2]), head_dim=int(query.shape[-1]),
                dtype=str(query.dtype).replace("torch.", ""))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        # flash_api.cpp mha_bwd: softmax_d and dq_accum (and dk/dv expanded) are allocated before
        # the kernel runs and freed when it returns.
        workspace = grad_out.new_empty(ctx.workspace_bytes, dtype=torch.uint8) if ctx.workspace_bytes else None
        heads = int(query.shape[-3])
        kv_heads = int(key.shape[-3])
        if ctx.repeat:
            key, value = _repeated(key, heads), _repeated(value, heads)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad_out, query, key, value, out, lse, 0.0, ctx.is_causal, attn_mask=attn_mask, scale=ctx.scale)
        del workspace, key, value
        hold_while_the_kernel_runs(grad_out, cudnn_attention.cudnn_backward_held(query, grad_out) if ctx.cudnn
                                    else ctx.efficient)
        grad_key, grad_value = grads[1], grads[2]
        if ctx.repeat:
            grad_key, grad_value = _grouped(grad_key, kv_heads), _grouped(grad_value, kv_heads)
        return grads[0], grad_key, grad_value, None, None, None, None, None, None


def _sdpa(compute_capability: Tuple[int, int], repeat_heads: bool, ring_group: Any, query: torch.Tensor,
          key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    backend = gpu_sdpa_backend(query, key, attn_mask, dropout_p, is_causal, enable_gqa, compute_capability)
    if ring_group is not None:
        return _ring(ring_group, backend, compute_capability, query, key, value, attn_mask, dropout_p, is_causal, scale)
    attn_mask = _additive_mask(attn_mask, query.dtype)
    if backend == "math":
        return torch.ops.aten._scaled_dot_product_attention_math.default(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    return _FusedAttention.apply(query, key, value, attn_mask, is_causal, scale, backend, repeat_heads,
                                 (compute_capability, float(dropout_p)))


def _ring(group: Any, backend: str, compute_capability: Tuple[int, int], query: torch.Tensor, key: torch.Tensor,
          value: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """Context parallelism's attention (`trainer_memcb.plan.step.ring_attention`), where torch's ring
    takes these arguments as the plan traces it.

    Raises:
        ValueError: naming what torch's ring (or this plan's trace of it) does not take.
    """
    from trainer_memcb.plan.step.ring_attention import RING_BACKENDS, ring_attention, ring_refusal

    if attn_mask is not None or not is_causal or dropout_p:
        # accelerate's hook drops the mask and sets is_causal; the ring's load balancing needs it.
        raise ValueError(f"context parallelism: attention with a mask ({attn_mask is not None}), is_causal="
                         f"{is_causal} or dropout {dropout_p}: torch's ring runs causal attention without a mask "
                         "(load balancing needs is_causal=True), and this plan traces it without dropout")
    if backend not in RING_BACKENDS:
        # `_sdpa_handler`: "CP only supports flash attention and memory efficient attention now".
        raise ValueError(f"context parallelism: a GPU takes the {backend!r} attention kernel for {query.dtype} "
                         "here; torch's ring runs the flash, cuDNN and memory-efficient kernels only")
    refusal = ring_refusal(backend, int(query.shape[-2]))
    if refusal:
        raise ValueError(f"context parallelism on {query.dtype}: {refusal}")
    return ring_attention(group, query, key, value, scale, backend, compute_capability)


@contextlib.contextmanager
def sdpa_as_cuda(compute_capability: Tuple[int, int], ring_group: Any = None) -> Iterator[None]:
    """Within: `aten::scaled_dot_product_attention` runs as on a GPU of `compute_capability`
    (the module docstring); given `ring_group` (context parallelism's process group), as torch's
    ring attention runs it on that group."""
    repeat_heads = not cpu_flash_takes_grouped_heads()
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            library.impl("scaled_dot_product_attention",
                         functools.partial(_sdpa, compute_capability, repeat_heads, ring_group),
                         "CompositeImplicitAutograd")
        yield
    finally:
        library._destroy()
