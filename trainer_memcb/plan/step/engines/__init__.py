"""One step tracer per engine, each with the same small interface (`StepEngine`).

The plan runs one training step under fake tensors; an engine wraps the model as the real engine
does, keeps what the engine holds beside the model, and runs the backward and the optimizer step
its way, so that every byte one process holds is in the same timeline and the peak is the largest
sum at one moment:

- `StepEngine`: one process (also the base of the others);
- `DDPEngine`: `DistributedDataParallel`'s reducer buckets;
- `FSDP2Engine`: the real `fully_shard` on the fake process group of the job's world size;
- `ZeroEngine`: DeepSpeed ZeRO-1/2/3's partitions and buffers, from its config;
- `ContextParallelEngine`: FSDP2 over `dp_shard x cp`, each rank's share of the sequence, attention
  torch's ring over `cp`;
- `TensorParallelEngine`: torch's `parallelize_module` with the model's `tp_plan` on the fake
  process group of the tensor-parallel degree; `TensorParallelFSDP2Engine`: the same on a 2-D mesh,
  then FSDP2's `fully_shard` on its data-parallel dimension.
"""

from typing import Any

from trainer_memcb.plan.step.engines.base import StepEngine
from trainer_memcb.plan.step.engines.context_parallel import ContextParallelEngine, TensorContextParallelEngine
from trainer_memcb.plan.step.engines.ddp import DDPEngine
from trainer_memcb.plan.step.engines.fsdp2 import FSDP2Engine
from trainer_memcb.plan.step.engines.tensor_parallel import TensorParallelEngine, TensorParallelFSDP2Engine
from trainer_memcb.plan.step.engines.zero import ZeroEngine

__all__ = ["StepEngine", "DDPEngine", "FSDP2Engine", "ZeroEngine", "TensorParallelEngine", "TensorParallelFSDP2Engine",
           "ContextParallelEngine", "engine_class", "engine_for"]


def engine_class(settings: Any) -> type:
    """The engine that runs the step of resolved settings (`trainer_memcb.plan.settings.StepSettings`)."""
    sharding = settings.sharding
    if getattr(settings, "cp_size", 1) > 1:
        return TensorContextParallelEngine if getattr(settings, "tp_size", 1) > 1 else ContextParallelEngine
    if getattr(settings, "tp_size", 1) > 1:
        return TensorParallelFSDP2Engine if sharding.startswith("fsdp-") else TensorParallelEngine
    if sharding == "ddp":
        return DDPEngine
    if sharding.startswith("fsdp-"):
        return FSDP2Engine
    if sharding.startswith("zero") or settings.precision.startswith("deepspeed-"):
        return ZeroEngine
    return StepEngine


def engine_for(settings: Any) -> StepEngine:
    """The engine of resolved settings, made from them: every engine takes the settings alone."""
    return engine_class(settings)(settings)
