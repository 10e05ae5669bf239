"""What a GPU kernel allocates for itself while it runs and frees when it returns, made on the trace
as byte buffers in the kernel's order: memory-efficient attention's backward temporaries
(`trainer_memcb.plan.device.efficient_attention`), cuDNN's frontend workspace
(`trainer_memcb.plan.device.cudnn_attention`)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

__all__ = ["hold_while_the_kernel_runs"]


def hold_while_the_kernel_runs(like: torch.Tensor, allocations: List[Tuple[str, int]]) -> None:
    """Make and free `allocations`' bytes in their order (a name, or "~name", which frees name), on
    `like`'s device, then free what is left, as the kernel's return does."""
    held: Dict[str, torch.Tensor] = {}
    for name, nbytes in allocations:
        if name.startswith("~"):
            del held[name[1:]]
        else:
            held[name] = like.new_empty(nbytes, dtype=torch.uint8)
    held.clear()
