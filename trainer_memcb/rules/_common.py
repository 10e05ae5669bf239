"""Pieces several rules share."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["torch_step_bytes"]


def torch_step_bytes(group: Mapping[str, Any]) -> int:
    """Bytes of the 0-dim `step` tensor torch's optimizers keep per parameter.

    torch/optim/optimizer.py `_get_scalar_dtype(is_fused)`: float32, or float64 when the default
    dtype is float64 and the optimizer is not fused (fused kernels always take float32).
    """
    if not group.get("fused") and torch.get_default_dtype() == torch.float64:
        return 8
    return 4
