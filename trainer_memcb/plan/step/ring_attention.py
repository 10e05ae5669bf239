"""Context parallelism's ring attention on the CPU trace: torch's own ring, with the flash kernel's
meta functions for the CUDA kernel it calls at each turn.

Under accelerate's `maybe_context_parallel` (torch's `context_parallel`), each rank holds `L / cp`
of the sequence, and `scaled_dot_product_attention` is dispatched to torch's ring attention
(`torch/distributed/tensor/experimental/_context_parallel/_attention.py`, torch 2.13): for the flash
backend, `_templated_ring_attention` with `aten._scaled_dot_product_flash_attention` forward, and
`_templated_ring_attention_backward` with its backward. Those two are plain Python over aten ops and
functional collectives, so the trace calls them as they are, on the fake process group of the `cp`
dimension: what they allocate is what a GPU allocates, by construction:

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
value, the merged output and logsumexp (`derivatives.yaml`). The flash backward's own workspace
(`softmax_d`, `dq_accum`, `flash_backward_workspace_bytes`) is held while each turn's kernel runs, as
`cuda_sdpa` holds it for one process. Only flash is traced: the memory-efficient kernel's logsumexp
is padded to 32 rows, which the ring's merge cannot broadcast unless `L / cp` is a multiple of 32.

This runs on torch releases with the `_context_parallel` package (2.9 and later); `ring_module()`
says which.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

import torch

from trainer_memcb.plan.step.collective_results import results_as_returned
from trainer_memcb.plan.device.cuda_kernels import flash_backward_workspace_bytes

__all__ = ["ring_module", "ring_attention", "ring_options", "ROTATE_METHODS"]

# accelerate's `TorchContextParallelConfig.cp_comm_strategy` values, torch's `set_rotate_method`'s.
ROTATE_METHODS = ("allgather", "alltoall")


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


class _RingFlashAttention(torch.autograd.Function):
    """torch's ring attention forward and backward around the flash kernel (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                scale: Optional[float]) -> torch.Tensor:
        module = ring_module()
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = module._templated_ring_attention(
            group, 2, torch.ops.aten._scaled_dot_product_flash_attention, query, key, value, is_causal=True,
            dropout_p=0.0, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, seed, offset)
        ctx.group, ctx.scale, ctx.extra = group, scale, (cum_q, cum_k, max_q, max_k)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        query, key, value, out, lse, seed, offset = ctx.saved_tensors
        cum_q, cum_k, max_q, max_k = ctx.extra
        grads = ring_module()._templated_ring_attention_backward(
            ctx.group, 2, _flash_backward_op, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
            value=value, out=out, logsumexp=lse, is_causal=True, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q,
            max_k=max_k, dropout_p=0.0, philox_seed=seed, philox_offset=offset, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


def ring_attention(group: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scale: Optional[float]) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values, as torch's
    ring runs it on `group` (the `cp` dimension's process group), [B, H, L / cp, D] each."""
    return _RingFlashAttention.apply(query, key, value, group, scale)
