"""The FLOPs of a traced step, as torch's FLOP counter counts them, counted while the trace runs.

`torch.utils.flop_counter.FlopCounterMode` holds the formulas (its `flop_registry`: matmuls,
convolutions, the CUDA attention kernels) and counts them in a dispatch mode; the fake step runs
attention through the CPU flash kernel, given the CUDA flash kernel's formula here. Only its
counting is used, in a dispatch mode of its own: FlopCounterMode's own mode decomposes the ops its
registry lacks and its module tracker hooks every module's outputs, and both change the storages a
step with checkpointing keeps alive; this one runs each op as it is, so the trace counts the same
storages with it as without it.
"""

from __future__ import annotations

from typing import Any, List

import torch

__all__ = ["FlopCounting"]

_ATEN = torch.ops.aten
_DEVICE = torch.ops.prim.device.default


def _sdpa_cpu(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                       **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, query, key, value)


def FlopCounting(totals: List[int]) -> Any:
    """A dispatch mode that counts the FLOPs of each op it sees and, on leaving, appends the total
    it counted to `totals`."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping={
        _ATEN._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
        _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward})

    class _Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is _DEVICE:
                return func(*args, **(kwargs or {}))
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # FlopCounterMode._count_flops: the formula of the op's packet, filed under "Global"
            # (its module tracker is never entered here).
            return counter._count_flops(func._overloadpacket, out, args, kwargs)

        def so_far(self) -> int:
            """The FLOPs counted up to now."""
            return counter.get_total_flops()

        def __exit__(self, *exc: Any) -> Any:
            result = super().__exit__(*exc)
            totals.append(counter.get_total_flops())
            return result

    return _Counting()
