"""The step tracer's interface, and the one-process engine that the others extend.

An engine is made for one trace and used in this order by `plan.step_memory`:

1. `wrap(model, mode)`: under the fake mode, wrap the model as the engine does (`fully_shard`) and
   make what the engine keeps beside it (DDP's buckets, ZeRO's flat partitions);
2. `resident()`: those tensors by part, counted from the start of the step;
3. `attach(tracker, counter)`: the live-storage tracker and the saved-tensor counter, so that the
   engine can name its buffers (`tracker.tag`) and keep its unsharded parameters out of the
   activations;
4. `backward(loss)`, then `step(build_optimizer, model, trainable)` (clip and step, returns the
   optimizer), then `zero_grad(optimizer)`;
5. `close()`, always.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

__all__ = ["StepEngine"]

# The parts an engine may name beside the plan's own (parameters, gradients, optimizer state,
# activations, batch and buffers, other).
ENGINE_PARTS = ("master_weights", "unsharded_parameters", "engine_buffers")


class StepEngine:
    """One process: the model as it is, `loss.backward()`, clipping and the optimizer's step.

    Args:
        max_grad_norm: the Trainer's `max_grad_norm` (0 or None: no clipping).
    """

    name = "none"
    # True where the engine makes the optimizer state before the step (DeepSpeed does, at init).
    state_resident = False

    def __init__(self, max_grad_norm: Optional[float] = 1.0) -> None:
        self.max_grad_norm = max_grad_norm
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

    def gradients(self, trainable: List[torch.Tensor]) -> List[torch.Tensor]:
        """The gradients held at the end of backward."""
        return [p.grad for p in trainable if p.grad is not None]

    def clip(self, trainable: List[torch.Tensor]) -> None:
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable, self.max_grad_norm)

    def step(self, build_optimizer: Callable[[nn.Module], Any], model: nn.Module, trainable: List[torch.Tensor]) -> Any:
        self.clip(trainable)
        optimizer = build_optimizer(model)
        optimizer.step()
        return optimizer

    def state_tensors(self, optimizer: Any) -> List[torch.Tensor]:
        return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]

    def zero_grad(self, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass
