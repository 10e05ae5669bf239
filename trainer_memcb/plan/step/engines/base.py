"""The step tracer's interface, and the one-process engine that the others extend.

An engine is made for one trace and used in this order by `plan.step.trace`:

1. `wrap(model, mode)`: under the fake mode, wrap the model as the engine does (`fully_shard`) and
   make what the engine keeps beside it (DDP's buckets, ZeRO's flat partitions);
2. `resident()`: those tensors by part, counted from the start of the step;
3. `attach(tracker, counter)`: the live-storage tracker and the saved-tensor counter, so that the
   engine can name its buffers (`tracker.tag`) and keep its unsharded parameters out of the
   activations;
4. with gradient accumulation, `micro_batch(number, last)` before each traced micro-batch's
   forward, and `backward(loss)` after it; then `step(build_optimizer, model, trainable)` (clip and step, returns the
   optimizer), then `zero_grad(optimizer)`;
5. `close()`, always.

After the step, `state_of(part, serial)` says which model state each part of the timeline belongs
to, so that the model-states table gives, per engine, the most each state held during the step
(`trainer_memcb.plan.step.timeline.Timeline.most_by`): the gathered parameters count as
parameters, the engine's buckets as the state they carry.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from trainer_memcb.plan.step.timeline import MODEL_STATES
from trainer_memcb.plan.step.engines.local_shards_step import stepping_local_shards

__all__ = ["StepEngine", "MODEL_STATES"]

# The parts an engine may name beside the plan's own (parameters, gradients, optimizer state,
# activations, batch and buffers, other).
ENGINE_PARTS = ("master_weights", "unsharded_parameters", "unsharded_gradients", "engine_buffers", "fp32_gradients",
                "offload_buffers", "host_temporaries")
# The model state each part of a step belongs to; the activations, the batch and buffers and the
# temporaries belong to none. An engine's buffers carry gradients (DDP's and ZeRO's buckets)
# unless the engine says otherwise (FSDP2's all-gather buffers carry parameters).
_STATE_OF_PART = {"parameters": "parameters", "unsharded_parameters": "parameters", "gradients": "gradients",
                  "unsharded_gradients": "gradients", "fp32_gradients": "gradients", "engine_buffers": "gradients", "optimizer_state": "optimizer_state",
                  "master_weights": "master_weights"}


class StepEngine:
    """One process: the model as it is, `loss.backward()`, clipping and the optimizer's step.

    Args:
        settings: resolved settings (`trainer_memcb.plan.settings.StepSettings`): their
            `max_grad_norm` (0 or None: no clipping); None clips at the Trainer's default, 1.0.
    """

    name = "none"
    # True where the engine makes the optimizer state before the step (DeepSpeed does, at init).
    state_resident = False
    # The CUDA streams other than the default one (0) that the engine allocates on, by number
    # (`Timeline.streams`); one process allocates everything on the default stream.
    stream_names: Dict[int, str] = {}

    def __init__(self, settings: Any = None) -> None:
        self.max_grad_norm: Optional[float] = settings.max_grad_norm if settings is not None else 1.0
        self.notes: List[str] = []
        self.tracker: Any = None
        self.counter: Any = None
        # Bytes of model states that live on the CPU (offload), outside the device's timeline.
        self.host_bytes = 0
        self.optimizer_builder: Any = None

    def wrap(self, model: nn.Module, mode: Any) -> nn.Module:
        return model

    def resident(self) -> Dict[str, List[torch.Tensor]]:
        return {}

    def attach(self, tracker: Any, counter: Any) -> None:
        self.tracker, self.counter = tracker, counter

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def micro_batch(self, number: int, last: bool) -> None:
        """Micro-batch `number` of the optimizer step runs next; `last`: the one after which the
        engine reduces and the optimizer steps (accelerate's `sync_gradients`). One process has
        nothing to do: autograd adds each micro-batch's gradient into `param.grad` in place
        (`AccumulateGrad`), the new one alive until it is added."""

    def gradients(self, trainable: List[torch.Tensor]) -> List[torch.Tensor]:
        """The gradients held at the end of backward."""
        return [p.grad for p in trainable if p.grad is not None]

    def clip(self, trainable: List[torch.Tensor]) -> None:
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable, self.max_grad_norm)

    def step(self, build_optimizer: Callable[[nn.Module], Any], model: nn.Module, trainable: List[torch.Tensor]) -> Any:
        self.clip(trainable)
        optimizer = build_optimizer(model)
        with stepping_local_shards(optimizer):  # DTensor parameters: the same kernels, without its dispatch
            optimizer.step()
        return optimizer

    def state_tensors(self, optimizer: Any) -> List[torch.Tensor]:
        return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]

    def zero_grad(self, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)

    def state_of(self, part: str, serial: int) -> Optional[str]:
        """The model state (`MODEL_STATES`) the storage `serial` of `part` belongs to, or None."""
        return _STATE_OF_PART.get(part)

    def close(self) -> None:
        pass
