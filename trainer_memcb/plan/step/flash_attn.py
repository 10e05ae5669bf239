"""`attn_implementation="flash_attention_2"` planned without the flash-attn package: fake kernels with
the real ones' outputs, what they save for backward and the workspaces they allocate.

transformers' flash path (`modeling_flash_attention_utils._flash_attention_forward`) imports
`flash_attn_func`, `flash_attn_varlen_func` and `bert_padding`'s `pad_input` from the flash-attn
package when `is_flash_attn_2_available()` says it is installed with a CUDA torch. Neither holds
on this CPU machine, so `flash_attention_as_cuda(...)` makes transformers take that path for
its duration only: its lazy import (`_lazy_imports`) answers with the functions below (with
flash-attn 3's of `plan.step.flash_attn3` for `flash_attention_3`), and its cache of the imported
functions is emptied on entry and restored on exit (nothing is changed outside the trace).

The hub's kernels that are flash-attn 2's own (`plan.settings.attention.HUB_FLASH_ATTN_2`,
`attn_implementation="kernels-community/flash-attn2"`) run the same functions: the context
registers the name as transformers' `load_and_register_attn_kernel` does (its own
`flash_attention_forward` as the attention, flash_attention_2's mask function as the mask; in
4.57, `load_and_register_kernel` with the kernel module as the forward's `implementation`), the
hub never reached, and answers its lazy import with them and transformers' own `_pad_input` and
`_unpad_input`, as its kernels branch does. The registrations are removed on exit.

The functions are flash-attn 2.8.4's (`flash_attn/flash_attn_interface.py`, `FlashAttnFunc` and
`FlashAttnVarlenFunc`; `flash_attn/bert_padding.py`, `pad_input`), with the same signatures and
the same autograd functions around two custom ops, whose fake kernels allocate what
`csrc/flash_attn/flash_api.cpp` allocates:

- forward (`mha_fwd`, `mha_varlen_fwd`): `out = empty_like(q)` (q's own strides, a transposed
  view's included), `softmax_lse` float32 [B, H, Lq] (varlen [H, total_q]), `rng_state` int64 [2]
  (16 bytes, even without dropout), and `p` [B, H, Lq↑128, Lk↑128] only with `return_softmax`;
  saved for backward: q, k, v (each padded to a multiple of 8 in the head dimension when it is not
  one), the padded output, `softmax_lse` and `rng_state`. Without dropout and with too few blocks
  to fill the GPU (`num_splits_heuristic`, the GPU's SM count), the split-KV kernel's float32
  `softmax_lse_accum` [S, B, H, Lq] and `out_accum` [S, B, H, Lq, D'] are held while it runs,
  D' = D rounded up to 32 (to 64 above 128).
- backward (`mha_bwd`, `mha_varlen_bwd`): dq, dk, dv `empty_like` q, k, v (the interface's);
  `softmax_d` float32 [B, H, Lq↑128] (varlen [H, total_q + 128 B]), returned by the op and dropped
  by the interface; `dq_accum` float32 [B, Lq↑128, H, D'] (varlen [total_q + 128 B, H, D']) and,
  with fewer key/value heads than query heads, `dk_expanded` and `dv_expanded` [B, Lk, H, D] in
  q's dtype (varlen [total_k, H, D]), held while the kernel runs. Deterministic mode's split
  `dq_accum` is not modelled (transformers passes `deterministic=False` unless
  `FLASH_ATTENTION_DETERMINISTIC=1`).

The kernels refuse what flash-attn refuses: a GPU older than Ampere ("FlashAttention only supports
Ampere GPUs or newer."), a dtype other than fp16/bf16, a head dimension above 256. On real CPU
tensors the ops compute the attention in float32 (for the tests: values and gradients equal to
`scaled_dot_product_attention`'s); under fake tensors they only allocate.

What flash-attn 2's and 3's stand-ins share (the trace's state, the math on real tensors) is in
`plan.step.flash_common`. Not planned here: other hub kernels (refused before the trace, naming
those planned), alibi slopes, paged KV caches (inference).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from trainer_memcb.plan.device.gpus import DEFAULT_COMPUTE_CAPABILITY
from trainer_memcb.plan.settings.attention import is_planned_hub_flash
from trainer_memcb.plan.step.flash_common import DEFAULT_SM_COUNT, STATE as _STATE, attention_math as _attention_math
from trainer_memcb.plan.step.flash_common import attention_math_backward as _attention_math_backward
from trainer_memcb.plan.step.flash_common import count_kernel as _count, heads_first as _heads_first, round_multiple
from trainer_memcb.plan.step.flash_common import varlen_attention_math, varlen_attention_math_backward
from trainer_memcb.plan.step.kernel_runs import KernelRuns

__all__ = ["FLASH_ATTN_VERSION", "FlashKernelsRun", "SM_COUNTS", "flash_attention_2_as_cuda",
           "flash_attention_as_cuda", "flash_attn_func", "flash_attn_varlen_func", "pad_input", "num_splits_heuristic",
           "round_multiple"]

# The release whose interface and kernels are modelled (flash_attn/__init__.py, __version__).
FLASH_ATTN_VERSION = "2.8.4"

# Streaming multiprocessors per GPU preset, for the split-KV heuristic (each from NVIDIA's
# architecture whitepaper or datasheet for that board: H100 SXM5 132, A100 108, L40S 142, L4 58,
# RTX 4090 128, RTX 3090 82; A10G as deviceQuery prints it on AWS g5, 80). The default GPU of a
# plan (sm80) takes the A100's.
SM_COUNTS: Dict[str, int] = {"H100": 132, "H200": 132, "A100-40GB": 108, "A100-80GB": 108, "L40S": 142,
                             "L4": 58, "A10G": 80, "RTX-4090": 128, "RTX-3090": 82}
class FlashKernelsRun(KernelRuns):
    """What `flash_attention_as_cuda` ran: each stand-in kernel's calls, and the split-KV forwards."""

    def __init__(self, gpu: Optional[str], sm_count: int, implementation: str = "flash_attention_2",
                 compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY) -> None:
        super().__init__()
        self.gpu, self.sm_count, self.implementation = gpu, sm_count, implementation
        self.compute_capability = tuple(compute_capability)
        self.split_forwards = 0

    def note(self) -> Optional[str]:
        """The plan's note naming the kernels planned; None where none ran."""
        if not self.calls:
            return None
        kernels = self.calls_text()
        if self.implementation == "flash_attention_3":
            from trainer_memcb.plan.step.flash_attn3 import fa3_note

            return fa3_note(kernels, self.compute_capability)
        splits = (f"; {self.split_forwards} forwards took the split-KV kernel ({self.sm_count} SMs)"
                  if self.split_forwards else "")
        what = (f"flash-attn {FLASH_ATTN_VERSION}'s kernels run it on a GPU (no flash-attn package needed): {kernels}"
                if self.implementation == "flash_attention_2" else
                f"{self.implementation} runs it, the hub's build of flash-attn 2's kernels (through transformers' "
                f"flash path, with its own pad_input), stood in for by flash-attn {FLASH_ATTN_VERSION}'s: {kernels}")
        return (f"attention planned as {what}; out, softmax_lse and rng_state saved for backward, the backward's "
                f"softmax_d and dq_accum (and expanded dk, dv with grouped heads) as workspace{splits}")


def _head_size_rounded(head_size: int) -> int:
    return round_multiple(head_size, 32 if head_size <= 128 else 64)


def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """flash_api.cpp's `num_splits_heuristic`: the fewest splits of the keys within 85% of the best
    occupancy; 1 when the blocks almost fill the SMs."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    efficiency: List[float] = []
    best = 0.0

    def eligible(splits: int) -> bool:
        return splits == 1 or -(-num_n_blocks // splits) != -(-num_n_blocks // (splits - 1))

    for splits in range(1, max_splits + 1):
        if not eligible(splits):
            efficiency.append(0.0)
            continue
        waves = batch_nheads_mblocks * splits / num_sms
        eff = waves / math.ceil(waves)
        best = max(best, eff)
        efficiency.append(eff)
    for splits in range(1, max_splits + 1):
        if eligible(splits) and efficiency[splits - 1] >= 0.85 * best:
            return splits
    return 1


def _splits(batch: int, heads: int, head_size: int, seqlen_q: int, seqlen_k: int, dropout_p: float) -> int:
    """`set_params_splitkv` for `mha_fwd`: the number of splits (1 with dropout: no split kernel)."""
    if dropout_p > 0.0:
        return 1
    block_n = 256 if head_size <= 64 else (128 if head_size <= 128 else 64)
    n_blocks = -(-seqlen_k // block_n)
    m_blocks = -(-seqlen_q // 64)
    # "We multiply number of SMs by 2 to hard-code the fact that we're using 128 threads per block."
    return num_splits_heuristic(batch * heads * m_blocks, _STATE["sm_count"] * 2, n_blocks, 128)


def _check(q: torch.Tensor) -> None:
    """flash_api.cpp's checks (`mha_fwd`, `mha_varlen_fwd`) that refuse a run."""
    if tuple(_STATE["compute_capability"]) < (8, 0):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")


def _ops() -> Any:
    """The two custom ops (forward, backward) in the `trainer_memcb_flash` namespace, defined once."""
    namespace = getattr(torch.ops, "trainer_memcb_flash", None)
    if namespace is not None and hasattr(namespace, "fwd"):
        return namespace
    _define_ops()
    return torch.ops.trainer_memcb_flash


def _define_ops() -> None:
    """The stand-in ops, once per process: `trainer_memcb_flash::fwd` (`mha_fwd`), then the backward and varlen ones."""
    @torch.library.custom_op("trainer_memcb_flash::fwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, bool causal, int window_size_left, "
        "int window_size_right, float softcap, bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)"))
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
            causal: bool, window_size_left: int, window_size_right: int, softcap: float,
            return_softmax: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if dropout_p > 0.0:
            raise NotImplementedError("the CPU stand-in of flash attention computes no dropout")
        out, lse = _attention_math(q, k, v, softmax_scale, causal, (window_size_left, window_size_right), softcap)
        return (_like(q, out), lse,
                q.new_empty((0,)), torch.zeros(2, dtype=torch.int64))

    @fwd.register_fake
    def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, return_softmax):
        # flash_api.cpp mha_fwd: out = empty_like(q); softmax_lse fp32 [B, H, Lq]; p; rng_state int64 [2].
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k = k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
        p = (q.new_empty((batch, heads, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128)))
             if return_softmax else q.new_empty((0,)))
        return out, lse, p, torch.empty((2,), dtype=torch.int64, device=q.device)

    _define_backward_op()
    _define_varlen_ops()
    _register_flop_formulas()


def _register_flop_formulas() -> None:
    """The stand-ins' FLOPs, torch's SDPA formulas over flash-attn's layout (each of q's heads
    against its key/value head, as the kernel computes it); a varlen call counted as its total
    query tokens against `max_seqlen_k` keys each, exact for sequences of one length (the unpadded
    full rows the plan traces), the most otherwise (the cumulative lengths are data)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from trainer_memcb.plan.step.flops import register_flop_formula

    ops = torch.ops.trainer_memcb_flash

    def forward(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_flop_count(_heads_first(q), _heads_first(k), _heads_first(v))

    def backward(dout: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(_heads_first(dout), _heads_first(q), _heads_first(k), _heads_first(v))

    def varlen(q: Any, k: Any, max_seqlen_k: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        return (1, q[1], q[0], q[2]), (1, k[1], max_seqlen_k, k[2])

    def varlen_forward(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, *args: Any,
                       **kwargs: Any) -> int:
        query, key = varlen(q, k, max_k)
        return sdpa_flop_count(query, key, key)

    def varlen_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any, cu_q: Any,
                        cu_k: Any, max_q: int, max_k: int, *args: Any, **kwargs: Any) -> int:
        query, key = varlen(q, k, max_k)
        return sdpa_backward_flop_count(query, query, key, key)

    for packet, formula in ((ops.fwd, forward), (ops.bwd, backward), (ops.varlen_fwd, varlen_forward),
                            (ops.varlen_bwd, varlen_backward)):
        register_flop_formula(packet, formula)


def _define_backward_op() -> None:
    """`trainer_memcb_flash::bwd`: flash_api.cpp's `mha_bwd`, its `softmax_d` the fake kernel's output."""
    @torch.library.custom_op("trainer_memcb_flash::bwd", mutates_args=("dq", "dk", "dv"), schema=(
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, "
        "Tensor(c!) dv, float dropout_p, float softmax_scale, bool causal, int window_size_left, "
        "int window_size_right, float softcap) -> Tensor"))
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dropout_p: float,
            softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
            softcap: float) -> torch.Tensor:
        grads = _attention_math_backward(dout, q, k, v, softmax_scale, causal, (window_size_left, window_size_right),
                                         softcap)
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad)
        return _softmax_d_like(q, varlen_batch=None)

    @bwd.register_fake
    def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
          window_size_right, softcap):
        return _softmax_d_like(q, varlen_batch=None)


def _define_varlen_ops() -> None:
    """`trainer_memcb_flash::varlen_fwd` and `varlen_bwd`: `mha_varlen_fwd` and `mha_varlen_bwd`."""
    @torch.library.custom_op("trainer_memcb_flash::varlen_fwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
        "int max_seqlen_k, float dropout_p, float softmax_scale, bool causal, int window_size_left, "
        "int window_size_right, float softcap, bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)"))
    def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                   softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                   softcap: float, return_softmax: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = varlen_attention_math(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                         (window_size_left, window_size_right), softcap)
        return out, lse, q.new_empty((0,)), torch.zeros(2, dtype=torch.int64)

    @varlen_fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
          window_size_left, window_size_right, softcap, return_softmax):
        # flash_api.cpp mha_varlen_fwd: out = empty_like(q); softmax_lse fp32 [H, total_q]; p; rng_state.
        total_q, heads, _ = q.shape
        batch = cu_seqlens_q.shape[0] - 1
        out = torch.empty_like(q)
        lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
        p = (q.new_empty((batch, heads, round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128)))
             if return_softmax else q.new_empty((0,)))
        return out, lse, p, torch.empty((2,), dtype=torch.int64, device=q.device)

    @torch.library.custom_op("trainer_memcb_flash::varlen_bwd", mutates_args=("dq", "dk", "dv"), schema=(
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, "
        "Tensor(c!) dv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "float dropout_p, float softmax_scale, bool causal, int window_size_left, int window_size_right, "
        "float softcap) -> Tensor"))
    def varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
                   window_size_right: int, softcap: float) -> torch.Tensor:
        varlen_attention_math_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, (dq, dk, dv), softmax_scale, causal,
                                       (window_size_left, window_size_right), softcap)
        return _softmax_d_like(q, varlen_batch=int(cu_seqlens_q.shape[0]) - 1)

    @varlen_bwd.register_fake
    def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
          dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap):
        return _softmax_d_like(q, varlen_batch=cu_seqlens_q.shape[0] - 1)


def _like(q: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` in a tensor of q's strides (`empty_like(q)`, as the kernel's output)."""
    out = torch.empty_like(q)
    out.copy_(values)
    return out


def _softmax_d_like(q: torch.Tensor, varlen_batch: Optional[int]) -> torch.Tensor:
    """`softmax_d`, float32: [B, H, Lq↑128] (`mha_bwd`) or [H, total_q + 128 B] (`mha_varlen_bwd`)."""
    if varlen_batch is None:
        batch, seqlen_q, heads, _ = q.shape
        return torch.empty((batch, heads, round_multiple(seqlen_q, 128)), dtype=torch.float32, device=q.device)
    total_q, heads, _ = q.shape
    return torch.empty((heads, total_q + 128 * varlen_batch), dtype=torch.float32, device=q.device)


def _forward_workspace(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> Optional[torch.Tensor]:
    """`set_params_splitkv`'s float32 `softmax_lse_accum` and `out_accum`, held while `mha_fwd` runs."""
    batch, seqlen_q, heads, head_size = q.shape
    splits = _splits(batch, heads, head_size, seqlen_q, k.shape[1], dropout_p)
    if splits <= 1:
        return None
    if _STATE["run"] is not None:
        _STATE["run"].split_forwards += 1
    elements = splits * batch * heads * seqlen_q * (1 + _head_size_rounded(head_size))
    return q.new_empty((elements,), dtype=torch.float32)


def _backward_workspace(q: torch.Tensor, k: torch.Tensor, varlen_batch: Optional[int]) -> Optional[torch.Tensor]:
    """`dq_accum` (float32) and, with grouped heads, `dk_expanded` and `dv_expanded` (q's dtype),
    held while `mha_bwd` / `mha_varlen_bwd` runs, as one storage of their bytes."""
    heads, head_size = q.shape[-2], q.shape[-1]
    rounded = _head_size_rounded(head_size)
    if varlen_batch is None:
        batch, seqlen_q = q.shape[0], q.shape[1]
        accum_bytes = batch * round_multiple(seqlen_q, 128) * heads * rounded * 4
        keys = k.shape[0] * k.shape[1]
    else:
        accum_bytes = (q.shape[0] + 128 * varlen_batch) * heads * rounded * 4
        keys = k.shape[0]
    expanded = 2 * keys * heads * head_size * q.element_size() if k.shape[-2] != heads else 0
    return q.new_empty((accum_bytes + expanded,), dtype=torch.uint8)


def _maybe_contiguous(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _pad8(x: torch.Tensor, head_size_og: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, [0, 8 - head_size_og % 8]) if head_size_og % 8 else x


class FlashAttnFunc(torch.autograd.Function):
    """flash_attn_interface.py's `FlashAttnFunc`, over the stand-in ops."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                softmax_scale: Optional[float], causal: bool, window_size: Tuple[int, int], softcap: float,
                return_softmax: bool, is_grad_enabled: bool) -> Any:
        _check(q)
        _count("flash_attn_func")
        is_grad = is_grad_enabled and any(x.requires_grad for x in (q, k, v))
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_size_og = q.size(3)
        q, k, v = (_pad8(x, head_size_og) for x in (q, k, v))
        q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
        workspace = _forward_workspace(q, k, dropout_p)
        out_padded, softmax_lse, s_dmask, rng_state = _ops().fwd(
            q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap,
            return_softmax and dropout_p > 0)
        del workspace
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
        ctx.dropout_p, ctx.softmax_scale, ctx.causal, ctx.window_size, ctx.softcap = (
            dropout_p, softmax_scale, causal, window_size, softcap)
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, s_dmask)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *args: Any) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_size_og = dout.size(3)
        dout_padded = _maybe_contiguous(_pad8(dout, head_size_og))
        workspace = _backward_workspace(q, k, None)
        _ops().bwd(dout_padded, q, k, v, out, softmax_lse, dq, dk, dv, ctx.dropout_p, ctx.softmax_scale, ctx.causal,
                   ctx.window_size[0], ctx.window_size[1], ctx.softcap)
        del workspace
        dq, dk, dv = (x[..., :head_size_og] for x in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None, None, None


class FlashAttnVarlenFunc(torch.autograd.Function):
    """flash_attn_interface.py's `FlashAttnVarlenFunc` (no paged KV), over the stand-in ops."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                softmax_scale: Optional[float], causal: bool, window_size: Tuple[int, int], softcap: float,
                return_softmax: bool, is_grad_enabled: bool) -> Any:
        _check(q)
        _count("flash_attn_varlen_func")
        is_grad = is_grad_enabled and any(x.requires_grad for x in (q, k, v))
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_size_og = q.size(2)
        q, k, v = (_maybe_contiguous(_pad8(x, head_size_og)) for x in (q, k, v))
        out_padded, softmax_lse, s_dmask, rng_state = _ops().varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p, softmax_scale,
            causal, window_size[0], window_size[1], softcap, return_softmax and dropout_p > 0)
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state)
        ctx.max_seqlen_q, ctx.max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        ctx.dropout_p, ctx.softmax_scale, ctx.causal, ctx.window_size, ctx.softcap = (
            dropout_p, softmax_scale, causal, window_size, softcap)
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, s_dmask)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *args: Any) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_size_og = dout.size(2)
        dout_padded = _maybe_contiguous(_pad8(dout, head_size_og))
        workspace = _backward_workspace(q, k, int(cu_seqlens_q.shape[0]) - 1)
        _ops().varlen_bwd(dout_padded, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                          ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.dropout_p, ctx.softmax_scale, ctx.causal,
                          ctx.window_size[0], ctx.window_size[1], ctx.softcap)
        del workspace
        dq, dk, dv = (x[..., :head_size_og] for x in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                    deterministic: bool = False, return_attn_probs: bool = False) -> Any:
    """flash-attn's `flash_attn_func`: q [B, Lq, H, D], k and v [B, Lk, Hkv, D]."""
    if alibi_slopes is not None:
        raise NotImplementedError("alibi slopes are not planned")
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap,
                               return_attn_probs, torch.is_grad_enabled())


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Any = None) -> Any:
    """flash-attn's `flash_attn_varlen_func`: q [total_q, H, D], k and v [total_k, Hkv, D]."""
    if alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("alibi slopes and paged KV caches are not planned")
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, tuple(window_size), softcap, return_attn_probs,
                                     torch.is_grad_enabled())


class _IndexPutFirstAxis(torch.autograd.Function):
    """bert_padding.py's `IndexPutFirstAxis`."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device, dtype=values.dtype)
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """bert_padding.py's `pad_input`: (total_nnz, ...) back to (batch, seqlen, ...), zeros elsewhere."""
    output = _IndexPutFirstAxis.apply(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *output.shape[1:])


_CACHE_NAMES = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


@contextlib.contextmanager
def flash_attention_2_as_cuda(compute_capability: Tuple[int, int], gpu: Optional[str] = None,
                              padding: int = 0) -> Iterator[FlashKernelsRun]:
    """`flash_attention_as_cuda` for flash_attention_2."""
    with flash_attention_as_cuda(compute_capability, gpu, padding, "flash_attention_2") as run:
        yield run


@contextlib.contextmanager
def flash_attention_as_cuda(compute_capability: Tuple[int, int], gpu: Optional[str] = None, padding: int = 0,
                            implementation: str = "flash_attention_2") -> Iterator[FlashKernelsRun]:
    """Within: transformers' flash attention runs the stand-in kernels, flash-attn 2's (above) for
    `flash_attention_2` and flash-attn 3's (`plan.step.flash_attn3`) for `flash_attention_3`, as on
    a GPU of `compute_capability` (the preset `gpu`'s SM count for the split-KV heuristic);
    transformers 4.x, which asks its lazy import for "the installed one" (None), is answered with
    `implementation`'s. With `padding` (padded positions per row), `_get_unpad_data` answers a fake
    mask with the sizes of the plan's batch. transformers' own state is restored on exit. Yields
    the record of what ran."""
    sm_count = SM_COUNTS.get(gpu or "", DEFAULT_SM_COUNT)
    run = FlashKernelsRun(gpu, sm_count, implementation, compute_capability)
    try:
        from transformers import modeling_flash_attention_utils as utils
    except ImportError:  # a transformers without the flash path
        yield run
        return
    saved_state = dict(_STATE)
    _STATE.update(compute_capability=tuple(compute_capability), sm_count=sm_count, run=run)
    original_imports = utils._lazy_imports
    answers = _lazy_import_answers(utils, hasattr(utils, "_flash_with_kvcache_fn"))

    def lazy_imports(asked: Optional[str], *args: Any, **kwargs: Any) -> Any:
        # transformers 4.x asks with None ("the installed one"): within the trace, the one planned.
        wanted = implementation if asked is None else asked
        if not isinstance(wanted, str) or wanted not in answers:  # 4.57 passes a hub kernel's module
            return original_imports(asked, *args, **kwargs)
        return answers[wanted]()

    if is_planned_hub_flash(implementation):
        answers[implementation] = answers["hub"]
    saved = {name: getattr(utils, name) for name in _CACHE_NAMES if hasattr(utils, name)}
    original_unpad_data = getattr(utils, "_get_unpad_data", None)
    registered = _register_hub_kernel(implementation, utils) if is_planned_hub_flash(implementation) else []
    masks = _padded_flash_masks(implementation) if padding else {}
    try:
        utils._lazy_imports = lazy_imports
        for name in saved:
            setattr(utils, name, None)
        if original_unpad_data is not None:
            utils._get_unpad_data = _unpad_data_of_plan(original_unpad_data, padding)
        yield run
    finally:
        utils._lazy_imports = original_imports
        for name, value in saved.items():
            setattr(utils, name, value)
        if original_unpad_data is not None:
            utils._get_unpad_data = original_unpad_data
        for key, (registry, function) in masks.items():
            registry[key] = function
        for registry, key in registered:
            registry.pop(key, None)
        _STATE.clear()
        _STATE.update(saved_state)


def _lazy_import_answers(utils: Any, five_values: bool) -> Dict[str, Any]:
    """What transformers' `_lazy_imports` returns for each planned implementation, as functions of
    nothing: flash-attn 2's functions with its `bert_padding`'s `pad_input` (transformers' own
    `_unpad_input`), flash-attn 3's with transformers' own `_pad_input` and `_unpad_input` (its
    lazy import takes only `flash_attn_interface`'s functions). transformers 5 returns five values
    (the paged-cache function, inference only, left None), 4.x four."""
    unpad_input = getattr(utils, "_unpad_input", None)

    def values(func: Any, varlen: Any, pad: Any) -> Tuple[Any, ...]:
        return (func, varlen, None, pad, unpad_input) if five_values else (func, varlen, pad, unpad_input)

    def flash_attention_3() -> Tuple[Any, ...]:
        from trainer_memcb.plan.step import flash_attn3

        return values(flash_attn3.flash_attn_func, flash_attn3.flash_attn_varlen_func, utils._pad_input)

    return {"flash_attention_2": lambda: values(flash_attn_func, flash_attn_varlen_func, pad_input),
            "flash_attention_3": flash_attention_3,
            # A hub kernel's: its module's functions, transformers' own pad and unpad (`_lazy_imports`' kernels branch).
            "hub": lambda: values(flash_attn_func, flash_attn_varlen_func, utils._pad_input)}


class _HubFlashAttn2:
    """What a hub kernel of flash-attn 2's exports that transformers reads (`flash_attn_func`,
    `flash_attn_varlen_func`): the stand-ins. transformers 4.57 passes this module to its lazy import."""

    flash_attn_func = staticmethod(flash_attn_func)
    flash_attn_varlen_func = staticmethod(flash_attn_varlen_func)


def _register_hub_kernel(name: str, utils: Any) -> List[Tuple[Dict[str, Any], str]]:
    """`load_and_register_attn_kernel` (4.57: `load_and_register_kernel`) for a hub kernel of flash-attn 2's,
    its loading from the hub left out: transformers' `flash_attention_forward` registered as `name`'s
    attention (4.57: with the kernel module as its `implementation`) and flash_attention_2's mask function
    as its mask. Returns the (registry, key) pairs to remove on exit."""
    import functools
    import inspect

    from transformers import masking_utils, modeling_utils
    from transformers.integrations.flash_attention import flash_attention_forward

    attention = flash_attention_forward
    if "implementation" in inspect.signature(utils._flash_attention_forward).parameters:  # 4.57
        attention = functools.partial(flash_attention_forward, implementation=_HubFlashAttn2())
    attentions = modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping
    masks = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    attentions[name], masks[name] = attention, masks["flash_attention_2"]
    return [(attentions, name), (masks, name)]


def _padded_flash_masks(implementation: str) -> Dict[str, Tuple[Dict[str, Any], Any]]:
    """transformers' `flash_attention_mask` (masking_utils) of `implementation` for a fake mask of a padded batch: the
    mask sliced and returned, as `attention_mask.all()` (a value read) is False for a real padded
    batch. Patched in the registry of mask functions; returns what to restore."""
    import inspect

    from torch._subclasses.fake_tensor import FakeTensor

    try:
        from transformers import masking_utils
    except ImportError:
        return {}
    registry = getattr(getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None), "_global_mapping", {})
    saved = {key: (registry, function) for key, function in registry.items() if key == implementation}
    for key, (_, original) in saved.items():
        signature = inspect.signature(original)

        def flash_attention_mask(*args: Any, _original: Any = original, _signature: Any = signature,
                                 **kwargs: Any) -> Any:
            bound = _signature.bind(*args, **kwargs)
            mask = bound.arguments.get("attention_mask")
            if not isinstance(mask, FakeTensor):
                return _original(*args, **kwargs)
            return mask[:, -bound.arguments["kv_length"]:]

        registry[key] = flash_attention_mask
    return saved


def _unpad_data_of_plan(original: Any, padding: int) -> Any:
    """transformers' `_get_unpad_data(mask)` for a fake mask of the plan's batch (`padding` zeros
    per row): the same tensors, of the sizes the real batch gives (`nonzero` and `.item()` read
    values a fake tensor does not hold)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def get_unpad_data(attention_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
        if not isinstance(attention_mask, FakeTensor):
            return original(attention_mask)
        batch, seq_len = attention_mask.shape
        seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
        # torch.nonzero(mask.flatten()) is [nnz, 1] int64, flattened as a view.
        indices = torch.empty((batch * (seq_len - padding), 1), dtype=torch.int64,
                              device=attention_mask.device).flatten()
        seqlens_in_batch.max()  # the 0-dim tensor `.item()` reads
        max_seqlen_in_batch = seq_len - padding
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
        return indices, cu_seqlens, max_seqlen_in_batch

    return get_unpad_data
