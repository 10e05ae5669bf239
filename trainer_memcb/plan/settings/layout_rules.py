"""The rules between the layout's numbers and names that need no model and no torch: checked by
`Setup` and, where the command line alone gives both values, by `trainer-memcb estimate` before
torch is imported, so that the same mistake gets the same line, at once."""

from __future__ import annotations

from typing import Optional

__all__ = ["nodes_problem", "precision_sharding_problem"]


def nodes_problem(world_size: int, nodes: int) -> Optional[str]:
    """Why `world_size` processes cannot run on `nodes` nodes, or None: each node runs as many."""
    return f"world_size={world_size} is not a multiple of nodes={nodes}" if world_size % nodes else None


def precision_sharding_problem(precision: str, sharding: str) -> Optional[str]:
    """Why `precision` cannot run under `sharding`, or None: DeepSpeed's precisions are its engine's."""
    if precision.startswith("deepspeed-") and sharding.startswith("fsdp-"):
        return f"precision={precision!r} is DeepSpeed's: use it with sharding none, ddp, zero1, zero2 or zero3"
    return None
