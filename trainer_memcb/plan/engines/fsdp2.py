"""FSDP2 traced, not modelled: the real `fully_shard` on the fake process group of the job's size.

As torchtitan's memory estimator runs it: `torch.distributed.init_process_group("fake",
store=FakeStore(), rank=0, world_size=W)` (`torch.testing._internal.distributed.fake_pg`), a
device mesh made before the fake mode (a mesh made under it reads fake values), each decoder
layer sharded and then the root (`fully_shard` as the Trainer's accelerate wraps a transformers
model: `_no_split_modules` layers, then the whole model). FSDP2 itself then allocates, during the
fake step, what a real rank allocates: the sharded parameters (rank 0's padded shards), the root's
parameters left unsharded after the forward's end only with `reshard_after_forward=False`, each
layer's all-gather buffer and unsharded parameters as it runs (with the next layer's prefetched),
the reduce-scatter input of each layer's gradients and the sharded gradients. FSDP2 frees the
unsharded parameters by resizing their storages to 0 (`free_storage`), which the live-storage
tracker follows.

Parts named here: the unsharded parameters (`FSDPParam.all_gather_outputs`, tagged as each module's
forward begins, also kept out of the activations though autograd saves them), the unsharded
gradients (autograd's, until `foreach_reduce` copies them into the reduce-scatter input) and the
engine's buffers (the tensors handed to the all-gather and reduce-scatter collectives).

CPU offload (`CPUOffloadPolicy`): the sharded parameters, their gradients and the optimizer state
live on the CPU; the trace runs on the CPU for both, so those storages are moved out of the
device's timeline by part when the peak is read (`host_parts`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch
from torch import nn

from trainer_memcb.plan.engines.base import StepEngine

__all__ = ["FSDP2Engine"]


def _layers(model: nn.Module) -> List[nn.Module]:
    """The modules accelerate's FSDP2 wraps in a transformers model: those whose class is in
    `_no_split_modules` (its TRANSFORMER_BASED_WRAP default), outermost first."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


class FSDP2Engine(StepEngine):
    """The real FSDP2 step on a fake process group.

    Args:
        settings: resolved settings (`world_size`, `reshard_after_forward`, `fsdp_cpu_offload`,
            `replicate`, `max_grad_norm`).
    """

    name = "fsdp2"

    def __init__(self, settings: Any) -> None:
        super().__init__(settings.max_grad_norm)
        self.settings = settings
        self._owns_group = False
        self._states: List[Any] = []
        self._hooks: List[Any] = []
        self._gather_serials: Set[int] = set()
        self.host_parts = ("parameters", "gradients", "optimizer_state") if settings.fsdp_cpu_offload else ()

    def wrap(self, model: nn.Module, mode: Any) -> nn.Module:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        from torch.testing._internal.distributed.fake_pg import FakeStore

        world = self.settings.world_size
        if dist.is_initialized():
            if dist.get_backend() != "fake" or dist.get_world_size() != world:
                raise ValueError("a process group is already initialized here: the FSDP2 plan needs its own fake one")
        else:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            self._owns_group = True
        replicate = self.settings.replicate
        if replicate > 1:
            mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
            self.notes.append(f"HSDP: replicated {replicate}x, sharded {world // replicate}-way")
        else:
            mesh = init_device_mesh("cpu", (world,))
        policy = CPUOffloadPolicy(pin_memory=False) if self.settings.fsdp_cpu_offload else OffloadPolicy()
        kwargs = dict(mesh=mesh, reshard_after_forward=self.settings.reshard_after_forward, offload_policy=policy)
        with mode:
            for layer in _layers(model):
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            if state is not None:
                self._states.append(state())
                # FSDP2's own pre-forward hook is prepended: this one runs after the unshard.
                self._hooks.append(module.register_forward_pre_hook(self._unsharded_hook(state())))
        return model

    def _unsharded_hook(self, state: Any) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            group = state._fsdp_param_group
            if group is None or self.tracker is None:
                return
            outputs = [tensor for param in group.fsdp_params for tensor in (getattr(param, "all_gather_outputs", None) or ())]
            self.tracker.tag(outputs, "unsharded_parameters", replace=True)
            if self.counter is not None:
                for tensor in outputs:
                    storage = tensor.untyped_storage()
                    self.counter._excluded.setdefault(storage._cdata, storage)
        return hook

    def attach(self, tracker: Any, counter: Any) -> None:
        super().attach(tracker, counter)
        tracker.on_op = self._on_op

    def _on_op(self, func: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        # The flat buffers FSDP2 hands its collectives (`_fsdp_collectives.py`): the all-gather's
        # output (its input is a slice of it) and the reduce-scatter's input. The reduce-scatter's
        # output becomes the sharded gradients.
        # The unsharded gradients that `foreach_reduce` copies into that input
        # (`foreach_reduce_scatter_copy_in`: torch 2.13's `torch.ops.fsdp.chunk_cat(unsharded_grads,
        # ...)`, `torch._chunk_cat` in older ones) are the unsharded gradients, on the device even
        # with CPU offload, from autograd's making them until the copy frees them.
        name = getattr(func, "__name__", str(func))
        namespace = getattr(func, "namespace", "")
        if namespace in ("fsdp", "aten") and name.lstrip("_").startswith("chunk_cat") and args:
            self.tracker.tag(list(_tensors(args[0])), "unsharded_gradients")
            return
        if namespace not in ("c10d", "_c10d_functional"):
            return
        if "allgather" in name or "all_gather" in name:
            gathered = list(_tensors(args))
            self.tracker.tag(gathered, "engine_buffers")
            self._gather_serials.update(self.tracker.serials(gathered))
        elif "reduce_scatter" in name:
            tensors = list(_tensors(args))
            self.tracker.tag(tensors[1:2] if len(tensors) > 1 else tensors, "engine_buffers")

    def gradients(self, trainable: List[torch.Tensor]) -> List[torch.Tensor]:
        return [p.grad for p in trainable if p.grad is not None]

    def state_of(self, part: str, serial: int) -> Optional[str]:
        # The all-gather buffers carry parameters, the reduce-scatter inputs gradients.
        if part == "engine_buffers" and serial in self._gather_serials:
            return "parameters"
        return super().state_of(part, serial)

    def close(self) -> None:
        import torch.distributed as dist

        for hook in self._hooks:
            hook.remove()
        if self.tracker is not None:
            self.tracker.on_op = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
