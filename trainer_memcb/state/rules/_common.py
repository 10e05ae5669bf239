"""Pieces several rules share."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from trainer_memcb.state.registry import ParamInfo

__all__ = ["torch_step_bytes", "num_blocks", "factored_numels", "step_and_buffers"]

# Bytes of one parameter-sized buffer: (parameter, its group, the optimizer) -> bytes.
BufferBytes = Callable[[ParamInfo, Mapping[str, Any], Any], int]


def torch_step_bytes(group: Mapping[str, Any]) -> int:
    """Bytes of a 0-dim scalar tensor (`step`, NAdam's `mu_product`, ...) torch's optimizers keep
    per parameter.

    torch/optim/optimizer.py `_get_scalar_dtype(is_fused)`: float32, or float64 when the default
    dtype is float64 and the optimizer is not fused (fused kernels always take float32).
    """
    if not group.get("fused") and torch.get_default_dtype() == torch.float64:
        return 8
    return 4


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks of `block_size` values covering `numel` values, the last one partial."""
    return -(-numel // block_size)


def factored_numels(shape: Sequence[int]) -> Tuple[int, int]:
    """Values in Adafactor's row and column factors of a parameter with `len(shape) >= 2`:
    the shape with its last dimension dropped, and with its second to last dimension dropped."""
    return math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]


def _param_bytes(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> int:
    return param.num_bytes


def step_and_buffers(
    scalars: Sequence[str],
    buffers: Mapping[str, Optional[str]],
    buffer_bytes: BufferBytes = _param_bytes,
    scalar_bytes: Callable[[Mapping[str, Any]], int] = torch_step_bytes,
) -> Callable[[ParamInfo, Mapping[str, Any], Any], Dict[str, int]]:
    """A per-parameter rule for the common shape of optimizer state: a few 0-dim scalar tensors
    plus buffers as large as the parameter.

    Args:
        scalars: keys of the 0-dim scalar tensors (`step`, ...), `scalar_bytes(group)` each.
        buffers: key of each parameter-sized buffer -> the group option that switches it on
            (`"amsgrad"`, `"momentum"`), or None when it is always there.
        buffer_bytes: bytes of one buffer; by default the parameter's own bytes (`zeros_like(p)`).
        scalar_bytes: bytes of one scalar tensor, from the group.
    """

    def rule(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
        state = {key: scalar_bytes(group) for key in scalars}
        for key, option in buffers.items():
            if option is None or group.get(option):
                state[key] = buffer_bytes(param, group, optimizer)
        return state

    return rule
