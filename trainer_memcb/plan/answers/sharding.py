"""How many values of each parameter one process holds, per sharding: the partition arithmetic.

Each function follows the library's own code; the ZeRO ones live beside the ZeRO estimate rules
(`trainer_memcb.state.rules.deepspeed_zero`) and are re-exported here.

- FSDP2 (`torch.distributed.fsdp.fully_shard`, torch 2.13 `_fsdp_param.py`
  `FSDPParam._init_sharded_param`): a parameter is split on dim 0 with `torch.chunk` semantics,
  `ceil(rows / W)` rows per rank, the last ranks fewer (or none). Each rank allocates its shard
  padded to `ceil(rows / W)` rows (`padded_sharded_param = param_data.new_zeros(padded_sharded_size)`)
  and its local tensor is a view of the first rows of it: every rank's storage holds the padded size.
  The optimizer state is made like the local view (`zeros_like`), so rank 0, whose view is the full
  `ceil(rows / W)` rows, holds the most.
- DeepSpeed ZeRO-1/2: `zero12_partition_numel` (the flat partitions), `zero12_gradient_numel` (the
  reduced 16-bit gradients a rank holds at its step); ZeRO-3: `zero3_partition_numel`,
  `zero3_sub_group_numels`.
"""

from __future__ import annotations

import math
from typing import Tuple

from trainer_memcb.state.rules.deepspeed_zero import (
    zero3_partition_numel,
    zero3_sub_group_numels,
    zero12_gradient_numel,
    zero12_partition_numel,
)

__all__ = [
    "fsdp_shard_rows",
    "fsdp_local_shape",
    "fsdp_padded_shard_numel",
    "zero12_gradient_numel",
    "zero12_partition_numel",
    "zero3_partition_numel",
    "zero3_sub_group_numels",
]


def fsdp_shard_rows(rows: int, world_size: int) -> int:
    """Rows of dim 0 in the largest (first) shard, and in every rank's padded storage: `ceil(rows / W)`."""
    return -(-rows // world_size)


def fsdp_local_shape(shape: Tuple[int, ...], world_size: int) -> Tuple[int, ...]:
    """The first rank's local shard of a parameter of `shape` (a 0-dim parameter is one row)."""
    if not shape:
        return (1,)
    return (fsdp_shard_rows(shape[0], world_size),) + tuple(shape[1:])


def fsdp_padded_shard_numel(shape: Tuple[int, ...], world_size: int) -> int:
    """Values in each rank's padded shard storage of a parameter of `shape`.

    Examples:
        >>> from trainer_memcb.plan.answers.sharding import fsdp_padded_shard_numel
        >>> fsdp_padded_shard_numel((7, 4), world_size=2)  # 4 rows of 4 on every rank
        16
    """
    return math.prod(fsdp_local_shape(tuple(shape), world_size))
