"""Context parallelism's ring attention on the CPU trace: torch's own ring, with the flash, cuDNN or
memory-efficient kernel's meta functions for the CUDA kernel it calls at each turn.

Under accelerate's `maybe_context_parallel` (torch's `context_parallel`), each rank holds `L / cp`
of the sequence, and `scaled_dot_product_attention` is dispatched to torch's ring attention
(`torch/distributed/tensor/experimental/_context_parallel/_attention.py`, torch 2.13): for the flash
backend, `_templated_ring_attention` with `aten._scaled_dot_product_flash_attention` forward, and
`_templated_ring_attention_backward` with its backward; for cuDNN (which an H100 or H200 takes in
16-bit with cuDNN above 9.15), the same with `aten._scaled_dot_product_cudnn_attention` and its
backward (`_scaled_dot_product_ring_cudnn_attention`: no bias, the logsumexp always computed).
Those two are plain Python over aten ops and functional collectives, so the trace calls them as
they are, on the fake process group of the `cp` dimension: what they allocate is what a GPU
allocates, by construction:

- forward: the local key and value made contiguous, their flat concatenation `cat([k, v])` sent
  round the ring (with `allgather`, accelerate's default, one `all_gather_single` of it: `cp` times
  its size, kept for all turns; with `alltoall`, one `permute_tensor` of it per turn), each turn's
  flash output and logsumexp, cast to float32 and merged into float32 `out` and `lse` accumulators
  (`_SDPAMerger`), the result cast back to the query's dtype;
- backward: float32 `grad_query`, `grad_key`, `grad_value` accumulators (`zeros_like`), the key and
  value rotated again, each turn's flash gradients, the key and value gradients concatenated and sent
  round the ring by `permute_tensor` (`alltoall` always), the final ones cast back.

The collectives' results are taken as a GPU holds them (`wait_tensor` returns its input there; the
fake mode's makes a copy, `ring_options`). Autograd saves what it saves for `aten._scaled_dot_product_flash_attention`: the local query, key and
value, the merged output and logsumexp (`derivatives.yaml`; cuDNN's logsumexp is [B, H, L, 1], the
merger's own shape). The flash backward's own workspace (`softmax_d`, `dq_accum`,
`flash_backward_workspace_bytes`), or the cuDNN backward's (its frontend's `dQ_accum` and
`softmax_sum` for the turn's queries, `trainer_memcb.plan.device.cudnn_attention`), is held while each
turn's kernel runs, as `cuda_sdpa` holds it for one process; the cuDNN forward's frontend part is
none.

Memory-efficient (a GPU takes it for float32, for a GPU before Ampere, for head dimensions flash
does not take; `_scaled_dot_product_ring_efficient_attention`): each turn runs
`aten._scaled_dot_product_efficient_attention` with `compute_log_sumexp=True` and its backward
(`grad_out_`, no bias, the gradients of query, key and value asked), each backward turn holding the
kernel's own temporaries (`efficient_backward_allocations`: its `delta`, and its float32 workspace
where it needs one). Its logsumexp has its rows padded to a multiple of 32 (`kAlignLSE`), and the
ring's merge (`_SDPAMerger._merge_one`: `out - sigmoid(block_lse - lse) * (out - block_out)`)
broadcasts it against the output's rows: torch's ring runs only where each turn's queries, all the
local ones (`L / cp`) and the load balancer's half of them (`L / (2 x cp)`), are a multiple of 32
rows; at other lengths a real run fails in the first merge, and the plan refuses them
(`ring_refusal`).

This runs on torch releases with the `_context_parallel` package (2.9 and later); `ring_module()`
says which.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from trainer_memcb.plan.device import cudnn_attention
from trainer_memcb.plan.device.cuda_kernels import K_ALIGN_LSE, flash_backward_workspace_bytes
from trainer_memcb.plan.device.efficient_attention import efficient_backward_allocations
from trainer_memcb.plan.step.collective_results import results_as_returned
from trainer_memcb.plan.step.kernel_workspace import hold_while_the_kernel_runs

__all__ = ["ring_module", "ring_attention", "ring_options", "ring_refusal", "ROTATE_METHODS", "RING_BACKENDS"]

# accelerate's `TorchContextParallelConfig.cp_comm_strategy` values, torch's `set_rotate_method`'s.
ROTATE_METHODS = ("allgather", "alltoall")
# The kernels torch's ring runs (`_sdpa_handler`'s), each traced here.
RING_BACKENDS = ("flash", "cudnn", "efficient")
# The load balancer's chunks per rank (`ROUND_ROBIN_CYCLE`): a turn takes all the local queries or half.
_ROUND_ROBIN_CYCLE = 2


def ring_refusal(backend: str, local_tokens: int) -> Optional[str]:
    """Why torch's ring does not run `backend`'s kernel on `local_tokens` tokens a rank (the module
    docstring), in words; None where it runs."""
    if backend not in RING_BACKENDS:
        return f"backend {backend!r}: torch's ring runs {', '.join(RING_BACKENDS)} only"
    half = local_tokens // _ROUND_ROBIN_CYCLE
    if backend == "efficient" and half % K_ALIGN_LSE:
        return (f"the memory-efficient kernel pads its logsumexp to a multiple of {K_ALIGN_LSE} rows, which torch's "
                f"ring merges with the output's rows: it runs only where each rank's half share of the sequence "
                f"(L / (2 x cp), here {half} tokens) is a multiple of {K_ALIGN_LSE}")
    return None


def ring_module() -> Any:
    """torch's ring attention module, or None on a torch without it (before 2.9)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        return None
    return _attention


@contextlib.contextmanager
def ring_options(rotate: str) -> Iterator[None]:
    """Within: torch's CP options as `context_parallel` sets them for a sequence its head-tail load
    balancer takes (`enable_load_balance`), the rotate method accelerate sets (`set_rotate_method`)."""
    module = ring_module()
    options = module._cp_options
    saved = (options.enable_load_balance, options.rotate_method)
    options.enable_load_balance = True
    options.rotate_method = (module._RotateMethod.ALL_GATHER if rotate == "allgather"
                             else module._RotateMethod.ALL_TO_ALL)
    try:
        with results_as_returned():  # the ring's all-gathers and all-to-alls as a GPU holds them
            yield
    finally:
        options.enable_load_balance, options.rotate_method = saved


def _flash_backward_op(**kwargs: Any) -> Tuple[torch.Tensor, ...]:
    """One turn's flash backward, with the workspace `mha_bwd` holds while it runs."""
    query, key = kwargs["query"], kwargs["key"]
    workspace_bytes = flash_backward_workspace_bytes(
        batch=int(query.shape[0]), heads=int(query.shape[1]), heads_kv=int(key.shape[1]),
        seq_len_q=int(query.shape[2]), seq_len_k=int(key.shape[2]), head_dim=int(query.shape[3]),
        dtype=str(query.dtype).replace("torch.", ""))
    workspace = query.new_empty(workspace_bytes, dtype=torch.uint8)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward.default(**kwargs)
    del workspace
    return grads


def _cudnn_backward_op(**kwargs: Any) -> Tuple[torch.Tensor, ...]:
    """One turn's cuDNN backward, with what `run_cudnn_SDP_bprop` holds after the gradients while it
    runs (`cudnn_backward_held`: its workspace's frontend part, a copy of a `grad_out` whose
    innermost stride is not 1)."""
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default(**kwargs)
    hold_while_the_kernel_runs(kwargs["query"], cudnn_attention.cudnn_backward_held(kwargs["query"], kwargs["grad_out"]))
    return grads


def _efficient_backward_op(compute_capability: Tuple[int, int], **kwargs: Any) -> Tuple[torch.Tensor, ...]:
    """One turn's memory-efficient backward, with the temporaries `_efficient_attention_backward`
    holds while it runs (`efficient_backward_allocations`, made after the gradients as `cuda_sdpa`
    makes them for one process)."""
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(**kwargs)
    query, value = kwargs["query"], kwargs["value"]
    hold_while_the_kernel_runs(query, efficient_backward_allocations(
        batch=int(query.shape[0]), heads=int(query.shape[1]), seq_len_q=int(query.shape[2]),
        seq_len_k=int(kwargs["key"].shape[2]), head_dim=int(query.shape[3]), head_dim_v=int(value.shape[3]),
        dtype=str(query.dtype).replace("torch.", ""), compute_capability=compute_capability, dropout=False))
    return grads


def _turns(backend: str, scale: Optional[float], compute_capability: Tuple[int, int]) -> Tuple[Any, Dict[str, Any], Any]:
    """The kernel each turn runs, its keyword arguments (torch's `_scaled_dot_product_ring_*`
    passes these), and the backward op each backward turn runs."""
    if backend == "cudnn":
        return (torch.ops.aten._scaled_dot_product_cudnn_attention,
                dict(attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, return_debug_mask=False, scale=scale),
                _cudnn_backward_op)
    if backend == "efficient":
        return (torch.ops.aten._scaled_dot_product_efficient_attention,
                dict(attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, scale=scale),
                functools.partial(_efficient_backward_op, compute_capability))
    return torch.ops.aten._scaled_dot_product_flash_attention, dict(dropout_p=0.0, scale=scale), _flash_backward_op


def _backward_arguments(backend: str, rest: Tuple[Any, ...]) -> Tuple[Any, Any, str, Dict[str, Any]]:
    """From the forward op's outputs after the output and logsumexp: the philox seed and offset,
    the name the backward op gives its output's gradient, and its other arguments (flash's and
    cuDNN's the cumulative and largest lengths, cuDNN's and memory-efficient's the bias they were
    given, none; memory-efficient's the gradients it is asked for, as
    `_scaled_dot_product_ring_efficient_attention_backward` is called by autograd)."""
    if backend == "efficient":
        seed, offset = rest
        return seed, offset, "grad_out_", dict(attn_bias=None, dropout_p=0.0, grad_input_mask=(True, True, True, False))
    cum_q, cum_k, max_q, max_k, seed, offset, _ = rest
    arguments = dict(cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0)
    return seed, offset, "grad_out", dict(arguments, attn_bias=None) if backend == "cudnn" else arguments


class _RingAttention(torch.autograd.Function):
    """torch's ring attention forward and backward around the flash, cuDNN or memory-efficient kernel
    (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                scale: Optional[float], backend: str, compute_capability: Tuple[int, int]) -> torch.Tensor:
        op, arguments, ctx.backward_op = _turns(backend, scale, compute_capability)
        out, lse, *rest = ring_module()._templated_ring_attention(
            group, 2, op, query, key, value, is_causal=True, **arguments)
        seed, offset, ctx.grad_out_name, ctx.extra = _backward_arguments(backend, tuple(rest))
        ctx.save_for_backward(query, key, value, out, lse, seed, offset)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        query, key, value, out, lse, seed, offset = ctx.saved_tensors
        grads = ring_module()._templated_ring_attention_backward(
            ctx.group, 2, ctx.backward_op, grad_out=grad_out, grad_out_name=ctx.grad_out_name, query=query, key=key,
            value=value, out=out, logsumexp=lse, is_causal=True, philox_seed=seed, philox_offset=offset,
            scale=ctx.scale, **ctx.extra)
        return grads[0], grads[1], grads[2], None, None, None, None


def ring_attention(group: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scale: Optional[float], backend: str = "flash",
                   compute_capability: Tuple[int, int] = (9, 0)) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values, as torch's
    ring runs it on `group` (the `cp` dimension's process group), [B, H, L / cp, D] each, each turn
    on `backend`'s kernel ("flash", "cudnn" or "efficient", whose backward's temporaries depend on the
    GPU's `compute_capability`).

    Raises:
        ValueError: where torch's ring does not run (`ring_refusal`).
    """
    refusal = ring_refusal(backend, int(query.shape[2]))
    if refusal:
        raise ValueError(refusal)
    return _RingAttention.apply(query, key, value, group, scale, backend, compute_capability)
