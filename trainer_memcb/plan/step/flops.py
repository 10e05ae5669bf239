"""The FLOPs of a traced step, as torch's FLOP counter counts them, counted while the trace runs.

`torch.utils.flop_counter.FlopCounterMode` holds the formulas (its `flop_registry`: matmuls,
convolutions, the CUDA attention kernels) and counts them in a dispatch mode; the fake step runs
attention through the CPU flash kernel, given the CUDA flash kernel's formula here. Only its
counting is used, op by op as the trace's tracker sees them: FlopCounterMode's own mode decomposes
the ops its registry lacks and its module tracker hooks every module's outputs, and both change the
storages a step with checkpointing keeps alive; here each op runs as it is, so the trace counts the
same storages with it as without it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

__all__ = ["FlopCounting", "register_flop_formula"]

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


class FlopCounting:
    """Count the FLOPs of each op the tracker `tracker` sees while inside, and on leaving append
    the total counted to `totals`. The tracker calls the count after each op
    (`LiveStorages.count_flops`): a dispatch mode of its own would add a layer of Python dispatch
    to every op of the step (about a tenth of a trace), for the same count."""

    def __init__(self, totals: List[int], tracker: Any) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.totals, self.tracker = totals, tracker
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
        self.counter._count_flops(packet, out, args, kwargs)

    def so_far(self) -> int:
        """The FLOPs counted up to now."""
        return self.counter.get_total_flops()

    def __enter__(self) -> "FlopCounting":
        self.tracker.count_flops = self.count
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.count_flops = None
        self.totals.append(self.so_far())
