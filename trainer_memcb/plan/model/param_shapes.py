"""A parameter's real shape, whatever the training library did to the tensor this process sees.

After `deepspeed.initialize` with ZeRO-3 (or under `deepspeed.zero.Init`), every parameter is an
empty tensor of shape `(0,)`: its values live in partitions, and DeepSpeed keeps the real shape in
`ds_shape` and the real count in `ds_numel` (deepspeed/runtime/zero/partition_parameters.py,
`_convert_to_deepspeed_param`). A DTensor (FSDP2) reports its global shape as `.shape` already.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["is_zero3_partitioned", "logical_numel", "logical_shape"]


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 has taken over `param` (it carries `ds_shape`)."""
    return getattr(param, "ds_shape", None) is not None


def logical_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """The shape the parameter has in the model: `ds_shape` under ZeRO-3, else `param.shape`.

    Examples:
        >>> import torch
        >>> stand_in = torch.nn.Parameter(torch.empty(0))
        >>> stand_in.ds_shape, stand_in.ds_numel = torch.Size([7, 4]), 28
        >>> logical_shape(stand_in), logical_numel(stand_in)
        ((7, 4), 28)
    """
    ds_shape = getattr(param, "ds_shape", None)
    if ds_shape is not None:
        return tuple(int(size) for size in ds_shape)
    return tuple(param.shape)


def logical_numel(param: torch.Tensor) -> int:
    """Values of the parameter in the model: `ds_numel` under ZeRO-3, else `param.numel()`."""
    ds_numel = getattr(param, "ds_numel", None)
    if ds_numel is not None:
        return int(ds_numel)
    if is_zero3_partitioned(param):
        return math.prod(logical_shape(param))
    return param.numel()
