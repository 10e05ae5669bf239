"""Tensor parallelism traced, not modelled: torch's `parallelize_module` with the model's plan on the
fake process group of the tensor-parallel degree.

As the FSDP2 engine does (`trainer_memcb.plan.step.engines.fsdp2`): `init_process_group("fake",
store=FakeStore(), rank=R, world_size=TP)` (`torch.testing._internal.distributed.fake_pg`), a CPU
`DeviceMesh` made before the fake mode (a mesh made under it reads fake values), then, under the
fake mode, `parallelize_module(model, mesh, plan)` with the model's `tp_plan` in torch's styles
(`trainer_memcb.plan.model.tp_plan`). Each parameter of the plan becomes a DTensor whose local tensor
is this rank's shard (`distribute_tensor`: the shard is a new tensor, the whole one freed), so the
parameters, their gradients (DTensors of the same placements) and the optimizer state the Trainer's
optimizer makes like them are this rank's shards; the parameters outside the plan (the norms) stay
whole on every rank. The step then runs as one process runs it: each style's input and output
redistribution (the replicated input of a colwise layer, the all-reduce of a rowwise layer's partial
output, the all-gather of a `colwise_gather_output` head's logits) makes its buffers in the same
timeline, and autograd saves the activations in their TP layouts (a colwise layer's output is this
rank's columns, the rest whole). The gradients are clipped as the Trainer's accelerate clips them
(`Accelerator._clip_grad_norm_dtensor_aware`, accelerate 1.16): torch's `clip_grad_norm_` refuses
the mix of DTensor gradients and the whole ones of the parameters outside the plan, so the norm is
taken per device mesh, the DTensor norms made whole, stacked, and each group clipped with it.

TP x FSDP2 (`TensorParallelFSDP2Engine`, accelerate's `dp_shard` beside `tp`): the mesh is 2-D,
`("dp_shard", "tp")` in accelerate's order, the plan applied on its `tp` dimension, then the FSDP2
engine's own `fully_shard` of each decoder layer and the root on its `dp_shard` dimension
(`trainer_memcb.plan.step.engines.fsdp2`), as torchtitan and accelerate compose them: FSDP2 shards
each TP shard again (`_StridedShard` on dim 0 beside TP's `Shard`), the norms on `dp_shard` alone.
FSDP2 makes the 2-D mesh of each TP parameter (`FSDPParam._init_sharding_spec_tp`:
`DeviceMesh._concatenate`), whose rank tensor must be real: it is made outside the fake mode
(`unset_fake_temporarily`) for the time of the wrap. With HSDP's replicas (`replicate` > 1) the mesh
is accelerate's `("dp_replicate", "dp_shard", "tp")`, `fully_shard` on its first two dimensions;
FSDP2's CPU offload beside TP is the FSDP2 engine's own.

A functional collective's result is taken as the real process holds it
(`trainer_memcb.plan.step.collective_results`: the fake `wait_tensor` would copy it). Planned so far: TP alone (`world_size == tp_size`) or with
FSDP2's full or shard-grad-op sharding (HSDP's replicas and offload among its options), with the
shards torch's styles can split (`trainer_memcb.plan.settings.parallelism.check_tensor_parallel_model`:
an uneven vocabulary or MLP width, each rank its own chunk); the plan is the settings' rank's. Under TP alone
the "colwise" and "rowwise" linear layers are laid out as transformers 5's own styles lay them out
(`trainer_memcb.plan.model.tp_styles`): a rowwise layer's input given its width, and each shard a
storage of its own size, as `from_pretrained(tp_plan="auto")` loads it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, List

import torch
from torch import nn

from trainer_memcb.plan.step.collective_results import take_results_as_returned
from trainer_memcb.plan.step.engines.base import StepEngine
from trainer_memcb.plan.step.engines.fsdp2 import FSDP2Engine

__all__ = ["TensorParallelEngine", "TensorParallelFSDP2Engine", "clip_grad_norm_dtensor_aware", "forget_sharding_cache"]


class _CollectivesAsHeld:
    """What both tensor-parallel engines do to their trace: from the wrap to `close`, a functional
    collective's result is taken as the real process holds it
    (`trainer_memcb.plan.step.collective_results`: under a fake mode the result would be copied, 33,024
    bytes of the tiny Llama's gathered logits alive beside the copy to the forward's end, above both
    real processes' forward peaks)."""

    _undo_results: Callable[[], None] = staticmethod(lambda: None)

    def _hold_collectives_as_returned(self) -> None:
        self._undo_results = take_results_as_returned()

    def _end_tensor_parallel(self) -> None:
        """Undo the wrap's collectives and forget DTensor's caches (`forget_sharding_cache`)."""
        self._undo_results()
        forget_sharding_cache()


class TensorParallelEngine(_CollectivesAsHeld, StepEngine):
    """The step of one tensor-parallel rank.

    Args:
        settings: resolved settings (`tp_size`, `rank`, `max_grad_norm`).
    """

    name = "tp"

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.settings = settings
        self._owns_group = False

    def wrap(self, model: nn.Module, mode: Any) -> nn.Module:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from trainer_memcb.plan.model.tp_plan import model_tp_plan, torch_tp_plan
        from trainer_memcb.plan.model.tp_styles import own_sized_linear_shards

        tp = self.settings.tp_size
        plan = model_tp_plan(model, self.settings.tp_plan)
        styles = torch_tp_plan(plan)
        if dist.is_initialized():
            if dist.get_backend() != "fake" or dist.get_world_size() != tp:
                raise ValueError("a process group is already initialized here: the TP plan needs its own fake one")
        else:
            dist.init_process_group("fake", store=FakeStore(), rank=self.settings.rank, world_size=tp)
            self._owns_group = True
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        self._hold_collectives_as_returned()
        with mode:
            parallelize_module(model, mesh, styles)
            own_sized_linear_shards(model, plan)
        rules = f", {len(self.settings.tp_plan)} of them yours" if self.settings.tp_plan else ""
        self.notes.append(f"tensor parallel over {tp} processes: the model's tp_plan ({len(plan)} entries{rules}) applied "
                          "with torch's parallelize_module (ColwiseParallel / RowwiseParallel)")
        self.notes.extend(_supplied_plan_notes(model, self.settings.tp_plan, plan))
        return model

    def clip(self, trainable: List[torch.Tensor]) -> None:
        if self.max_grad_norm:
            clip_grad_norm_dtensor_aware(trainable, self.max_grad_norm)

    def close(self) -> None:
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        self._end_tensor_parallel()


class TensorParallelFSDP2Engine(_CollectivesAsHeld, FSDP2Engine):
    """The step of one rank of a 2-D mesh: tensor parallel on `tp`, FSDP2 on `dp_shard`.

    Args:
        settings: resolved settings (`tp_size`, `world_size` = tp x dp_shard, `rank`, FSDP2's).
    """

    name = "tp-fsdp2"

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        tp, replicate = self.settings.tp_size, self.settings.replicate
        shards = self.settings.world_size // tp // replicate
        if replicate > 1:  # HSDP beside TP: accelerate's (dp_replicate, dp_shard, tp) mesh
            mesh = init_device_mesh("cpu", (replicate, shards, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
            self._tp_mesh = mesh["tp"]
            self.notes.append(f"TP x HSDP: a {replicate} x {shards} x {tp} mesh (dp_replicate, dp_shard, tp), the "
                              "model's tp_plan applied with torch's parallelize_module on tp, then fully_shard on "
                              f"(dp_replicate, dp_shard): replicated {replicate}x, sharded {shards}-way")
            return mesh["dp_replicate", "dp_shard"]
        mesh = init_device_mesh("cpu", (shards, tp), mesh_dim_names=("dp_shard", "tp"))
        self._tp_mesh = mesh["tp"]
        self.notes.append(f"TP x FSDP2: a {shards} x {tp} mesh (dp_shard, tp), the model's tp_plan applied with "
                          "torch's parallelize_module on tp, then fully_shard on dp_shard")
        return mesh["dp_shard"]

    def _before_sharding(self, model: nn.Module, mode: Any) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        from trainer_memcb.plan.model.tp_plan import model_tp_plan, torch_tp_plan

        self._hold_collectives_as_returned()
        plan = model_tp_plan(model, self.settings.tp_plan)
        with mode:
            parallelize_module(model, self._tp_mesh, torch_tp_plan(plan))
        self.notes.extend(_supplied_plan_notes(model, self.settings.tp_plan, plan))
        original = DeviceMesh.__dict__["_concatenate"]
        self._concatenate = original
        DeviceMesh._concatenate = staticmethod(_real_mesh(original.__func__))

    def clip(self, trainable: List[torch.Tensor]) -> None:
        if self.max_grad_norm:
            clip_grad_norm_dtensor_aware(trainable, self.max_grad_norm)

    def close(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        concatenate = getattr(self, "_concatenate", None)
        if concatenate is not None:
            DeviceMesh._concatenate = concatenate
            self._concatenate = None
        super().close()
        self._end_tensor_parallel()


def forget_sharding_cache() -> None:
    """Empty DTensor's caches of sharding propagations and redistribution plans, once a trace's
    process group is gone.

    Their keys compare device meshes by their layout and dimension names, not by their process
    groups: a second trace in the same process (another rank) would take the first one's output
    specs, whose meshes name the destroyed group ("Could not resolve the process group registered
    under the name 3", torch 2.13, on TP x FSDP2's 2-D mesh)."""
    from torch.distributed.tensor import _redistribute, debug

    # The Python cache and the C++ fast path's (torch 2.13 `debug._clear_sharding_prop_cache`).
    getattr(debug, "_clear_sharding_prop_cache", lambda: None)()
    clear = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)
    if clear is not None:
        clear()
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()


def _real_mesh(concatenate: Any) -> Any:
    """`DeviceMesh._concatenate`, its rank tensor made outside the fake mode (a fake one fails its
    `nonzero`, a data-dependent shape)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def outside_fake_mode(meshes: Any) -> Any:
        with unset_fake_temporarily():
            return concatenate(meshes)
    return outside_fake_mode


def clip_grad_norm_dtensor_aware(parameters: List[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """accelerate 1.16's `Accelerator._clip_grad_norm_dtensor_aware`, operation for operation: the
    gradients grouped by their device mesh (the whole ones in a group of their own), one total norm
    per group (`get_total_norm`), the DTensor ones made whole (`full_tensor`), stacked, their norm,
    then each group clipped with it (`clip_grads_with_norm_`)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    by_mesh: Any = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            by_mesh[param.grad.device_mesh if isinstance(param.grad, DTensor) else None].append(param)
    norms = [get_total_norm([p.grad for p in params], norm_type) for params in by_mesh.values()]
    stacked = (torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]) if norms
               else torch.zeros(1))
    total = torch.linalg.vector_norm(stacked, norm_type)
    if max_norm != float("inf"):
        for params in by_mesh.values():
            clip_grads_with_norm_(params, max_norm, total)
    return total


def _supplied_plan_notes(model: nn.Module, override: Any, plan: Dict[str, str]) -> List[str]:
    """The note of a plan made with the rules supplied where transformers gives the model none."""
    from trainer_memcb.plan.model.supplied_tp_plans import supplied_plan_note
    from trainer_memcb.plan.model.tp_plan import plan_is_supplied

    return [supplied_plan_note(model, plan)] if plan_is_supplied(model, override) else []
