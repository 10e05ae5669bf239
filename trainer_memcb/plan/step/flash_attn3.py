"""`attn_implementation="flash_attention_3"` planned without the flash-attn-3 package: stand-ins for
flash-attn 3's kernels (`hopper/`, `flash_attn_interface.py` 3.0.0: the Hopper ones and the sm80
build's Ampere/Ada ones) with the real ones' outputs, what they save for backward and the
workspaces they allocate.

transformers 5 imports `flash_attn_func` and `flash_attn_varlen_func` from `flash_attn_interface`
for `flash_attention_3` (`modeling_flash_attention_utils._lazy_imports`) and pads and unpads with
its own `_pad_input` and `_unpad_input`; transformers 4.57 asks its lazy import for "the installed
one" (None), which is FA3's when `flash_attn_3` is installed. `plan.step.flash_attn`'s
`flash_attention_as_cuda(..., implementation="flash_attention_3")` answers both with the functions
below for the trace only. transformers reads which keywords the kernel takes from the signature of
`flash_attn_varlen_func` (`_lazy_define_process_function`): FA3's take no `dropout_p`, so the
attention's dropout is never passed, and the functions here keep FA3's signatures.

The autograd functions are the interface's (`FlashAttnFunc`, `FlashAttnVarlenFunc`): they save q,
k, v as given (FA3 pads nothing: it refuses a head dimension that is not a multiple of 8), the
output and `softmax_lse`, and no RNG state (FA3 has no dropout). The two custom ops stand for
`hopper/flash_api.cpp`'s `mha_fwd` and `mha_bwd`, their fake kernels allocating what those do, in
their order, on the trace's GPU (its `arch`, major * 10 + minor, passed to each op, the backward's
kept from its forward):

- forward: `out` [B, Lq, H, Dv] (varlen [total_q, H, Dv]) in q's dtype; `softmax_lse` float32
  [B, H, Lq] (varlen [H, total_q]); with `num_splits` > 1, float32 `out_accum` [S, B, H, Lq, Dv]
  and `softmax_lse_accum` [S, B, H, Lq] (varlen [S, H, total_q, Dv], [S, H, total_q]), returned
  and dropped by the interface; the scheduler's int32 `tile_count_semaphore` of
  `needs_semaphore + round(B, 4) * vectors` elements, allocated where `needs_semaphore` or varlen
  (`needs_semaphore`: on sm90 causal or local with one split, or varlen; on sm8x causal and not
  varlen, or varlen with splits; `vectors`: 2 for varlen's prepared batches, 1 unless local for
  the sorted batches, 1 if causal or local for the head swizzle), freed when `mha_fwd` returns. The
  interface passes `num_splits=1` and transformers never changes it, so no split runs for it;
  `num_splits <= 0` (FA3's own heuristic, `get_num_splits`) is refused here, as FA3's own fake
  kernel refuses it.
- backward: dq, dk, dv `empty_like` q, k, v (the interface's); `softmax_d` and `softmax_lse_log2`
  float32 [B, H, Lq↑kBlockM] (varlen [H, (total_q + B·kBlockM)↑kBlockM]); `dq_accum` float32
  [B, H, Lq↑kBlockM · D'] (varlen [H, that · D']); with fewer key/value heads than query heads,
  `dk_accum` and `dv_accum` float32 zeros [B, Hkv, Lk↑kBlockN · D'] (varlen [Hkv,
  (total_k + B·kBlockN)↑kBlockN, D']); the int32 `dq_semaphore` [⌈Lq/kBlockM⌉, B, H] and, in
  deterministic mode with grouped heads, `dk_semaphore` and `dv_semaphore` [⌈Lk/kBlockN⌉, B, Hkv].
  All are freed when the op returns (`softmax_d`, its one output, when the interface drops it).
  D' is the head dimension rounded up to 64, 96, 128, 192 or 256 (`round_up_headdim`); kBlockM
  and kBlockN are `mha_bwd`'s tile sizes for the GPU (`bwd_block_sizes`), which match the
  kernels' (`flash_bwd_launch_template.h`): sm90's (reading causal, local and softcap) from 9.0,
  sm86's on 8.6 and 8.9, sm80's on the other 8.x, by D' alone (sm80: 128/128 for 64, 64/128 for
  96 and 128, 64/80 for 192, 64/64 for 256; sm86: 64/128 for 64 and 96, 64/96 for 128, 64/64 for
  192, 32/64 for 256).

The GPUs planned (`fa3_refusal`, checked before any trace) are those FA3 3.0.0 has kernels for:
`hopper/setup.py` compiles the `_sm90.cu` instantiations for sm_90a and the `_sm80.cu` ones, which
hold both the Arch 80 and the Arch 86 kernels, for sm_80 machine code only (no PTX), which every
8.x GPU runs; `ARCH_SWITCH` takes the Arch 86 kernels on 8.6 and 8.9, Arch 80 on the other 8.x and
Arch 90 from 9.0 up, whose sm_90a code runs on 9.0 alone, so Blackwell (10.x, 12.x) has none. The
kernels refuse what FA3 refuses: a GPU older than Ampere, a dtype other than fp16/bf16 (fp8 runs
forward only, on Hopper only), a head dimension above 256 or not a multiple of 8, heads that do not
divide, and off Hopper a value head dimension other than the query's. On real CPU tensors the ops
compute the attention in float32 (for the tests); under fake tensors they only allocate.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from trainer_memcb.plan.settings.attention import fa3_refusal
from trainer_memcb.plan.step import flash_common
from trainer_memcb.plan.step.flash_common import round_multiple

__all__ = ["FA3_VERSION", "bwd_block_sizes", "fa3_arch", "fa3_note", "flash_attn_func", "flash_attn_varlen_func",
           "round_up_headdim"]

# The release whose interface and kernels are modelled (hopper/__init__.py, __version__).
FA3_VERSION = "3.0.0"


def fa3_note(kernels: str, compute_capability: Tuple[int, int] = (9, 0)) -> str:
    """The plan's note for the FA3 stand-ins that ran (`kernels`: "name (N calls), ...") on a GPU of
    `compute_capability` (Hopper's kernels from 9.0, the sm80 build's Ampere/Ada ones on 8.x)."""
    arch = fa3_arch(compute_capability)
    which = ("Hopper kernels" if arch >= 90 else
             f"Ampere/Ada kernels of its sm80 build, with sm{86 if arch in (86, 89) else 80} tile sizes")
    return (f"attention planned as flash-attn {FA3_VERSION}'s {which} (flash_attn_interface) run it on a GPU "
            f"(no flash-attn-3 package needed): {kernels}; out and softmax_lse saved for backward, the scheduler's "
            "semaphore in the forward, the backward's softmax_d, softmax_lse_log2, dq_accum (and dk_accum, dv_accum "
            "with grouped heads) and semaphores as workspace")


def round_up_headdim(head_size: int) -> int:
    """flash_api.cpp's `round_up_headdim` with every head dimension built: 64, 96, 128, 192 or 256."""
    for rounded in (64, 96, 128, 192):
        if head_size <= rounded:
            return rounded
    return 256


def fa3_arch(compute_capability: Tuple[int, int]) -> int:
    """flash_api.cpp's `arch`, major * 10 + minor, of a GPU of `compute_capability`."""
    major, minor = compute_capability
    return major * 10 + minor


# mha_bwd's tile sizes off Hopper by the rounded head dimension, (kBlockM, kBlockN): kBlockM_sm80 /
# kBlockN_sm80 (8.0 and any 8.x but 8.6 and 8.9) and kBlockM_sm86 / kBlockN_sm86 (8.6, 8.9); unlike sm90's
# neither reads causal, local or softcap. The same as run_mha_bwd_hdim{64..256}'s `Arch == 86 || Arch == 89`
# and else branches (flash_bwd_launch_template.h).
_BWD_BLOCKS_SM80 = {64: (128, 128), 96: (64, 128), 128: (64, 128), 192: (64, 80), 256: (64, 64)}
_BWD_BLOCKS_SM86 = {64: (64, 128), 96: (64, 128), 128: (64, 96), 192: (64, 64), 256: (32, 64)}


def bwd_block_sizes(head_size: int, causal: bool, local: bool, softcap: float,
                    compute_capability: Tuple[int, int]) -> Tuple[int, int]:
    """`mha_bwd`'s kBlockM and kBlockN on a GPU of `compute_capability` ("Very important that these
    match the kernel configs"): sm90's from 9.0 up, sm86's on 8.6 and 8.9, sm80's on the other 8.x.

    Examples:
        >>> bwd_block_sizes(128, True, False, 0.0, (9, 0)), bwd_block_sizes(128, True, False, 0.0, (8, 0))
        ((64, 128), (64, 128))
        >>> bwd_block_sizes(128, True, False, 0.0, (8, 9)), bwd_block_sizes(64, False, False, 0.0, (8, 0))
        ((64, 96), (128, 128))
    """
    rounded, arch = round_up_headdim(head_size), fa3_arch(compute_capability)
    if arch < 90:
        return (_BWD_BLOCKS_SM86 if arch in (86, 89) else _BWD_BLOCKS_SM80)[rounded]
    if rounded <= 64:
        block_m = 96 if causal and softcap > 0.0 else 128
    elif rounded <= 96:
        block_m = 64
    elif rounded <= 128:
        block_m = 64 if causal or local or softcap > 0.0 else 80
    else:
        block_m = 64
    block_n = 128 if rounded <= 128 else (96 if rounded <= 192 else 80)
    return block_m, block_n


def _causal_local(causal: bool, window: Tuple[int, int], seqlen_q: int, seqlen_k: int) -> Tuple[bool, bool]:
    """`mha_fwd`/`mha_bwd`'s reading of the window: (is_causal, is_local)."""
    left, right = window
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    if seqlen_q == 1 and left == -1 and right == -1:
        causal = False  # "causal=true is the same as causal=false in this case" (no paged KV)
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    return is_causal, (left >= 0 or right >= 0) and not is_causal


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool = False) -> None:
    """flash_api.cpp's checks (`mha_fwd`, `mha_bwd`) that refuse a run, and (forward: the backward
    runs where its forward did) the GPUs not planned."""
    refusal = None if backward else fa3_refusal(flash_common.STATE["compute_capability"])
    if refusal is not None:
        raise RuntimeError(f"flash_attention_3 is not planned on compute capability "
                           f"{'.'.join(map(str, flash_common.STATE['compute_capability']))}: {refusal}")
    allowed = (torch.float16, torch.bfloat16) if backward else (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
    if q.dtype not in allowed:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type" if backward else
                           "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    off_hopper = not backward and flash_common.STATE["compute_capability"][0] < 9  # mha_fwd's `dprops->major < 9`
    if off_hopper and q.dtype == torch.float8_e4m3fn:
        raise RuntimeError("FlashAttention on Ampere/Ada cards only supports fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    head_size, head_size_v = q.shape[-1], v.shape[-1]
    if max(head_size, head_size_v) > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if off_hopper and head_size_v != head_size:
        raise RuntimeError("Only Hopper supports different V headdim")
    alignment = 16 if q.dtype == torch.float8_e4m3fn else 8
    if head_size % alignment or head_size_v % alignment:
        raise RuntimeError(f"head_size should be a multiple of {alignment}")
    if q.shape[-2] % k.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


class _Shapes:
    """The sizes `mha_fwd`/`mha_bwd` read off their arguments (varlen where `cu_seqlens_q` is given)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                 max_seqlen_q: Optional[int], max_seqlen_k: Optional[int]) -> None:
        self.varlen = cu_seqlens_q is not None
        self.heads, self.heads_k = q.shape[-2], k.shape[-2]
        self.head_size, self.head_size_v = q.shape[-1], v.shape[-1]
        if self.varlen:
            self.batch = cu_seqlens_q.shape[0] - 1
            self.seqlen_q, self.seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
            self.total_q, self.total_k = q.shape[0], k.shape[0]
        else:
            self.batch, self.seqlen_q, self.seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            self.total_q, self.total_k = self.batch * self.seqlen_q, self.batch * self.seqlen_k


def _forward_allocations(q: torch.Tensor, shapes: _Shapes, causal: bool, window: Tuple[int, int],
                         num_splits: int, arch: int) -> Tuple[torch.Tensor, ...]:
    """`mha_fwd`'s allocations on a GPU of `arch` (`fa3_arch`), in its order: out, softmax_lse,
    tile_count_semaphore, out_accum, softmax_lse_accum."""
    if num_splits <= 0:
        raise NotImplementedError("flash-attn 3's num_splits heuristic (num_splits <= 0) is not planned")
    s, float32 = shapes, dict(dtype=torch.float32, device=q.device)
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    rows = (s.total_q,) if s.varlen else (s.batch, s.seqlen_q)
    out = torch.empty((*rows, s.heads, s.head_size_v), dtype=out_dtype, device=q.device)
    lse = torch.empty((s.heads, s.total_q) if s.varlen else (s.batch, s.heads, s.seqlen_q), **float32)
    is_causal, is_local = _causal_local(causal, window, s.seqlen_q, s.seqlen_k)
    # "We don't use the persistent scheduler if Split and not Varlen"; sm8x's scheduler counts tiles only for
    # causal attention or a split varlen one.
    needs_semaphore = (((is_causal or is_local) and num_splits == 1) or s.varlen if arch >= 90
                       else (is_causal and not s.varlen) or (s.varlen and num_splits > 1))
    semaphore = q.new_empty((0,), dtype=torch.int32)
    if needs_semaphore or s.varlen:
        vectors = (2 if s.varlen else 0) + (0 if is_local else 1) + (1 if is_causal or is_local else 0)
        semaphore = q.new_empty((int(needs_semaphore) + round_multiple(s.batch, 4) * vectors,), dtype=torch.int32)
    # Absent tensors: an empty one each (a custom op's outputs may not alias one another).
    out_accum, lse_accum = q.new_empty((0,), dtype=torch.float32), q.new_empty((0,), dtype=torch.float32)
    if num_splits > 1:
        split_rows = (num_splits, s.heads, s.total_q) if s.varlen else (num_splits, s.batch, s.heads, s.seqlen_q)
        out_accum = torch.empty((*split_rows, s.head_size_v), **float32)
        lse_accum = torch.empty(split_rows, **float32)
    return out, lse, semaphore, out_accum, lse_accum


def _backward_allocations(q: torch.Tensor, shapes: _Shapes, causal: bool, window: Tuple[int, int], softcap: float,
                          deterministic: bool, arch: int) -> Tuple[torch.Tensor, ...]:
    """`mha_bwd`'s allocations on a GPU of `arch` (`fa3_arch`, its tile sizes), in its order:
    softmax_d, softmax_lse_log2, dq_accum, dk_accum, dv_accum, dq_semaphore, dk_semaphore,
    dv_semaphore (the absent ones empty)."""
    s, float32, int32 = shapes, dict(dtype=torch.float32, device=q.device), dict(dtype=torch.int32, device=q.device)
    is_causal, is_local = _causal_local(causal, window, s.seqlen_q, s.seqlen_k)
    rounded = round_up_headdim(max(s.head_size, s.head_size_v))
    block_m, block_n = bwd_block_sizes(max(s.head_size, s.head_size_v), is_causal, is_local, softcap, divmod(arch, 10))
    seqlen_q_rounded, seqlen_k_rounded = round_multiple(s.seqlen_q, block_m), round_multiple(s.seqlen_k, block_n)
    total_q_rounded = round_multiple(s.total_q + s.batch * block_m, block_m)
    total_k_rounded = round_multiple(s.total_k + s.batch * block_n, block_n)
    rows = (s.heads, total_q_rounded) if s.varlen else (s.batch, s.heads, seqlen_q_rounded)
    softmax_d, softmax_lse_log2 = torch.empty(rows, **float32), torch.empty(rows, **float32)
    dq_accum = torch.empty((*rows[:-1], rows[-1] * rounded), **float32)
    dk_accum, dv_accum = q.new_empty((0,), **float32), q.new_empty((0,), **float32)  # absent: empty, unaliased
    if s.heads_k != s.heads:  # MQA / GQA: torch::zeros
        shape = (s.heads_k, total_k_rounded, rounded) if s.varlen else (s.batch, s.heads_k, seqlen_k_rounded * rounded)
        dk_accum, dv_accum = torch.zeros(shape, **float32), torch.zeros(shape, **float32)
    dq_semaphore = torch.empty((-(-s.seqlen_q // block_m), s.batch, s.heads), **int32)
    dk_semaphore, dv_semaphore = q.new_empty((0,), **int32), q.new_empty((0,), **int32)
    if s.heads_k != s.heads and deterministic:
        shape = (-(-s.seqlen_k // block_n), s.batch, s.heads_k)
        dk_semaphore, dv_semaphore = torch.zeros(shape, **int32), torch.zeros(shape, **int32)
    return softmax_d, softmax_lse_log2, dq_accum, dk_accum, dv_accum, dq_semaphore, dk_semaphore, dv_semaphore


def _ops() -> Any:
    """The two custom ops (forward, backward) in the `trainer_memcb_flash3` namespace, defined once."""
    namespace = getattr(torch.ops, "trainer_memcb_flash3", None)
    if namespace is not None and hasattr(namespace, "fwd"):
        return namespace
    _define_ops()
    return torch.ops.trainer_memcb_flash3


_COMMON = ("Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, float softmax_scale, "
           "bool causal, int window_size_left, int window_size_right, float softcap")


def _define_ops() -> None:
    """`trainer_memcb_flash3::fwd` (`mha_fwd`) and `::bwd` (`mha_bwd`), varlen where cu_seqlens are given."""
    _define_forward_op()
    _define_backward_op()
    _register_flop_formulas()


def _define_forward_op() -> None:
    """`trainer_memcb_flash3::fwd`: `mha_fwd`, its allocations the fake kernel's outputs."""
    @torch.library.custom_op("trainer_memcb_flash3::fwd", mutates_args=(), schema=(
        f"(Tensor q, Tensor k, Tensor v, {_COMMON}, int num_splits, int arch) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)"))
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
            cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
            softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float,
            num_splits: int, arch: int) -> Tuple[torch.Tensor, ...]:
        window = (window_size_left, window_size_right)
        out, lse, *rest = _forward_allocations(q, _Shapes(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k),
                                               causal, window, num_splits, arch)
        if cu_seqlens_q is None:
            values, logsumexp = flash_common.attention_math(q, k, v, softmax_scale, causal, window, softcap)
        else:
            values, logsumexp = flash_common.varlen_attention_math(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                                                 causal, window, softcap)
        out.copy_(values)
        lse.copy_(logsumexp)
        return (out, lse, *rest)

    @fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size_left,
          window_size_right, softcap, num_splits, arch):
        return _forward_allocations(q, _Shapes(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k), causal,
                                    (window_size_left, window_size_right), num_splits, arch)


def _define_backward_op() -> None:
    """`trainer_memcb_flash3::bwd`: `mha_bwd`, its workspaces the fake kernel's outputs."""
    @torch.library.custom_op("trainer_memcb_flash3::bwd", mutates_args=("dq", "dk", "dv"), schema=(
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, "
        f"Tensor(c!) dv, {_COMMON}, bool deterministic, int arch) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
            cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: Optional[int],
            max_seqlen_k: Optional[int], softmax_scale: float, causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, deterministic: bool, arch: int) -> Tuple[torch.Tensor, ...]:
        window = (window_size_left, window_size_right)
        if cu_seqlens_q is None:
            grads = flash_common.attention_math_backward(dout, q, k, v, softmax_scale, causal, window, softcap)
            for target, grad in zip((dq, dk, dv), grads):
                target.copy_(grad)
        else:
            flash_common.varlen_attention_math_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, (dq, dk, dv),
                                                      softmax_scale, causal, window, softcap)
        return _backward_allocations(q, _Shapes(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k), causal, window,
                                     softcap, deterministic, arch)

    @bwd.register_fake
    def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
          softmax_scale, causal, window_size_left, window_size_right, softcap, deterministic, arch):
        return _backward_allocations(q, _Shapes(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k), causal,
                                     (window_size_left, window_size_right), softcap, deterministic, arch)


def _register_flop_formulas() -> None:
    """The stand-ins' FLOPs, as `plan.step.flash_attn` counts FA2's (torch's SDPA formulas over
    flash-attn's layout; a varlen call as its total query tokens against `max_seqlen_k` keys each)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from trainer_memcb.plan.step.flops import register_flop_formula

    def heads_first(q: Any, k: Any, cu_seqlens_q: Any, max_seqlen_k: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        if cu_seqlens_q is None:
            return flash_common.heads_first(q), flash_common.heads_first(k)
        return (1, q[1], q[0], q[2]), (1, k[1], max_seqlen_k, k[2])

    def forward(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
                *args: Any, **kwargs: Any) -> int:
        query, key = heads_first(q, k, cu_seqlens_q, max_seqlen_k)
        return sdpa_flop_count(query, key, key)

    def backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any, cu_seqlens_q: Any,
                 cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, *args: Any, **kwargs: Any) -> int:
        query, key = heads_first(q, k, cu_seqlens_q, max_seqlen_k)
        return sdpa_backward_flop_count(query, query, key, key)

    ops = torch.ops.trainer_memcb_flash3
    register_flop_formula(ops.fwd, forward)
    register_flop_formula(ops.bwd, backward)


def _maybe_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous() if x.stride(-1) != 1 else x


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: List[Any], softmax_scale: float,
             causal: bool, window: Tuple[int, int], softcap: float, num_splits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The interface's `_flash_attn_forward` (its contiguous copies transient) and `mha_fwd`'s frees
    on the trace's GPU: out and softmax_lse kept, the semaphore and the split accumulators dropped."""
    q_, k_ = _maybe_contiguous(q), _maybe_contiguous(k)
    v_ = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
    out, lse, semaphore, out_accum, lse_accum = _ops().fwd(q_, k_, v_, *varlen, softmax_scale, causal, window[0],
                                                           window[1], softcap, num_splits,
                                                           fa3_arch(flash_common.STATE["compute_capability"]))
    del semaphore  # a local of mha_fwd
    del out_accum, lse_accum  # `out, softmax_lse, *rest = _flash_attn_forward(...)`
    return out, lse


def _backward(dout: torch.Tensor, saved: Tuple[torch.Tensor, ...], varlen: List[Any], ctx: Any) -> Tuple[torch.Tensor, ...]:
    """The interface's backward: dq, dk, dv `empty_like`, `_flash_attn_backward`, whose workspaces
    (and `softmax_d`, its return value, dropped by the caller) are freed when it returns."""
    q, k, v, out, softmax_lse = saved
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dout_, q_, k_, v_, out_ = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
    allocations = list(_ops().bwd(dout_, q_, k_, v_, out_, softmax_lse, dq, dk, dv, *varlen, ctx.softmax_scale,
                                  ctx.causal, ctx.window_size[0], ctx.window_size[1], ctx.softcap, ctx.deterministic,
                                  ctx.arch))
    del allocations[5:]  # the semaphores: locals of mha_bwd
    del allocations[1:]  # `softmax_d, *rest = flash_attn_3_gpu.bwd(...)`: rest dropped on return
    del allocations  # softmax_d, returned and not kept
    return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]


def _keep(ctx: Any, softmax_scale: float, causal: bool, window: Tuple[int, int], softcap: float,
          deterministic: bool) -> None:
    ctx.softmax_scale, ctx.causal, ctx.window_size, ctx.softcap, ctx.deterministic = (
        softmax_scale, causal, tuple(window), softcap, deterministic)
    ctx.arch = fa3_arch(flash_common.STATE["compute_capability"])  # the backward runs on its forward's GPU


class FlashAttnFunc(torch.autograd.Function):
    """flash_attn_interface.py's `FlashAttnFunc` (no qv, fp8 descales or attention chunks), over the stand-in ops."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float],
                causal: bool, window_size: Tuple[int, int], softcap: float, num_splits: int, deterministic: bool,
                return_softmax: bool) -> Any:
        _check(q, k, v)
        flash_common.count_kernel("flash_attn_func")
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        out, softmax_lse = _forward(q, k, v, [None, None, None, None], softmax_scale, causal, window_size, softcap,
                                    num_splits)
        ctx.save_for_backward(q, k, v, out, softmax_lse)
        _keep(ctx, softmax_scale, causal, window_size, softcap, deterministic)
        return (out, softmax_lse) if return_softmax else out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *args: Any) -> Tuple[Optional[torch.Tensor], ...]:
        _check(*ctx.saved_tensors[:3], backward=True)
        dq, dk, dv = _backward(dout, ctx.saved_tensors, [None, None, None, None], ctx)
        return (dq, dk, dv) + (None,) * 7


class FlashAttnVarlenFunc(torch.autograd.Function):
    """flash_attn_interface.py's `FlashAttnVarlenFunc` (no seqused, qv, fp8 descales or attention chunks)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float],
                causal: bool, window_size: Tuple[int, int], softcap: float, num_splits: int, deterministic: bool,
                return_softmax: bool) -> Any:
        _check(q, k, v)
        flash_common.count_kernel("flash_attn_varlen_func")
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        varlen = [cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k)]
        out, softmax_lse = _forward(q, k, v, varlen, softmax_scale, causal, window_size, softcap, num_splits)
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        _keep(ctx, softmax_scale, causal, window_size, softcap, deterministic)
        return (out, softmax_lse) if return_softmax else out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *args: Any) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        _check(q, k, v, backward=True)
        varlen = [cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k]
        dq, dk, dv = _backward(dout, (q, k, v, out, softmax_lse), varlen, ctx)
        return (dq, dk, dv) + (None,) * 11


def _unplanned(**features: Any) -> None:
    named = [name for name, value in features.items() if value is not None and value is not False]
    if named:
        raise NotImplementedError(f"flash-attn 3's {', '.join(named)} are not planned")


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None,
                    causal: bool = False, qv: Any = None, q_descale: Any = None, k_descale: Any = None,
                    v_descale: Any = None, window_size: Tuple[int, int] = (-1, -1), attention_chunk: int = 0,
                    softcap: float = 0.0, num_splits: int = 1, pack_gqa: Optional[bool] = None,
                    deterministic: bool = False, sm_margin: int = 0, return_attn_probs: bool = False) -> Any:
    """flash_attn_interface's `flash_attn_func` (FA3): q [B, Lq, H, D], k and v [B, Lk, Hkv, D]."""
    _unplanned(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
               attention_chunk=attention_chunk or None)
    return FlashAttnFunc.apply(q, k, v, softmax_scale, causal, tuple(window_size), softcap, num_splits, deterministic,
                               return_attn_probs)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, seqused_q: Any = None,
                           seqused_k: Any = None, softmax_scale: Optional[float] = None, causal: bool = False,
                           qv: Any = None, q_descale: Any = None, k_descale: Any = None, v_descale: Any = None,
                           window_size: Tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                           num_splits: int = 1, pack_gqa: Optional[bool] = None, deterministic: bool = False,
                           sm_margin: int = 0, return_attn_probs: bool = False) -> Any:
    """flash_attn_interface's `flash_attn_varlen_func` (FA3): q [total_q, H, D], k and v [total_k, Hkv, D]."""
    _unplanned(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale, k_descale=k_descale,
               v_descale=v_descale, attention_chunk=attention_chunk or None)
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     causal, tuple(window_size), softcap, num_splits, deterministic, return_attn_probs)
