"""What the stand-ins of flash-attn 2 (`plan.step.flash_attn`) and flash-attn 3 (`plan.step.flash_attn3`)
share: the state of the trace they run in (the GPU's compute capability and SM count, the record of
the kernels run), flash_api.cpp's `round_multiple`, the layout flash-attn takes ([B, L, H, D]) as
torch's FLOP formulas take it, and the attention's math on real CPU tensors (for the tests: values
and gradients equal to `scaled_dot_product_attention`'s; under fake tensors the kernels only
allocate).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["DEFAULT_SM_COUNT", "STATE", "attention_math", "attention_math_backward", "count_kernel", "heads_first",
           "round_multiple", "varlen_attention_math", "varlen_attention_math_backward"]

# The SMs of the default GPU of a plan (sm80: the A100's), for flash-attn 2's split-KV heuristic.
DEFAULT_SM_COUNT = 108

STATE: Dict[str, Any] = {"compute_capability": (8, 0), "sm_count": DEFAULT_SM_COUNT, "run": None}


def round_multiple(x: int, m: int) -> int:
    """flash_api.cpp's `round_multiple`: x rounded up to a multiple of m."""
    return (x + m - 1) // m * m


def count_kernel(kernel: str) -> None:
    """Count a run of `kernel` in the record of the trace, where one is kept."""
    if STATE["run"] is not None:
        STATE["run"].count(kernel)


def heads_first(shape: Any) -> Tuple[int, ...]:
    """[B, L, H, D] as SDPA's FLOP formulas take it, [B, H, L, D]."""
    return (shape[0], shape[2], shape[1], shape[3])


def masked_scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, window: Tuple[int, int],
                  softcap: float) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """float32 [B, H, Lq, Lk] scores of [B, L, H, D] inputs (k's heads repeated to q's), masked as
    flash-attn masks (causal aligned to the bottom right, the window), with softcap's tanh."""
    heads = q.shape[-2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(heads // k.shape[-2], dim=1)
    scores = qf @ kf.transpose(-1, -2) * scale
    capped = None
    if softcap > 0.0:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    lq, lk = scores.shape[-2], scores.shape[-1]
    row = torch.arange(lq).unsqueeze(-1) + (lk - lq)
    col = torch.arange(lk)
    left, right = window
    if causal:
        right = 0
    masked = torch.zeros(lq, lk, dtype=torch.bool)
    if right >= 0:
        masked |= col > row + right
    if left >= 0:
        masked |= col < row - left
    return scores.masked_fill(masked, float("-inf")), masked, capped


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                    window: Tuple[int, int], softcap: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of [B, L, H, D] inputs in float32: output in q's dtype and logsumexp [B, H, Lq]."""
    scores, _, _ = masked_scores(q, k, scale, causal, window, softcap)
    vf = v.float().transpose(1, 2).repeat_interleave(q.shape[-2] // v.shape[-2], dim=1)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vf
    return out.transpose(1, 2).to(q.dtype), lse


def attention_math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             causal: bool, window: Tuple[int, int],
                             softcap: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `attention_math`'s output (custom ops run below autograd, so by hand)."""
    heads, kv_heads = q.shape[-2], k.shape[-2]
    scores, _, capped = masked_scores(q, k, scale, causal, window, softcap)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    qf, kf = q.float().transpose(1, 2), k.float().transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    do = dout.float().transpose(1, 2)
    dv = probs.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
    if capped is not None:
        ds = ds * (1 - capped * capped)
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ qf * scale

    def grouped(grad: torch.Tensor) -> torch.Tensor:
        b, _, length, d = grad.shape
        return grad.view(b, kv_heads, heads // kv_heads, length, d).sum(2)

    return (dq.transpose(1, 2).to(q.dtype), grouped(dk).transpose(1, 2).to(k.dtype),
            grouped(dv).transpose(1, 2).to(v.dtype))


def varlen_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, scale: float, causal: bool, window: Tuple[int, int],
                          softcap: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """`attention_math` of each sequence of [total, H, D] inputs (real tensors: the bounds are read):
    the output like q and the logsumexp [H, total_q], float32."""
    out, lse = torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        sq, eq, sk, ek = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        one_out, one_lse = attention_math(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], scale, causal, window,
                                           softcap)
        out[sq:eq] = one_out[0]
        lse[:, sq:eq] = one_lse[0]
    return out, lse


def varlen_attention_math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                   grads: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float, causal: bool,
                                   window: Tuple[int, int], softcap: float) -> None:
    """`attention_math_backward` of each sequence, written into `grads` (dq, dk, dv), as the kernels write them."""
    dq, dk, dv = grads
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        sq, eq, sk, ek = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        one = attention_math_backward(dout[None, sq:eq], q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], scale,
                                       causal, window, softcap)
        dq[sq:eq], dk[sk:ek], dv[sk:ek] = one[0][0], one[1][0], one[2][0]
