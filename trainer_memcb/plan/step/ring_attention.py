"""Context parallelism's ring attention on the CPU trace: torch's own ring, with the flash or cuDNN
kernel's meta functions for the CUDA kernel it calls at each turn.

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
none. Memory-efficient is not traced: its logsumexp is padded to 32 rows, which the ring's merge
cannot broadcast unless `L / cp` is a multiple of 32.

This runs on torch releases with the `_context_parallel` package (2.9 and later); `ring_module()`
says which.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from trainer_memcb.plan.device import cudnn_attention
from trainer_memcb.plan.step.collective_results import results_as_returned
from trainer_memcb.plan.device.cuda_kernels import flash_backward_workspace_bytes

__all__ = ["ring_module", "ring_attention", "ring_options", "ROTATE_METHODS", "RING_BACKENDS"]

# accelerate's `TorchContextParallelConfig.cp_comm_strategy` values, torch's `set_rotate_method`'s.
ROTATE_METHODS = ("allgather", "alltoall")
# The kernels whose ring the plan traces (torch's `_sdpa_handler` dispatches memory-efficient's too).
RING_BACKENDS = ("flash", "cudnn")


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
    held = [kwargs["query"].new_empty(nbytes, dtype=torch.uint8)
            for _, nbytes in cudnn_attention.cudnn_backward_held(kwargs["query"], kwargs["grad_out"])]
    del held
    return grads


def _turns(backend: str, scale: Optional[float]) -> Tuple[Any, Dict[str, Any], Any]:
    """The kernel each turn runs, its keyword arguments (torch's `_scaled_dot_product_ring_*`
    passes these), and the backward op each backward turn runs."""
    if backend == "cudnn":
        return (torch.ops.aten._scaled_dot_product_cudnn_attention,
                dict(attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, return_debug_mask=False, scale=scale),
                _cudnn_backward_op)
    return torch.ops.aten._scaled_dot_product_flash_attention, dict(dropout_p=0.0, scale=scale), _flash_backward_op


def _backward_arguments(backend: str, rest: Tuple[Any, ...]) -> Dict[str, Any]:
    """The backward op's own arguments from the forward op's: the cumulative and largest lengths
    (and for cuDNN the bias it was given, none)."""
    cum_q, cum_k, max_q, max_k = rest
    arguments = dict(cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0)
    return dict(arguments, attn_bias=None) if backend == "cudnn" else arguments


class _RingAttention(torch.autograd.Function):
    """torch's ring attention forward and backward around the flash or cuDNN kernel (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                scale: Optional[float], backend: str) -> torch.Tensor:
        op, arguments, ctx.backward_op = _turns(backend, scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = ring_module()._templated_ring_attention(
            group, 2, op, query, key, value, is_causal=True, **arguments)
        ctx.save_for_backward(query, key, value, out, lse, seed, offset)
        ctx.group, ctx.scale, ctx.extra = group, scale, _backward_arguments(backend, (cum_q, cum_k, max_q, max_k))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        query, key, value, out, lse, seed, offset = ctx.saved_tensors
        grads = ring_module()._templated_ring_attention_backward(
            ctx.group, 2, ctx.backward_op, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
            value=value, out=out, logsumexp=lse, is_causal=True, philox_seed=seed, philox_offset=offset,
            scale=ctx.scale, **ctx.extra)
        return grads[0], grads[1], grads[2], None, None, None


def ring_attention(group: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scale: Optional[float], backend: str = "flash") -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values, as torch's
    ring runs it on `group` (the `cp` dimension's process group), [B, H, L / cp, D] each, each turn
    on `backend`'s kernel ("flash" or "cudnn")."""
    if backend not in RING_BACKENDS:
        raise ValueError(f"backend {backend!r}: the plan traces the ring on {' or '.join(RING_BACKENDS)} only")
    return _RingAttention.apply(query, key, value, group, scale, backend)
