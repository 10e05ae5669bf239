"""torch's `RowwiseParallel`, its input given the layer's whole width, as transformers 5 runs a
rowwise layer whose input width does not divide by the tensor-parallel size.

torch's `RowwiseParallel._prepare_input_fn` (torch 2.6 to 2.13, `distributed/tensor/parallel/style.py`)
makes a rowwise `nn.Linear`'s input a DTensor from each rank's columns with
`DTensor.from_local(x, mesh, [Shard(-1)])`, no global shape: it takes every rank to hold as many
columns as this one, and on an uneven width (an MLP's `intermediate_size` of 129 over 2 ranks:
65 and 64 columns) the sharding propagation of `down_proj`'s matmul then refuses the input's 130
columns against the weight's 129. transformers 5's own `RowwiseParallel.transform_inputs_pre_forward`
(`transformers/distributed/tensor_parallel.py`, 5.25) gives the width:
`TensorParallelLayer._from_local_last_dim_shard(x, mesh, module.in_features)`, a `from_local`
with `shape=(..., in_features)` and its contiguous stride, and runs it. The rest of the two styles
is the same: the weight `Shard(-1)` and the bias replicated by `distribute_tensor` (torch's chunk
rule, `Shard._split_tensor`: the first ranks `ceil(width / tp)` columns, which transformers' loading
fills, `sharding_utils.compute_local_shape_and_global_offset`), the partial output all-reduced to a
replicated one and handed on as a local tensor. On an even width the shape given is the one
`from_local` infers, so the step is torch's to the byte.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import RowwiseParallel

__all__ = ["RowwiseParallelGivenWidth", "own_sized_linear_shards"]


class RowwiseParallelGivenWidth(RowwiseParallel):
    """torch's `RowwiseParallel` whose linear layer's sharded input is given the layer's
    `in_features` as its global width (module docstring), as transformers 5's `RowwiseParallel` does.

    Examples:
        >>> from trainer_memcb.plan.model.tp_styles import RowwiseParallelGivenWidth
        >>> RowwiseParallelGivenWidth().input_layouts
        (Shard(dim=-1),)
    """

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any,
                          device_mesh: Any) -> Any:
        local = inputs[0]
        if (not isinstance(local, DTensor) and isinstance(mod, nn.Linear)
                and tuple(input_layouts) == (Shard(-1),)):
            # transformers' `TensorParallelLayer._from_local_last_dim_shard`: the shape and its
            # contiguous stride (transformers reads it off a meta tensor; counted here, so that no
            # tensor is made: a memory tracker would file a meta one as a second device).
            shape = (*local.shape[:-1], mod.in_features)
            stride = tuple(math.prod(shape[dim + 1:]) for dim in range(len(shape)))
            inputs = (DTensor.from_local(local, device_mesh, input_layouts, run_check=False, shape=torch.Size(shape),
                                         stride=stride),) + tuple(inputs[1:])
        return RowwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


def own_sized_linear_shards(model: nn.Module, plan: Dict[str, str]) -> int:
    """Give each shard of the plan's "colwise" and "rowwise" linear layers a storage of its own size,
    as transformers' loading holds it; the number of shards copied.

    torch's `distribute_tensor` scatters a dim-0 shard into chunks padded to `ceil(rows / tp)` and
    narrows it (`Shard._shard_tensor`): on an uneven MLP width rank 1's 64 rows of `gate_proj` are a
    view of a 65-row storage. `from_pretrained(tp_plan="auto")` makes each parameter a placeholder
    (`distribute_tensor` on the meta device, `src_data_rank=None`) and fills it with this rank's slice
    of the checkpoint (`transformers.distributed.sharding_utils`, its offsets by torch's
    `compute_local_shape_and_global_offset`), moved to the device: a tensor of the shard's own size.
    The copy is made here, before the step, and the padded storage freed. The embedding's and the
    head's rows (an uneven vocabulary) stay as torch's `parallelize_module` holds them.
    """
    from torch.distributed.tensor import DTensor

    from trainer_memcb.plan.model.module_names import matches_module

    linear = [pattern for pattern, style in plan.items() if style in ("colwise", "rowwise")]
    copied = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not any(matches_module(pattern, name) for pattern in linear):
            continue
        for key, param in list(module.named_parameters(recurse=False)):
            local = param.to_local() if isinstance(param, DTensor) else None
            if local is None or local.untyped_storage().nbytes() <= local.numel() * local.element_size():
                continue
            own = DTensor.from_local(local.detach().clone(), param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
            setattr(module, key, nn.Parameter(own, requires_grad=param.requires_grad))
            copied += 1
    return copied
