"""What SDPA's cuDNN attention allocates on a GPU beside its outputs and gradients.

ATen's cuDNN attention (`aten/src/ATen/native/cudnn/MHA.cpp`, reached from
`_scaled_dot_product_cudnn_attention` in `transformers/cuda/attention.cu` and its backward
`_cudnn_attention_backward` in `attention_backward.cu`, torch's main branch as of torch 2.13)
builds a cuDNN frontend graph per shape and runs it; through the caching allocator:

- forward (`run_cudnn_SDP_fprop`): the output `o` (`alloc_with_matching_layout`: `empty_like(q)`
  where its shape is q's), the float32 softmax stats [B, H, Lq, 1] when training
  (`return_softmaxstats`), then `CUDACachingAllocator::get()->allocate(workspace_size)`, whose
  `DataPtr` is freed when the function returns, after `execute` has queued the kernel;
- backward (`_cudnn_attention_backward`): `dq`, `dk`, `dv` (`empty_like` of q, k and v), then in
  `run_cudnn_SDP_bprop` a copy of `grad_out` in the output's layout where its innermost stride is
  not 1 (`permute_to_matching_layout`, cuDNN 9.5.1 and later), then the workspace, as the forward's:
  one allocation of `get_workspace_size()` bytes, freed when the function returns (the copy too).

`Graph::get_workspace_size()` (cudnn-frontend `graph_interface.h`) is the frontend's own part,
`fe_workspace_size`, plus the workspace of the execution plan cuDNN's heuristics picked
(`HeurMode_t::A`, `get_cudnn_workspace_size_node`). The frontend's part is the sum of its nodes'
`get_fe_workspace_size_node()` (`node/scaled_dot_product_flash_attention.h`, unchanged from
frontend 1.8 to 1.23):

- the forward (`SDPANodeBase`, composite or unified): the ALiBi slopes, float32 [H] rounded up to
  16 bytes, only with `set_alibi_mask`, which ATen never sets: no bytes;
- the backward (`CompositeSDPABackwardNode`): `dQ_accum`, float32 [B, H, Lq, Dqk], where the dP
  workspace path is not taken (cuDNN 9.0 and later take it only for a bias gradient or
  `set_deterministic_algorithm`, which ATen sets neither), and `softmax_sum`, float32
  [B, H, Lq, 1] (`dO * O` reduced), both sized from the query's heads and length; `dK_fullhead`
  and `dV_fullhead` (grouped heads) join it only for ragged (nested) inputs with
  `max_total_seq_len`, and the padding-mask workaround only on cuDNN 9.15.0 or older, which
  `sdpa_backend` never sends to cuDNN (it prefers cuDNN only above 9.15.0).

Not knowable here: the execution plan's own workspace, which cuDNN's backend reports for the
engine its heuristics choose on the GPU at run time (its library, the GPU, the shapes); it is taken
as none, and stays one of the step's `NOT_COUNTED` parts. Not modelled: ATen's
`TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` ragged path (its few int32 offset tensors, off by default) and
the 16 bytes of a philox seed and offset.
"""

from __future__ import annotations

from typing import Any, List, Tuple

__all__ = ["cudnn_forward_workspace_bytes", "cudnn_backward_workspace_bytes", "cudnn_backward_allocations",
           "cudnn_backward_held"]

_FLOAT32_BYTES = 4


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")


def cudnn_forward_workspace_bytes(*, batch: int, heads: int, seq_len_q: int, head_dim: int) -> int:
    """The frontend's part of the forward's workspace: none (ALiBi slopes only, which ATen never
    asks for; the module docstring). The engine's part is not knowable here.

    Examples:
        >>> cudnn_forward_workspace_bytes(batch=2, heads=4, seq_len_q=128, head_dim=64)
        0
    """
    _check_positive(batch=batch, heads=heads, seq_len_q=seq_len_q, head_dim=head_dim)
    return 0


def cudnn_backward_workspace_bytes(*, batch: int, heads: int, seq_len_q: int, head_dim: int) -> int:
    """The frontend's part of the backward's workspace: `dQ_accum` float32 [B, H, Lq, Dqk] and
    `softmax_sum` float32 [B, H, Lq, 1], `heads` the query's (the module docstring).

    Examples:
        >>> cudnn_backward_workspace_bytes(batch=2, heads=4, seq_len_q=128, head_dim=64)
        266240
    """
    _check_positive(batch=batch, heads=heads, seq_len_q=seq_len_q, head_dim=head_dim)
    dq_accum = batch * heads * seq_len_q * head_dim * _FLOAT32_BYTES
    softmax_sum = batch * heads * seq_len_q * _FLOAT32_BYTES
    return dq_accum + softmax_sum


def cudnn_backward_allocations(*, batch: int, heads: int, seq_len_q: int, head_dim: int,
                               grad_out_copy_bytes: int = 0) -> List[Tuple[str, int]]:
    """What `run_cudnn_SDP_bprop` allocates after the gradients, in order, as (name, bytes): the
    copy of `grad_out` where its innermost stride is not 1 (`grad_out_copy_bytes`, its size; 0
    where none is made), then the workspace; both freed when it returns.

    Examples:
        >>> cudnn_backward_allocations(batch=1, heads=2, seq_len_q=8, head_dim=16, grad_out_copy_bytes=512)
        [('grad_out', 512), ('workspace', 1088)]
    """
    if isinstance(grad_out_copy_bytes, bool) or not isinstance(grad_out_copy_bytes, int) or grad_out_copy_bytes < 0:
        raise ValueError(f"grad_out_copy_bytes={grad_out_copy_bytes!r}: expected a whole number of at least 0")
    workspace = cudnn_backward_workspace_bytes(batch=batch, heads=heads, seq_len_q=seq_len_q, head_dim=head_dim)
    return ([("grad_out", grad_out_copy_bytes)] if grad_out_copy_bytes else []) + [("workspace", workspace)]


def cudnn_backward_held(query: Any, grad_out: Any) -> List[Tuple[str, int]]:
    """`cudnn_backward_allocations` for one call on these tensors ([B, H, Lq, D] each): the
    query's shape, and a copy of `grad_out` where its innermost stride is not 1."""
    copy = grad_out.numel() * grad_out.element_size() if grad_out.stride(-1) != 1 else 0
    return cudnn_backward_allocations(batch=int(query.shape[0]), heads=int(query.shape[-3]),
                                      seq_len_q=int(query.shape[-2]), head_dim=int(query.shape[-1]),
                                      grad_out_copy_bytes=copy)
