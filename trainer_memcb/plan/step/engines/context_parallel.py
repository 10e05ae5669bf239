"""Context parallelism traced as accelerate and the Trainer run it: FSDP2 over the `dp_shard x cp`
ranks, each rank's sequence a `1 / cp` share, attention torch's ring over the `cp` ranks.

accelerate (1.16) runs context parallelism only beside FSDP2 (`AcceleratorState`: "`cp_size > 1`
... we need a `fsdp_plugin`", "requires FSDP2") and shards the model over the joint `dp_shard_cp`
dimension of its mesh (`ParallelismConfig.build_device_mesh` flattens `("dp_shard", "cp")`; FSDP2
on `("dp_replicate", "dp_shard_cp")` with replicas). The engine is the FSDP2 one on that mesh (made
as accelerate makes it, on the fake process group of the job's world size), and it keeps the `cp`
dimension's group for the ring (`trainer_memcb.plan.step.ring_attention`, through
`trainer_memcb.plan.step.cuda_sdpa.sdpa_as_cuda`).

Each micro-batch is prepared as transformers 5's `Trainer._prepare_context_parallel_inputs` and
torch's `context_parallel` prepare it, under the fake mode before the step:

- `shift_labels`: the labels padded with -100 by one and shifted (`pad(labels, (0, 1))[:, 1:]`,
  a new [B, L] int64 tensor), so that the loss does not shift a rank's share;
- `position_ids`: `arange(L).expand(B, -1)` (L int64, expanded);
- the buffers (input_ids, labels, shift_labels, the 2-D attention mask, position_ids) reordered by
  torch's head-tail load balancer (`_HeadTailLoadBalancer`, taken where `L % (2 * cp) == 0`) and
  sharded on the sequence (`_context_parallel_buffers`), then each `resize_`d to its share and
  copied into, in place (`context_parallel`): `resize_` keeps a storage that is larger, so each
  buffer still holds its whole [B, L] storage (the expanded `position_ids` grows to [B, L / cp]
  where that is larger than L).

accelerate's `_attach_context_parallel_hooks` is applied to the model (the hook that drops each
`self_attn`'s mask and passes `is_causal=True`), so the attention runs causal without a mask.
The sharding's temporaries (the load balancer's indices, the gathered and sharded copies) live
before the step's first forward and are not in its timeline.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from trainer_memcb.plan.step.engines.fsdp2 import FSDP2Engine
from trainer_memcb.plan.step.engines.tensor_parallel import TensorParallelFSDP2Engine

__all__ = ["ContextParallelEngine", "TensorContextParallelEngine"]

# The loss's ignored label (`nn.CrossEntropyLoss`'s -100), which the Trainer pads `shift_labels` with.
IGNORE_INDEX = -100


class ContextParallelEngine(FSDP2Engine):
    """The step of one rank of a `dp_shard x cp` (or `dp_replicate x dp_shard x cp`) mesh.

    Args:
        settings: resolved settings (`world_size`, `cp_size`, `replicate`, `cp_comm_strategy`, FSDP2's).
    """

    name = "cp-fsdp2"

    def __init__(self, settings: Any) -> None:
        from trainer_memcb.plan.step.ring_attention import ring_module

        if ring_module() is None:
            raise ValueError(f"parallelism cp={settings.cp_size}: this torch has no ring attention package "
                             "(torch.distributed.tensor.experimental._context_parallel, torch 2.9 and later)")
        super().__init__(settings)
        self.ring_group: Any = None
        self._cp_mesh: Any = None

    def _mesh(self) -> Any:
        cp, replicate = self.settings.cp_size, self.settings.replicate
        _, shards, data = self._accelerate_mesh([("cp", cp)])
        seq_len = self.settings.seq_len
        share = f": each holds {seq_len // cp} of the {seq_len} tokens" if seq_len else ""
        self.notes.append(f"context parallel over {cp} processes{share} (torch's ring attention, "
                          f"{self.settings.cp_comm_strategy} rotation), FSDP2 over dp_shard x cp = {shards * cp}"
                          + (f", replicated {replicate}x (HSDP)" if replicate > 1 else ""))
        return data

    def _accelerate_mesh(self, inner: List[Tuple[str, int]]) -> Tuple[Any, int, Any]:
        """accelerate's mesh, `dp_replicate` and `dp_shard` (where above 1) then the `inner` dimensions
        (`cp`, then `tp` beside tensor parallelism); the ring on its `cp` dimension. Returns the mesh,
        the `dp_shard` size and the mesh FSDP2 shards over: `dp_shard x cp` flattened, beside
        `dp_replicate` for HSDP."""
        from torch.distributed.device_mesh import init_device_mesh

        replicate = self.settings.replicate
        shards = self.settings.world_size // (replicate * math.prod(size for _, size in inner))
        dims = [(name, size) for name, size in (("dp_replicate", replicate), ("dp_shard", shards)) if size > 1] + inner
        names = [name for name, _ in dims]
        mesh = init_device_mesh("cpu", tuple(size for _, size in dims), mesh_dim_names=tuple(names))
        self._cp_mesh = mesh["cp"]
        self.ring_group = self._cp_mesh.get_group()
        flat = mesh[tuple(name for name in ("dp_shard", "cp") if name in names)]._flatten("dp_shard_cp")
        return mesh, shards, (mesh[("dp_replicate", "dp_shard_cp")] if replicate > 1 else flat)

    @property
    def ring(self) -> Any:
        """(the `cp` dimension's process group, the rotate method) for the step's attention."""
        return self.ring_group, self.settings.cp_comm_strategy

    def wrap(self, model: nn.Module, mode: Any) -> nn.Module:
        from accelerate.big_modeling import _attach_context_parallel_hooks

        model = super().wrap(model, mode)
        _attach_context_parallel_hooks(model)
        return model

    def _on_op(self, func: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        # The ring's collectives (functional ones, on the `cp` group) carry keys, values and their
        # gradients, not FSDP2's parameters or gradients: left out of FSDP2's buffers.
        if getattr(func, "namespace", "") == "_c10d_functional" and self.ring_group is not None:
            name = self.ring_group.group_name
            if any(arg == name for arg in list(args) + list(kwargs.values()) if isinstance(arg, str)):
                return
        super()._on_op(func, args, kwargs)

    def shard_inputs(self, inputs: List[Any]) -> None:
        """Each micro-batch's buffers as the Trainer and `context_parallel` leave them (module
        docstring); call it under the fake mode."""
        for each in inputs:
            forward = each.forward
            if "labels" in forward and "shift_labels" not in forward:
                padded = torch.nn.functional.pad(forward["labels"], (0, 1), value=IGNORE_INDEX)
                forward["shift_labels"] = padded[:, 1:].contiguous()
                del padded
            if "position_ids" not in forward:
                ids = forward["input_ids"]
                forward["position_ids"] = torch.arange(ids.size(1), device=ids.device).expand(ids.size(0), -1)
            names = [name for name in ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")
                     if isinstance(forward.get(name), torch.Tensor) and (name != "attention_mask"
                                                                          or forward[name].dim() == 2)]
            _shard_in_place(self._cp_mesh, [forward[name] for name in names])


def _shard_in_place(mesh: Any, buffers: List[torch.Tensor]) -> None:
    """torch's `context_parallel` on `buffers` (sequence dimension 1), the buffers kept sharded
    (`no_restore_buffers`: the Trainer passes all of them)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_buffers
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer

    seq_len = buffers[0].shape[1]
    balancer = _create_default_load_balancer(seq_len, mesh.size(), buffers[0].device)
    shards = _context_parallel_buffers(mesh, list(buffers), [1] * len(buffers), balancer)
    for buffer, shard in zip(buffers, shards):
        shard = shard.clone()
        buffer.resize_(shard.shape)
        buffer.copy_(shard)


class TensorContextParallelEngine(ContextParallelEngine, TensorParallelFSDP2Engine):
    """The step of one rank of a `dp_shard x cp x tp` mesh, as accelerate lays it out (`tp`
    innermost, `cp` next): the model's `tp_plan` applied on `tp` (`TensorParallelFSDP2Engine`),
    FSDP2 over `dp_shard x cp`, the ring over `cp` on each rank's heads (the column-wise projections
    hand the attention its local heads as plain tensors).

    Args:
        settings: resolved settings (`world_size` = dp_shard x cp x tp, `cp_size`, `tp_size`, FSDP2's).
    """

    name = "tp-cp-fsdp2"

    def _mesh(self) -> Any:
        cp, tp, replicate = self.settings.cp_size, self.settings.tp_size, self.settings.replicate
        mesh, shards, data = self._accelerate_mesh([("cp", cp), ("tp", tp)])
        self._tp_mesh = mesh["tp"]
        self.notes.append(f"TP x CP x FSDP2: a {' x '.join(map(str, mesh.shape))} mesh "
                          f"({', '.join(mesh.mesh_dim_names)}), the model's "
                          f"tp_plan on tp, torch's ring attention over cp ({self.settings.cp_comm_strategy} "
                          f"rotation), FSDP2 over dp_shard x cp = {shards * cp}"
                          + (f", replicated {replicate}x (HSDP)" if replicate > 1 else ""))
        return data
