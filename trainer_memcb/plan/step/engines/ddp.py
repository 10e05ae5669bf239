"""DDP modelled from its reducer's rules, in the same fake timeline as the step.

torch 2.13 `DistributedDataParallel` (`torch/csrc/distributed/c10d/reducer.cpp`): at construction
`Reducer::initialize_buckets` allocates one flat gradient tensor per bucket (`at::empty` of the
bucket's values, in the parameters' dtype), buckets filled in reverse parameter order, the first
up to `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), the others up to `bucket_cap_mb`
(`_compute_bucket_assignment_by_size`); they live as long as the model is wrapped. In backward,
after each parameter's gradient is accumulated, `mark_variable_ready_dense` copies it into its
bucket view; with `gradient_as_bucket_view=True` the parameter's `.grad` then becomes that view
(the fresh gradient is freed), otherwise the gradient stays beside the bucket (a second copy of
every gradient). The all-reduce works in place on the buckets. With `find_unused_parameters=True`
(the Trainer's default for a model without gradient checkpointing) the constructor's
`initialize_local_used_map` also makes two int32 maps of one value per parameter it reduces
(`local_used_map_` and `local_used_map_dev_`, `reducer.hpp`), alive as long as the model is wrapped.

Gradient accumulation: accelerate runs every micro-batch but the last under `model.no_sync()`
(transformers' `Trainer._inner_training_loop`, `Accelerator.no_sync`), so its forward does not call
`prepare_for_backward` and the reducer's autograd hooks return at once (`expect_autograd_hooks_`
false): the gradients accumulate in `param.grad`, beside the buckets, and are copied into them only
in the last micro-batch's backward; with `gradient_as_bucket_view=True` the gradients left by
`zero_grad(set_to_none=True)` are therefore fresh tensors until then, beside the buckets, and
become the bucket views there (`mark_variable_ready_dense`: `grad = bucket_view`).

The real `DistributedDataParallel` is not run under fake tensors: its C++ reducer allocates its
buckets with real memory (13 GB for a 7B model in bf16) outside the fake mode.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from trainer_memcb.plan.step.engines.base import StepEngine

__all__ = ["DDPEngine", "bucket_numels"]

# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket is small to start the
# all-reduce early.
FIRST_BUCKET_BYTES = 1024 * 1024
MIB = 1024 * 1024


def bucket_numels(params: List[torch.Tensor], bucket_cap_mb: float) -> List[List[int]]:
    """The buckets' parameter indices, as `_compute_bucket_assignment_by_size` assigns them:
    reverse order, per dtype, the first bucket up to 1 MiB and the rest up to `bucket_cap_mb`."""
    limits = [FIRST_BUCKET_BYTES, int(bucket_cap_mb * MIB)]
    open_buckets: Dict[Any, List[Any]] = {}  # dtype -> [indices, bytes, limit index]
    done: List[List[int]] = []
    for index in reversed(range(len(params))):
        param = params[index]
        entry = open_buckets.setdefault(param.dtype, [[], 0, 0])
        entry[0].append(index)
        entry[1] += param.numel() * param.element_size()
        if entry[1] >= limits[min(entry[2], 1)]:
            done.append(entry[0])
            open_buckets[param.dtype] = [[], 0, entry[2] + 1]
    done.extend(entry[0] for entry in open_buckets.values() if entry[0])
    return done


class DDPEngine(StepEngine):
    """DDP's buckets beside the one-process step.

    Args:
        settings: resolved settings (`bucket_cap_mb`, `gradient_as_bucket_view`, `max_grad_norm`).
    """

    name = "ddp"

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.settings = settings
        self.buckets: List[torch.Tensor] = []
        self.used_maps: List[torch.Tensor] = []
        self._used_map_serials: set = set()
        self._views: Dict[int, torch.Tensor] = {}
        self._hooks: List[Any] = []
        self._sync = True  # False inside `no_sync` (a micro-batch before the last)

    def micro_batch(self, number: int, last: bool) -> None:
        self._sync = last

    def wrap(self, model: nn.Module, mode: Any) -> nn.Module:
        trainable = [p for p in model.parameters() if p.requires_grad]
        with mode:
            for indices in bucket_numels(trainable, self.settings.bucket_cap_mb):
                total = sum(trainable[i].numel() for i in indices)
                flat = torch.empty(total, dtype=trainable[indices[0]].dtype, device=trainable[indices[0]].device)
                self.buckets.append(flat)
                offset = 0
                for i in indices:
                    numel = trainable[i].numel()
                    self._views[id(trainable[i])] = flat[offset:offset + numel].view(trainable[i].shape)
                    offset += numel
            if self.settings.find_unused_parameters:
                self.used_maps = [torch.zeros(len(trainable), dtype=torch.int32, device=trainable[0].device)
                                  for _ in range(2)] if trainable else []
        for param in trainable:
            self._hooks.append(param.register_post_accumulate_grad_hook(self._ready))
        return model

    def _ready(self, param: torch.Tensor) -> None:
        if self.tracker is not None:  # the fresh gradient, until the bucket view replaces it
            self.tracker.tag([param.grad], "gradients")
        if not self._sync:  # under no_sync: the reducer's hook returns at once
            return
        view = self._views[id(param)]
        view.copy_(param.grad)
        if self.settings.gradient_as_bucket_view:
            param.grad = view

    def resident(self) -> Dict[str, List[torch.Tensor]]:
        # With gradient_as_bucket_view the buckets are the gradients.
        part = "gradients" if self.settings.gradient_as_bucket_view else "engine_buffers"
        parts = {part: list(self.buckets)}
        if self.used_maps:
            parts["engine_buffers"] = parts.get("engine_buffers", []) + list(self.used_maps)
        return parts

    def attach(self, tracker: Any, counter: Any) -> None:
        super().attach(tracker, counter)
        self._used_map_serials = set(tracker.serials(self.used_maps))

    def state_of(self, part: str, serial: int) -> Optional[str]:
        # The used-parameter maps are bookkeeping, of no model state; the buckets carry gradients.
        if serial in self._used_map_serials:
            return None
        return super().state_of(part, serial)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._views.clear()
        self.buckets.clear()
        self.used_maps = []
