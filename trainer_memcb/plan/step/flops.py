"""The FLOPs of a traced step, as torch's FLOP counter counts them, counted while the trace runs.

`torch.utils.flop_counter.FlopCounterMode` holds the formulas (its `flop_registry`: matmuls,
convolutions, the CUDA attention kernels) and counts them in a dispatch mode; the fake step runs
attention through the CPU flash kernel, given the CUDA flash kernel's formula here. Only its
counting is used, op by op as the trace's tracker sees them: FlopCounterMode's own mode decomposes
the ops its registry lacks and its module tracker hooks every module's outputs, and both change the
storages a step with checkpointing keeps alive; here each op runs as it is, so the trace counts the
same storages with it as without it.

Torch's attention formulas count the whole square of scores ("We aren't accounting for causal
attention here"); a causal kernel skips the masked half (flash's tiles above the diagonal), so an
attention op called causal is counted here for the scores it keeps (`causal_kept_share`): torch's
own ops' masks aligned top-left as SDPA's `is_causal`, flash-attn's bottom-right with its window, a
varlen call by its longest sequences (exact for sequences of one length, as the plan traces them).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["FlopCounting", "register_flop_formula", "causal_kept_share", "kept_scores"]

_ATEN = torch.ops.aten


def _sdpa_cpu(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                       **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, query, key, value)


# The formulas of ops defined after a counter may have been made (the flash-attention stand-ins'
# custom ops, `trainer_memcb.plan.step.flash_attn`): op packet -> formula of shapes, as
# `FlopCounterMode`'s `custom_mapping` takes them.
_LATE_FORMULAS: Dict[Any, Callable[..., int]] = {}


def register_flop_formula(packet: Any, formula: Callable[..., int]) -> None:
    """Count `packet`'s FLOPs with `formula` (called with the shapes of its tensor arguments, as a
    `FlopCounterMode` custom mapping is) in every count from now on, counters made before included."""
    _LATE_FORMULAS[packet] = formula


@functools.lru_cache(maxsize=64)
def kept_scores(seq_q: int, seq_k: int, left: int = -1, right: int = 0, bottom_right: bool = False) -> int:
    """How many of the `seq_q x seq_k` scores a masked kernel computes: each query row keeps the keys
    from `left` before its diagonal (-1: all) to `right` after it (-1: all), the diagonal aligned
    at the top left (SDPA's `is_causal`) or the bottom right (flash-attn 2.1 on)."""
    offset = seq_k - seq_q if bottom_right else 0
    kept = 0
    for row in range(seq_q):
        low = 0 if left < 0 else max(0, row + offset - left)
        high = seq_k - 1 if right < 0 else min(seq_k - 1, row + offset + right)
        kept += max(0, high - low + 1)
    return kept


@functools.lru_cache(maxsize=None)
def _mask_argument_names(func: Any) -> Optional[Tuple[str, ...]]:
    """The names of `func`'s arguments where it takes a causal flag (an attention op), else None:
    read once per op, as every counted matmul passes here."""
    names = tuple(argument.name for argument in func._schema.arguments)
    return names if "is_causal" in names or "causal" in names else None


def causal_kept_share(func: Any, args: Any, kwargs: Any) -> Optional[Tuple[int, int]]:
    """(scores kept, scores in the square) of an attention op called causal or with a window; None
    for any other op or call. Read by the op's argument names: torch's SDPA ops (`query`, `key`,
    `is_causal`, heads first) and flash-attn's (`q`, `k`, `causal`, `window_size_left`, sequence
    second, or `max_seqlen_q`/`max_seqlen_k` when varlen)."""
    names = _mask_argument_names(func)
    if names is None:
        return None
    bound = dict(zip(names, args), **kwargs)
    if bound.get("is_causal") is True:
        query, key = bound.get("query"), bound.get("key")
        if query is None or key is None:
            return None
        seq_q, seq_k = query.shape[-2], key.shape[-2]
        return kept_scores(seq_q, seq_k), seq_q * seq_k
    if "causal" not in bound or "q" not in bound:
        return None
    left, right = bound.get("window_size_left", -1), bound.get("window_size_right", -1)
    if bound["causal"]:
        right = 0
    if left < 0 and right < 0:
        return None
    if bound.get("max_seqlen_q") is not None:  # varlen (FA3's ops take None where not)
        seq_q, seq_k = bound["max_seqlen_q"], bound["max_seqlen_k"]
    else:
        seq_q, seq_k = bound["q"].shape[1], bound["k"].shape[1]
    return kept_scores(seq_q, seq_k, left, right, bottom_right=True), seq_q * seq_k


class FlopCounting:
    """Count the FLOPs of each op the tracker `tracker` sees while inside, and on leaving append
    the total counted to `totals`. The tracker calls the count after each op
    (`LiveStorages.count_flops`): a dispatch mode of its own would add a layer of Python dispatch
    to every op of the step (about a tenth of a trace), for the same count."""

    def __init__(self, totals: List[int], tracker: Any) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.totals, self.tracker, self.total = totals, tracker, 0
        self.counter = FlopCounterMode(display=False, custom_mapping={
            _ATEN._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
            _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward})

    def count(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        # FlopCounterMode._count_flops: the formula of the op's packet, filed under "Global" (its
        # module tracker is never entered here).
        packet = func._overloadpacket
        registry = self.counter.flop_registry
        if packet not in registry:
            if packet not in _LATE_FORMULAS:
                return  # no formula: nothing counted
            from torch.utils.flop_counter import shape_wrapper

            registry[packet] = shape_wrapper(_LATE_FORMULAS[packet])
        # FlopCounterMode._count_flops's call of the formula, then the causal share (module docstring).
        flops = registry[packet](*args, **kwargs, out_val=out)
        share = causal_kept_share(func, args, kwargs)
        self.total += flops if share is None else flops * share[0] // share[1]

    def so_far(self) -> int:
        """The FLOPs counted up to now."""
        return self.total

    def __enter__(self) -> "FlopCounting":
        self.tracker.count_flops = self.count
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.count_flops = None
        self.totals.append(self.so_far())
