"""DeepSpeed ZeRO: which flat partitions each rank's optimizer holds state for, and how large.

ZeRO hands its inner optimizer (torch's AdamW, DeepSpeed's FusedAdam, ...) not the model's
parameters but one flat fp32 partition per param group (ZeRO-3: per sub-group), this rank's share.
The inner optimizer's state is keyed by those partitions and sized like them, so the inner
optimizer's own rule, applied to the partitions, is this rank's estimate; the partitions themselves
are the fp32 master weights, optimizer memory that the parameter count does not show.

Where DeepSpeed keeps them (deepspeed/runtime/, 0.19):

- ZeRO-1/2, `zero/stage_1_and_2.py` `DeepSpeedZeroOptimizer.__init__`: per param group the
  trainable parameters are flattened (each padded to 16 bytes with `parameter_alignment`), the flat
  buffer is padded to a multiple of 2 x the data-parallel world size (`nccl_start_alignment_factor`,
  `utils.py` `align_dense_tensors`) and cut into equal partitions (`get_data_parallel_partitions`).
  Each rank clones its partition to fp32, `single_partition_of_fp32_groups[group]`, and sets it as
  the group's only parameter.
- bf16 with ZeRO-1, `bf16_optimizer.py` `BF16_Optimizer._setup_for_real_optimizer`: the same
  partitions, in `fp32_groups_flat_partition`.
- ZeRO-3, `zero/stage3.py`: each parameter is cut into `ceil(numel / world)` values per rank
  (`zero/partition_parameters.py` `_padding_size`); a param group's partitions are concatenated into
  sub-groups that close once they reach `sub_group_size` values (`_create_fp16_sub_groups`), one
  flat fp32 tensor each, `fp32_partitioned_groups_flat` (`_create_fp32_partitions` means to reuse
  the model's own partition when it is fp32 already; a reused one is no extra memory). They are lent
  to the inner optimizer's param group only for its step (`_optimizer_step`): outside it the groups
  are empty.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule, register_optimizer_view
from trainer_memcb.state.measure import measure_optimizer_state

__all__ = [
    "ZERO12_ALIGNMENT_FACTOR",
    "find_zero_optimizer",
    "master_weights_bytes",
    "with_zero3_partitions",
    "zero12_gradient_numel",
    "zero12_partition_numel",
    "zero3_partition_numel",
    "zero3_sub_group_numels",
]

# stage_1_and_2.py: `nccl_start_alignment_factor = 2  # 4-byte alignment/sizeof(fp16) = 2`.
ZERO12_ALIGNMENT_FACTOR = 2
# stage_1_and_2.py: with `parameter_alignment`, each parameter is padded to 16 bytes.
_PARAMETER_ALIGNMENT_BYTES = 16
# config.py `DeepSpeedZeroConfig.sub_group_size` default.
ZERO3_DEFAULT_SUB_GROUP_SIZE = 1_000_000_000

# (attribute holding this rank's fp32 master partitions, attribute holding the low-precision
# buffers they were copied from, ZeRO stage), found by duck typing on DeepSpeed's optimizers.
# DeepSpeedZeroOptimizer serves stages 1 and 2: `partition_gradients` is True for stage 2.
_ZERO_LAYOUTS: Tuple[Tuple[str, str, int], ...] = (
    ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", 3),  # DeepSpeedZeroOptimizer_Stage3
    ("single_partition_of_fp32_groups", "bit16_groups_flat", 1),  # DeepSpeedZeroOptimizer
    ("fp32_groups_flat_partition", "bf16_groups_flat", 1),  # BF16_Optimizer (bf16, stage 1)
)

# How deep a chain of `.optimizer` wrappers is followed (accelerate -> DeepSpeed -> torch is 3).
_MAX_WRAPPER_DEPTH = 8


# -- partition arithmetic: what each rank will hold, before anything is built --------------------


def zero12_partition_numel(
    param_numels: Sequence[int], world_size: int, *, element_size: int = 2, parameter_alignment: bool = False
) -> int:
    """Values in each rank's flat partition of one param group under ZeRO-1/2.

    Args:
        param_numels: the group's trainable parameters' numel, in order.
        world_size: data-parallel processes.
        element_size: bytes per value of the model's parameters (only used with
            `parameter_alignment`).
        parameter_alignment: DeepSpeed's `zero_optimization.parameter_alignment`.

    Examples:
        >>> from trainer_memcb.state.rules.deepspeed_zero import zero12_partition_numel
        >>> zero12_partition_numel([35, 7, 21, 3], world_size=2)  # 66 values padded to 68
        34
    """
    per_param_alignment = _PARAMETER_ALIGNMENT_BYTES // math.gcd(_PARAMETER_ALIGNMENT_BYTES, element_size)
    offset = 0
    for index, numel in enumerate(param_numels):
        offset += numel
        if parameter_alignment and index < len(param_numels) - 1:
            offset += (-offset) % per_param_alignment
    alignment = ZERO12_ALIGNMENT_FACTOR * world_size
    return -(-offset // alignment) * alignment // world_size


def zero12_gradient_numel(group_param_numels: Sequence[Sequence[int]], world_size: int, rank: int) -> int:
    """Values of the reduced 16-bit gradients one rank holds under ZeRO-1/2 when its step begins.

    What runs showed (deepspeed 0.19.8, `DeepSpeedZeroOptimizer`, stages 1 and 2 alike): backward's
    reduction copies the gradient of every parameter that overlaps the rank's partition, whole,
    into one contiguous buffer (`stage_1_and_2.py` `copy_grads_in_partition`: `grads_in_partition`
    is sized by the numel of `params_in_partition`), and the step's flat partition is made of
    views of it, plus a buffer of zeros (`get_flat_partition`) where the partition runs past the
    group's last value. Gradients of the other parameters are freed by the end of backward.

    Args:
        group_param_numels: per param group, its trainable parameters' numel, in order.
        world_size: data-parallel processes.
        rank: this process's rank in them.

    Example:
        >>> from trainer_memcb.state.rules.deepspeed_zero import zero12_gradient_numel
        >>> groups = [[35, 21], [7, 3]]  # partitions of 28 and 6 values
        >>> zero12_gradient_numel(groups, 2, rank=0), zero12_gradient_numel(groups, 2, rank=1)
        (42, 68)
    """
    total = 0
    for numels in group_param_numels:
        partition = zero12_partition_numel(numels, world_size)
        start, end = rank * partition, (rank + 1) * partition
        offset = 0
        for numel in numels:
            if numel and offset < end and offset + numel > start:
                total += numel  # the whole gradient of a parameter the partition touches
            offset += numel
        total += max(0, end - max(offset, start))  # zeros where the partition runs past the values
    return total


def zero3_partition_numel(param_numel: int, world_size: int) -> int:
    """Values each rank holds of one parameter under ZeRO-3: `ceil(numel / world_size)`."""
    return -(-param_numel // world_size)


def zero3_sub_group_numels(
    param_numels: Sequence[int], world_size: int, sub_group_size: int = ZERO3_DEFAULT_SUB_GROUP_SIZE
) -> List[int]:
    """Values in each rank's flat fp32 sub-groups of one param group under ZeRO-3, in order.

    Examples:
        >>> from trainer_memcb.state.rules.deepspeed_zero import zero3_sub_group_numels
        >>> zero3_sub_group_numels([35, 7, 21, 3], world_size=2)  # 18 + 4 + 11 + 2
        [35]
        >>> zero3_sub_group_numels([35, 7, 21, 3], world_size=2, sub_group_size=20)
        [22, 13]
    """
    partitions = [zero3_partition_numel(numel, world_size) for numel in param_numels]
    if sub_group_size is None or sub_group_size >= sum(partitions):
        return [sum(partitions)] if partitions else []
    sub_groups: List[int] = []
    current = 0
    for index, numel in enumerate(partitions):
        current += numel
        if current >= sub_group_size or index == len(partitions) - 1:
            sub_groups.append(current)
            current = 0
    return sub_groups


# -- the live optimizer ---------------------------------------------------------------------------


def find_zero_optimizer(optimizer: Any) -> Optional[Tuple[Any, str, str, int]]:
    """The ZeRO optimizer behind `optimizer`'s wrappers, with its layout, or None.

    Returns:
        (the ZeRO optimizer, its master-partition attribute, its low-precision attribute, stage).
    """
    for _ in range(_MAX_WRAPPER_DEPTH):
        for masters, low_precision, stage in _ZERO_LAYOUTS:
            if isinstance(getattr(optimizer, masters, None), list):
                if stage == 1 and getattr(optimizer, "partition_gradients", False) is True:
                    stage = 2
                return optimizer, masters, low_precision, stage
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return None
        optimizer = inner
    return None


class _TensorsAsState:
    """Lets `measure_optimizer_state` count any tensors, each storage once: it reads `.state`."""

    def __init__(self, key: str, tensors: List[torch.Tensor]) -> None:
        self.state = {key: {key: tensors}}


def _storages(tensors: Sequence[Any]) -> Set[Tuple[torch.device, int]]:
    return {
        (tensor.device, tensor.untyped_storage().data_ptr())
        for tensor in tensors
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta"
    }


def master_weights_bytes(optimizer: Any) -> Optional[int]:
    """Bytes of the fp32 master weights a ZeRO optimizer keeps on this rank, or None without ZeRO.

    Partitions that share storage with the model's own (ZeRO-3 over an fp32 model keeps no copy)
    count 0. Reads metadata only.

    Args:
        optimizer: the optimizer, as the Trainer, accelerate or `deepspeed.initialize` returned it.
    """
    found = find_zero_optimizer(optimizer)
    if found is None:
        return None
    zero, masters_name, low_precision_name, _ = found
    masters = [tensor for tensor in getattr(zero, masters_name) if isinstance(tensor, torch.Tensor)]
    model_storages = _storages(getattr(zero, low_precision_name, None) or [])
    copies = [tensor for tensor in masters if (tensor.device, tensor.untyped_storage().data_ptr()) not in model_storages]
    return measure_optimizer_state(_TensorsAsState("master_weights", copies)).num_bytes


def with_zero3_partitions(optimizer: Any) -> Any:
    """`optimizer`, or under ZeRO-3 outside a step a stand-in whose param groups hold the flat fp32
    partitions, so that `estimate_optimizer_state` sees what the inner optimizer steps over.

    The stand-in is a shallow copy of the inner optimizer (same class, same attributes, same
    `state`) with new param-group dicts; nothing of the real optimizer is changed.
    """
    found = find_zero_optimizer(optimizer)
    if found is None or found[3] != 3:
        return optimizer
    zero = found[0]
    inner = getattr(zero, "optimizer", None)
    groups = getattr(inner, "param_groups", None)
    if not isinstance(groups, list) or any(group.get("params") for group in groups):
        return optimizer  # inside a step the partitions are already in place
    lent: Dict[int, List[torch.Tensor]] = defaultdict(list)
    sub_group_to_group = getattr(zero, "sub_group_to_group_id", {})
    for sub_group, partition in enumerate(getattr(zero, "fp32_partitioned_groups_flat")):
        lent[sub_group_to_group.get(sub_group, 0)].append(partition)
    stand_in = object.__new__(type(inner))
    stand_in.__dict__.update(vars(inner))
    stand_in.param_groups = [dict(group, params=lent.get(index, [])) for index, group in enumerate(groups)]
    return stand_in


# Registered as a view, so that `estimate_optimizer_state` sees the partitions without importing
# this module (which imports `measure`, and registers through the registry below `estimate`).
register_optimizer_view(with_zero3_partitions)


# -- DeepSpeed's own optimizers, the inner optimizers ZeRO runs by default -------------------------


def _fused_adam(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # deepspeed/ops/adam/fused_adam.py FusedAdam.step: `step` a Python int, exp_avg and
    # exp_avg_sq = zeros_like(p.data), so in the partition's dtype.
    return {"exp_avg": param.num_bytes, "exp_avg_sq": param.num_bytes}


def _cpu_adam(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # deepspeed/ops/adam/cpu_adam.py DeepSpeedCPUAdam.step: `step` a Python int; exp_avg and
    # exp_avg_sq in fp32 unless `fp32_optimizer_states=False`, then in the parameter's dtype.
    element_size = 4 if getattr(optimizer, "fp32_optimizer_states", True) else param.element_size
    return {"exp_avg": param.numel * element_size, "exp_avg_sq": param.numel * element_size}


register_estimate_rule(
    "deepspeed.ops.adam.fused_adam:FusedAdam", _fused_adam, source="deepspeed/ops/adam/fused_adam.py FusedAdam.step"
)
register_estimate_rule(
    "deepspeed.ops.adam.cpu_adam:DeepSpeedCPUAdam", _cpu_adam, source="deepspeed/ops/adam/cpu_adam.py DeepSpeedCPUAdam.step"
)
