"""The job's setup: how many processes, how the model states are sharded, in which precision,
what is offloaded; and the precisions as users name them.

`Setup` is what the model-states plan lays out over the processes; `setup_of` reads it from the
step's resolved settings (`trainer_memcb.plan.settings.step_settings.StepSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from trainer_memcb.plan.settings.layout_rules import nodes_problem, precision_sharding_problem
from trainer_memcb.plan.settings.step_settings import StepSettings

__all__ = ["PRECISIONS", "PRECISION_ALIASES", "PRECISION_DTYPES", "SHARDINGS", "ZERO_STAGES", "Setup", "setup_of"]

SHARDINGS = ("none", "ddp", "fsdp-full-shard", "fsdp-shard-grad-op", "zero1", "zero2", "zero3")
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}

# Precision setups, as users name them -> bytes per parameter value and per gradient value.
# - fp32: no mixed precision.
# - autocast-bf16/fp16: the Trainer's bf16=True / fp16=True without DeepSpeed: torch autocast casts
#   inside the forward; the weights, their gradients and the optimizer stay fp32, no master copy.
# - bf16, fp16: the model loaded in bf16 / fp16 (`dtype=torch.bfloat16`) and trained so: everything
#   in 16 bits (LOMO's setup: fp16 weights, no master copy).
# - deepspeed-bf16/fp16: DeepSpeed's bf16/fp16 sections: 16-bit weights and gradients, fp32 master
#   weights that the optimizer updates (ZeRO only).
PRECISIONS: Dict[str, int] = {
    "fp32": 4,
    "autocast-bf16": 4,
    "autocast-fp16": 4,
    "bf16": 2,
    "fp16": 2,
    "deepspeed-bf16": 2,
    "deepspeed-fp16": 2,
}
# Spellings people use for the same setups.
PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "amp-bf16": "autocast-bf16",
                     "amp-fp16": "autocast-fp16", "mixed-bf16": "deepspeed-bf16", "mixed-fp16": "deepspeed-fp16"}
# The dtype of a 2- or 4-byte value in each precision setup.
PRECISION_DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float32, "autocast-bf16": torch.float32, "autocast-fp16": torch.float32,
    "bf16": torch.bfloat16, "fp16": torch.float16, "deepspeed-bf16": torch.bfloat16, "deepspeed-fp16": torch.float16,
}

@dataclass(frozen=True)
class Setup:
    """How the job runs.

    Attributes:
        world_size: processes in the job (data-parallel degree), W.
        nodes: machines; `world_size` must be a multiple of it (CPU figures are per node).
        sharding: one of `SHARDINGS`.
        precision: one of `PRECISIONS` (or an alias such as `mixed-bf16`).
        offload_optimizer: ZeRO-Offload: optimizer state and master weights on the CPU.
        offload_params: ZeRO-3 parameter offload, or FSDP's `CPUOffload(offload_params=True)`
            (parameters, gradients and optimizer state on the CPU).
        sub_group_size: ZeRO-3's `sub_group_size` (values per flat fp32 sub-group).
        replicate: FSDP2's HSDP: the states sharded over `world_size // replicate` processes and
            replicated `replicate` times (a 2-D mesh, `fully_shard(mesh=...)`).
    """

    world_size: int = 1
    nodes: int = 1
    sharding: str = "none"
    precision: str = "fp32"
    offload_optimizer: bool = False
    offload_params: bool = False
    sub_group_size: int = 1_000_000_000
    replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "nodes", "sub_group_size", "replicate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")
        problem = nodes_problem(self.world_size, self.nodes)
        if problem is not None:
            raise ValueError(problem)
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding={self.sharding!r} is not one of: {', '.join(SHARDINGS)}")
        precision = PRECISION_ALIASES.get(self.precision, self.precision)
        if precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of: {', '.join(PRECISIONS)}")
        object.__setattr__(self, "precision", precision)
        problem = precision_sharding_problem(precision, self.sharding)
        if problem is not None:
            raise ValueError(problem)
        if self.offload_optimizer and not self.is_zero:
            raise ValueError("offload_optimizer is DeepSpeed ZeRO's: use it with sharding zero1, zero2 or zero3 "
                             "(FSDP offloads the optimizer state with offload_params)")
        if self.offload_params and self.sharding not in ("zero3", "fsdp-full-shard", "fsdp-shard-grad-op"):
            raise ValueError(f"offload_params needs sharding zero3 or fsdp-*, not {self.sharding!r}")
        if self.replicate > 1 and not self.is_fsdp:
            raise ValueError(f"replicate={self.replicate} is FSDP2's HSDP: use it with sharding fsdp-full-shard or "
                             f"fsdp-shard-grad-op, not {self.sharding!r}")
        if self.world_size % self.replicate:
            raise ValueError(f"replicate={self.replicate} does not divide world_size={self.world_size}")

    @property
    def is_zero(self) -> bool:
        return self.sharding in ZERO_STAGES

    @property
    def is_fsdp(self) -> bool:
        return self.sharding.startswith("fsdp-")

    @property
    def processes_per_node(self) -> int:
        return self.world_size // self.nodes


def setup_of(settings: StepSettings, setup: Optional[Setup] = None) -> Setup:
    """The model-states plan's `Setup` of resolved settings (`setup` itself when given)."""
    if setup is not None:
        return setup
    return Setup(world_size=settings.world_size, nodes=settings.nodes, sharding=settings.sharding,
                 precision=settings.precision, offload_optimizer=settings.offload_optimizer and settings.zero_stage > 0,
                 offload_params=settings.offload_params and settings.sharding in ("zero3", "fsdp-full-shard", "fsdp-shard-grad-op"),
                 sub_group_size=int(settings.zero.get("sub_group_size", 1_000_000_000)), replicate=settings.replicate)
