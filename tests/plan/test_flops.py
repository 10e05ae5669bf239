"""The traced step's FLOPs of causal attention: torch's formulas count the whole square of scores,
the kernels compute the kept part (trainer_memcb.plan.step.flops), checked op by op on the CPU
with real tensors, as the trace's tracker calls the counter after each op."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer_memcb.plan.step.flops import FlopCounting, kept_scores

_ATEN = torch.ops.aten


@pytest.mark.parametrize("shape,kept", [
    ((4, 4, -1, 0, False), 10), ((4, 4, -1, 0, True), 10),
    # Fewer queries than keys: SDPA's mask at the top left, flash-attn's at the bottom right.
    ((2, 4, -1, 0, False), 1 + 2), ((2, 4, -1, 0, True), 3 + 4),
    # A window of 3 keys before the diagonal: rows keep 1, 2, 3, then 4 each.
    ((8, 8, 3, 0, True), 1 + 2 + 3 + 4 * 5), ((4, 4, -1, -1, False), 16)])
def test_kept_scores_by_hand(shape, kept):
    assert kept_scores(*shape) == kept


def _counted(func, *args, **kwargs) -> int:
    totals: list = []
    with FlopCounting(totals, SimpleNamespace(count_flops=None)) as counting:
        counting.count(func, func(*args, **kwargs), args, kwargs)
    return totals[0]


def test_sdpa_cpu_causal_counts_the_scores_below_the_diagonal():
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    square = _counted(_ATEN._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, False)
    # torch's formula: QK^T and PV, 2 x (2 heads x 32 x 32 x 8) multiply-adds each.
    assert square == 2 * 2 * (2 * 32 * 32 * 8) == 65_536
    causal = _counted(_ATEN._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, True)
    assert causal == square * 528 // 1024 == 33_792
    out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    backward = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert _counted(backward, torch.ones_like(out), q, k, v, out, lse, 0.0, True) == 163_840 * 528 // 1024


def test_flash_attn_stand_ins_count_causal_and_windowed_scores_at_the_bottom_right():
    from trainer_memcb.plan.step.flash_attn import _ops

    fwd = _ops().fwd.default
    q, k, v = (torch.randn(1, 32, 2, 8) for _ in range(3))
    full = _counted(fwd, q, k, v, 0.0, 8 ** -0.5, False, -1, -1, 0.0, False)
    assert full == 65_536
    assert _counted(fwd, q, k, v, 0.0, 8 ** -0.5, True, -1, -1, 0.0, False) == 65_536 * 528 // 1024
    # A sliding window of 4 keys before the diagonal (Mistral's kind): 1 + 2 + 3 + 4 + 5 x 28 = 150.
    assert _counted(fwd, q, k, v, 0.0, 8 ** -0.5, True, 4, -1, 0.0, False) == 65_536 * 150 // 1024
