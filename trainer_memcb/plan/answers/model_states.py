"""Will it fit? The model states each process holds: parameters, gradients, optimizer state and
master weights, for a world size, a sharding, an offload and a precision setup.

The optimizer state comes from the same rules as everything else (`trainer_memcb.plan.optimizers.whatif`: the
Trainer's optimizer for each `optim` name, built over meta-device stand-ins shaped like what one
process's optimizer steps over: the model with its whole parameters or FSDP shards, built as the
what-if builds it, or ZeRO's flat fp32 partitions). Optimizers that update inside backward (LOMO,
AdaLomo, the layer-wise variants) hold one gradient, the largest parameter's; which setups the
plan covers for each kind is in `trainer_memcb.plan.optimizers.update_kinds`. Parameters, gradients and master
weights follow the libraries' partitioning (ZeRO's fp32 master copy exists in fp32 runs too):

| sharding | parameters | gradients | optimizer steps over | master weights |
|---|---|---|---|---|
| none, ddp | all, whole | trainable, whole | trainable, whole | - (DeepSpeed precisions: one fp32 copy, whole) |
| fsdp-full-shard, fsdp-shard-grad-op | padded `ceil(rows / W)` shards | the same shards | the first rank's shard | - |
| zero1, zero2 | all, whole (each group's trainable ones in a flat buffer padded to 2W) | those overlapping the partition, whole (+ padding) | one fp32 partition per group | fp32 partitions |
| zero3 | `ceil(numel / W)` of each | the same partitions | fp32 sub-groups | fp32 sub-groups |

Sources: FSDP2 `torch/distributed/fsdp/_fully_shard/_fsdp_param.py` (`_init_sharded_param`) and
`_fsdp_collectives.py` (`foreach_reduce`: gradients reduce-scattered into padded shards); DeepSpeed
0.19 `runtime/zero/stage_1_and_2.py` (`DeepSpeedZeroOptimizer.__init__`: `bit16_groups_flat`,
`single_partition_of_fp32_groups`, `grads_in_partition` with `contiguous_gradients`),
`runtime/zero/stage3.py` (`_create_fp32_partitions`, `grad_partitions_flat_buffer`) and
`runtime/zero/partition_parameters.py` (`_padding_size`); see `trainer_memcb.plan.answers.sharding`.

ZeRO-1/2 pad each param group to a multiple of 2W. `plan_model_states(param_groups="trainer")`
splits the trainable parameters as the Trainer does (with and without weight decay), `"one"`
takes them as one group; a live run's groups are read from its optimizer. ZeRO-1/2 gradients are
what two-process runs showed (deepspeed 0.19.8, `DeepSpeedZeroOptimizer`, stages 1 and 2 alike):
when the step begins each process holds, in one contiguous buffer, the whole 16-bit gradient of
every parameter that overlaps its partition, and zeros where its partition runs past a group's
last value (`zero12_gradient_numel`); the figure is the fullest process's unless a rank is given.
DeepSpeed's `BF16_Optimizer` (bf16 with fp32 gradient accumulation under ZeRO-1) keeps them whole
(`layout_model_states(whole_zero_grads=True)`).

A reference model (`reference_model=True`, for DPO-style training: TRL's DPO, KTO, RLOO, and GRPO
with `beta > 0` keep a frozen copy of the policy as `trainer.ref_model`) adds its parameters, in the
policy's dtype, with no gradients and no optimizer state: whole on every process under none, ddp,
zero1 and zero2 (TRL prepares it for ZeRO-1/2 as a plain stage-0 model), partitioned like the
policy's parameters under zero3 and FSDP (TRL shards it the same way). With LoRA there is no second
copy: TRL's trainers, given a PEFT model and no reference model, take the base model with its
adapters disabled as the reference, so the plan adds 0 and says so.

Not counted: activations, temporary buffers (FSDP's all-gathered parameters, DDP's gradient
buckets, ZeRO's reduce buckets), the CUDA context and allocator fragmentation. Two short-lived
figures are given apart, under `transient_bytes`: ZeRO's fp32 gradient partition, made for the
optimizer step only, and the unsharded parameters FSDP's shard-grad-op keeps from forward to
backward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from trainer_memcb.plan.model.param_shapes import logical_shape
from trainer_memcb.plan.settings.setup import PRECISION_DTYPES, PRECISIONS, Setup
from trainer_memcb.utils.units import parse_bytes
from trainer_memcb.plan.answers.sharding import (
    fsdp_local_shape,
    fsdp_padded_shard_numel,
    zero3_partition_numel,
    zero3_sub_group_numels,
    zero12_gradient_numel,
    zero12_partition_numel,
)
from trainer_memcb.plan.optimizers.trainer_optimizers import _decay_parameter_names
from trainer_memcb.plan.model.stand_ins import meta_stand_in
from trainer_memcb.plan.optimizers.update_kinds import unplanned_reason, updates_in_backward
from trainer_memcb.plan.optimizers.whatif import (
    DEFAULT_OPTIMIZERS,
    model_optimizer_what_if,
    optimizer_what_if,
    resolve_optimizer_names,
    training_args_with,
)

__all__ = [
    "PARAM_GROUPINGS",
    "ModelStatesLayout",
    "ModelStatesPlan",
    "OptimizerPlan",
    "ParamSpec",
    "layout_model_states",
    "param_specs",
    "plan_model_states",
    "reference_model_bytes",
    "trainer_param_groups",
]

# How `plan_model_states` groups the trainable parameters (see its `param_groups`).
PARAM_GROUPINGS = ("trainer", "one")
# ZeRO keeps fp32 master partitions (4 bytes a value) and an fp32 gradient partition for the step.
_FP32 = 4


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the plan needs it: its real shape, whether it trains, bytes per value.

    `element_size` None takes the precision setup's; a live model gives its own."""

    shape: Tuple[int, ...]
    trainable: bool = True
    element_size: Optional[int] = None
    is_embedding: bool = False
    # The param group it belongs to (ZeRO-1/2 pad and partition each group on its own).
    group: int = 0
    # A raw parameter count standing for many parameters: partitions cut it without boundaries.
    is_count: bool = False
    name: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def trainer_param_groups(model: nn.Module) -> Dict[int, int]:
    """`id(param)` -> 0 for the parameters the Trainer decays, 1 for the others (biases, norms)."""
    decay = set(_decay_parameter_names(model))
    return {id(param): 0 if name in decay else 1 for name, param in model.named_parameters()}


def param_specs(model: nn.Module, keep_dtypes: bool = False,
                groups: Optional[Mapping[int, int]] = None) -> List[ParamSpec]:
    """The model's parameters, tied ones once, each with its real shape (a DTensor's global one,
    a ZeRO-3 partitioned parameter's `ds_shape`).

    Args:
        model: any model, the meta device included.
        keep_dtypes: take each parameter's own bytes per value (a live model), rather than the
            precision setup's.
        groups: `id(param)` -> its param group's index (default: every parameter in group 0).
    """
    embeddings = {id(module.weight) for module in model.modules()
                  if isinstance(module, nn.Embedding) and isinstance(getattr(module, "weight", None), torch.Tensor)}
    specs = []
    for name, param in model.named_parameters():  # yields a tied tensor once
        specs.append(ParamSpec(shape=logical_shape(param), trainable=param.requires_grad,
                               element_size=param.element_size() if keep_dtypes else None,
                               is_embedding=id(param) in embeddings, name=name,
                               group=(groups or {}).get(id(param), 0)))
    return specs


@dataclass(frozen=True)
class ModelStatesLayout:
    """Parameters, gradients and master weights of the fullest process, and what its optimizer
    steps over. Bytes are per process.

    Attributes:
        params_bytes, grads_bytes, master_weights_bytes: the states, wherever they live.
        params_on_cpu, grads_on_cpu, optimizer_on_cpu: offloaded to the CPU.
        optimizer_shapes: shapes of the tensors one process's optimizer steps over.
        optimizer_element_size: their bytes per value.
        optimizer_over_model: the optimizer steps over the model's own parameters (whole, or
            FSDP's row shards), one `optimizer_shapes` entry per trainable parameter in order;
            False: over flat fp32 copies (ZeRO's partitions, DeepSpeed's mixed precision).
        largest_grad_bytes, largest_grad_param: the largest gradient one process holds for a
            single parameter, and that parameter's name: all an optimizer that updates inside
            backward holds (`trainer_memcb.plan.optimizers.update_kinds`).
        optimizer_embeddings: indices into `optimizer_shapes` that are embedding weights.
        transient_bytes: short-lived extras, by name, not in the model states.
    """

    params_bytes: int
    grads_bytes: int
    master_weights_bytes: int
    params_on_cpu: bool
    grads_on_cpu: bool
    optimizer_on_cpu: bool
    optimizer_shapes: List[Tuple[int, ...]]
    optimizer_element_size: int
    optimizer_over_model: bool = False
    largest_grad_bytes: int = 0
    largest_grad_param: str = ""
    optimizer_embeddings: List[int] = field(default_factory=list)
    transient_bytes: Dict[str, int] = field(default_factory=dict)


@dataclass
class _ShardedStates:
    """What one sharding's rules give a process, before offload and the largest gradient, which
    `layout_model_states` works out the same way for every sharding."""

    params: int
    grads: int
    shapes: List[Tuple[int, ...]]
    optimizer_size: int
    master: int
    embeddings: List[int] = field(default_factory=list)
    transient: Dict[str, int] = field(default_factory=dict)


def _shard_world(setup: Setup) -> int:
    """The processes FSDP shards a parameter across: HSDP shards within each replica."""
    return setup.world_size // setup.replicate


def _trainable_size(size: Sequence[int], trainable: Sequence[int], setup: Setup) -> int:
    """Bytes per value of the trainable parameters (the first one's), the precision's without any."""
    return size[trainable[0]] if trainable else PRECISIONS[setup.precision]


def _embedding_indices(specs: Sequence[ParamSpec], trainable: Sequence[int]) -> List[int]:
    """Which of the optimizer's tensors are embedding weights, when it steps over the trainable
    parameters one by one (8-bit optimizers keep those in 32 bits)."""
    return [n for n, i in enumerate(trainable) if specs[i].is_embedding]


def _replicated_states(specs: Sequence[ParamSpec], setup: Setup, size: Sequence[int],
                       trainable: Sequence[int]) -> _ShardedStates:
    """none and ddp: every process holds the whole model (DDP: torch/nn/parallel/distributed.py
    replicates it), and DeepSpeed's precisions without ZeRO give the optimizer one flat fp32 copy."""
    params = sum(specs[i].numel * size[i] for i in range(len(specs)))
    grads = sum(specs[i].numel * size[i] for i in trainable)
    if setup.precision.startswith("deepspeed-"):
        # DeepSpeed without ZeRO (stage 0), runtime/fp16/fused_optimizer.py FP16_Optimizer and
        # runtime/bf16_optimizer.py: one flat fp32 copy of the trainable parameters, whole.
        numel = sum(specs[i].numel for i in trainable)
        return _ShardedStates(params, grads, [(numel,)], _FP32, numel * _FP32,
                              transient={"fp32_grad_partition_bytes": numel * _FP32})
    return _ShardedStates(params, grads, [specs[i].shape for i in trainable], _trainable_size(size, trainable, setup),
                          0, _embedding_indices(specs, trainable))


def _fsdp_states(specs: Sequence[ParamSpec], setup: Setup, size: Sequence[int],
                 trainable: Sequence[int]) -> _ShardedStates:
    """FSDP2: padded row shards of every parameter and gradient, the optimizer over the shards."""
    world = _shard_world(setup)
    params = sum(fsdp_padded_shard_numel(specs[i].shape, world) * size[i] for i in range(len(specs)))
    grads = sum(fsdp_padded_shard_numel(specs[i].shape, world) * size[i] for i in trainable)
    states = _ShardedStates(params, grads, [fsdp_local_shape(specs[i].shape, world) for i in trainable],
                            _trainable_size(size, trainable, setup), 0, _embedding_indices(specs, trainable))
    if setup.sharding == "fsdp-shard-grad-op":
        # reshard_after_forward=False: from forward to the end of backward each process also holds
        # the all-gathered parameters, W padded shards each (_fsdp_collectives.py
        # foreach_all_gather), beside its own shards (a two-process run: 288 bytes beside 144).
        states.transient["unsharded_params_bytes"] = world * params
    return states


def _zero12_states(specs: Sequence[ParamSpec], setup: Setup, size: Sequence[int], trainable: Sequence[int],
                   rank: Optional[int], whole_zero_grads: bool) -> _ShardedStates:
    """ZeRO-1/2: each group's trainable parameters in a flat buffer padded to 2W, the gradients that
    overlap this process's partition (the fullest process's without a rank), fp32 partitions."""
    world = setup.world_size
    numels = [specs[i].numel for i in trainable]
    trainable_size = _trainable_size(size, trainable, setup)
    group_ids = sorted({specs[i].group for i in trainable})
    groups = [[specs[i].numel for i in trainable if specs[i].group == group] for group in group_ids]
    partitions = [zero12_partition_numel(group, world, element_size=trainable_size) for group in groups]
    # Each group's trainable parameters become views of a flat buffer padded to a multiple of 2W.
    params = (sum(spec.numel * size[i] for i, spec in enumerate(specs) if not spec.trainable)
              + sum(partitions) * world * trainable_size)
    if whole_zero_grads:
        grad_numel = sum(numels)
    elif any(specs[i].is_count for i in trainable):
        # A raw count has no parameter boundaries; it follows the ZeRO paper: P_os (zero1) keeps
        # the gradients whole, P_os+g (zero2) partitions them.
        grad_numel = sum(numels) if setup.sharding == "zero1" else sum(partitions)
    else:
        ranks = range(world) if rank is None else [rank]
        grad_numel = max(zero12_gradient_numel(groups, world, each) for each in ranks)
    # The fp32 gradient partition: made for one group's step at a time (stage_1_and_2.py `step`), freed after it.
    return _ShardedStates(params, grad_numel * trainable_size, [(partition,) for partition in partitions], _FP32,
                          sum(partitions) * _FP32,
                          transient={"fp32_grad_partition_bytes": max(partitions, default=0) * _FP32})


def _zero3_states(specs: Sequence[ParamSpec], setup: Setup, size: Sequence[int],
                  trainable: Sequence[int]) -> _ShardedStates:
    """ZeRO-3: `ceil(numel / W)` of every parameter and gradient, the optimizer over fp32 sub-groups."""
    world = setup.world_size
    params = sum(zero3_partition_numel(specs[i].numel, world) * size[i] for i in range(len(specs)))
    grads = sum(zero3_partition_numel(specs[i].numel, world) * size[i] for i in trainable)
    sub_groups = [numel for group in sorted({specs[i].group for i in trainable})
                  for numel in zero3_sub_group_numels([specs[i].numel for i in trainable if specs[i].group == group],
                                                      world, setup.sub_group_size)]
    master = sum(sub_groups) * _FP32
    return _ShardedStates(params, grads, [(numel,) for numel in sub_groups], _FP32, master,
                          transient={"fp32_grad_partition_bytes": master})


def layout_model_states(specs: Sequence[ParamSpec], setup: Setup, *, rank: Optional[int] = None,
                        whole_zero_grads: bool = False) -> ModelStatesLayout:
    """Parameters, gradients, master weights and the optimizer's stand-in shapes, per process.

    Args:
        specs: the parameters (`param_specs`).
        setup: how the job runs.
        rank: the process to lay out; None for the fullest one (figures that differ between
            processes, ZeRO-1/2's gradients, take their largest).
        whole_zero_grads: ZeRO-1 under DeepSpeed's `BF16_Optimizer`, which keeps every 16-bit
            gradient whole.
    """
    if rank is not None and not 0 <= rank < setup.world_size:
        raise ValueError(f"rank={rank!r}: expected 0 to {setup.world_size - 1}")
    default_size = PRECISIONS[setup.precision]
    size = [spec.element_size or default_size for spec in specs]
    trainable = [index for index, spec in enumerate(specs) if spec.trainable]
    if setup.sharding in ("none", "ddp"):
        states = _replicated_states(specs, setup, size, trainable)
    elif setup.is_fsdp:
        states = _fsdp_states(specs, setup, size, trainable)
    elif setup.sharding in ("zero1", "zero2"):
        states = _zero12_states(specs, setup, size, trainable, rank, whole_zero_grads)
    else:  # zero3
        states = _zero3_states(specs, setup, size, trainable)

    fsdp_offload = setup.is_fsdp and setup.offload_params
    world = _shard_world(setup) if setup.is_fsdp else setup.world_size
    per_param_grads = {i: (fsdp_padded_shard_numel(specs[i].shape, world) if setup.is_fsdp else specs[i].numel) * size[i]
                       for i in trainable}
    largest = max(trainable, key=lambda i: per_param_grads[i], default=None)
    return ModelStatesLayout(
        params_bytes=states.params, grads_bytes=states.grads, master_weights_bytes=states.master,
        params_on_cpu=setup.offload_params, grads_on_cpu=fsdp_offload,
        optimizer_on_cpu=setup.offload_optimizer or fsdp_offload,
        optimizer_shapes=states.shapes, optimizer_element_size=states.optimizer_size,
        optimizer_over_model=not (setup.is_zero or setup.precision.startswith("deepspeed-")),
        largest_grad_bytes=per_param_grads[largest] if largest is not None else 0,
        largest_grad_param=specs[largest].name if largest is not None else "",
        optimizer_embeddings=states.embeddings, transient_bytes=states.transient,
    )


def reference_model_bytes(specs: Sequence[ParamSpec], setup: Setup) -> int:
    """Bytes per process of a frozen reference model with these parameters: a parameter-only
    layout, whole except under zero3 (partitions) and FSDP (padded shards), as the policy's.

    Examples:
        >>> from trainer_memcb.plan.answers.model_states import ParamSpec, reference_model_bytes
        >>> from trainer_memcb.plan.settings.setup import Setup
        >>> reference_model_bytes([ParamSpec((1000,))], Setup(world_size=4, sharding="zero3"))  # 250 fp32 values
        1000
    """
    size = PRECISIONS[setup.precision]
    if setup.sharding == "zero3":
        numels = [zero3_partition_numel(spec.numel, setup.world_size) for spec in specs]
    elif setup.is_fsdp:
        numels = [fsdp_padded_shard_numel(spec.shape, _shard_world(setup)) for spec in specs]
    else:
        numels = [spec.numel for spec in specs]
    return sum(numel * (spec.element_size or size) for numel, spec in zip(numels, specs))


def _is_peft_model(model: Any) -> bool:
    """A PEFT model (LoRA and the like): it can disable its adapters to act as its own reference."""
    return isinstance(model, nn.Module) and hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


# Why a LoRA run's reference model adds nothing (trl/trainer/dpo_trainer.py: with a PeftModel and
# ref_model=None, the reference log-probabilities come from `model.disable_adapter()`).
PEFT_REFERENCE_NOTE = "0: with PEFT adapters the reference is the base model with its adapters disabled, no second copy"


@dataclass(frozen=True)
class OptimizerPlan:
    """One optimizer's model states on the fullest process.

    Attributes:
        name: the Trainer's `optim` name.
        optimizer_class: the class the Trainer builds, when known.
        params_bytes, grads_bytes, optimizer_state_bytes, master_weights_bytes: the four states.
        model_states_bytes: their sum.
        device_bytes: the part on the accelerator; cpu_bytes: the part offloaded to the CPU.
        cpu_bytes_per_node: `cpu_bytes` times the processes on a node.
        transient_bytes: short-lived extras, not in the sums.
        fits: `device_bytes <= device_memory`, when a device memory was given.
        margin_bytes: `device_memory - device_bytes` (negative: short by that much).
        problem: why there is no optimizer figure, or None.
        source: where the optimizer-state rule comes from.
        updates_in_backward: LOMO, AdaLomo and the layer-wise optimizers: `grads_bytes` is the one
            gradient such an update holds at a time, the largest parameter's.
        reference_model_bytes: a frozen reference model's parameters (`reference_model=True`),
            included in `model_states_bytes`; 0 without one.
        engine: None: the figures are the sharding rules' (above); an engine's name
            (`trainer_memcb.plan.answers.step_memory.states_during_step`): each state's figure is the
            most it held at one moment of that engine's traced step, its buffers included, and
            `transient_bytes` is empty (those buffers are in the figures).
        at_optimizer_step_bytes: with an engine, what each state (`parameters`,
            `gradients`, `optimizer_state`, `master_weights`) held at the optimizer step's peak.
    """

    name: str
    optimizer_class: Optional[str]
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: Optional[int]
    master_weights_bytes: int
    model_states_bytes: Optional[int]
    device_bytes: Optional[int]
    cpu_bytes: Optional[int]
    cpu_bytes_per_node: Optional[int]
    transient_bytes: Dict[str, int] = field(default_factory=dict)
    fits: Optional[bool] = None
    margin_bytes: Optional[int] = None
    problem: Optional[str] = None
    source: Optional[str] = None
    updates_in_backward: bool = False
    reference_model_bytes: int = 0
    engine: Optional[str] = None
    at_optimizer_step_bytes: Dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelStatesPlan:
    """The plan for one model and setup: one `OptimizerPlan` per optimizer asked for, and notes
    (one sentence each) on figures a reader could take for a mistake."""

    model: str
    setup: Setup
    total_params: int
    trainable_params: int
    device_memory_bytes: Optional[int]
    optimizers: List[OptimizerPlan]
    reference_model: bool = False
    reference_model_note: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "model": self.model,
            "setup": asdict(self.setup),
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "device_memory_bytes": self.device_memory_bytes,
            "optimizers": [entry.to_dict() for entry in self.optimizers],
            "notes": list(self.notes),
            "reference_model": self.reference_model,
            "reference_model_note": self.reference_model_note,
            # A step plan's table (`engine` set) holds the engine's buffers in its states' figures.
            # The activations and temporaries of a traced step are in its peak, not here.
            "not_counted": "the CUDA context, allocator fragmentation (the activations and temporaries are in the "
            "step plan's peak)" if any(entry.engine for entry in self.optimizers) else
            "activations, temporary buffers, the CUDA context, allocator fragmentation",
        }


def _combine(name: str, layout: ModelStatesLayout, setup: Setup, optimizer_bytes: Optional[int],
             optimizer_class: Optional[str], problem: Optional[str], source: Optional[str],
             device_memory: Optional[int], in_backward: bool = False) -> OptimizerPlan:
    grads = layout.largest_grad_bytes if in_backward else layout.grads_bytes
    if optimizer_bytes is None:
        return OptimizerPlan(name, optimizer_class, layout.params_bytes, grads, None,
                             layout.master_weights_bytes, None, None, None, None, dict(layout.transient_bytes),
                             problem=problem, source=source, updates_in_backward=in_backward)
    cpu = (layout.params_bytes if layout.params_on_cpu else 0) + (grads if layout.grads_on_cpu else 0)
    if layout.optimizer_on_cpu:
        cpu += optimizer_bytes + layout.master_weights_bytes
    total = layout.params_bytes + grads + optimizer_bytes + layout.master_weights_bytes
    device = total - cpu
    fits = margin = None
    if device_memory is not None:
        margin = device_memory - device
        fits = margin >= 0
    return OptimizerPlan(name, optimizer_class, layout.params_bytes, grads, optimizer_bytes,
                         layout.master_weights_bytes, total, device, cpu, cpu * setup.processes_per_node,
                         dict(layout.transient_bytes), fits, margin, None, source, in_backward)


def _with_reference(row: OptimizerPlan, reference: int, layout: ModelStatesLayout, setup: Setup,
                    device_memory: Optional[int]) -> OptimizerPlan:
    """`row` with a frozen reference model's `reference` bytes added to the model states, where the
    parameters live (offloaded with them)."""
    if not reference:
        return row
    if row.model_states_bytes is None:
        return replace(row, reference_model_bytes=reference)
    on_cpu = reference if layout.params_on_cpu else 0
    cpu = row.cpu_bytes + on_cpu
    device = row.device_bytes + reference - on_cpu
    margin = None if device_memory is None else device_memory - device
    return replace(row, reference_model_bytes=reference, model_states_bytes=row.model_states_bytes + reference,
                   device_bytes=device, cpu_bytes=cpu, cpu_bytes_per_node=cpu * setup.processes_per_node,
                   margin_bytes=margin, fits=None if margin is None else margin >= 0)


def _stand_ins(layout: ModelStatesLayout) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """Flat stand-ins of what ZeRO (or DeepSpeed's mixed precision) hands the optimizer."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(layout.optimizer_element_size, torch.float32)
    params = [nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")) for shape in layout.optimizer_shapes]
    return params, [params[index] for index in layout.optimizer_embeddings]


def _model_stand_in(model: Optional[nn.Module], layout: ModelStatesLayout, setup: Setup,
                    keep_dtypes: bool) -> nn.Module:
    """The model as one process's optimizer sees it, on the meta device: the same modules, names
    and tied weights, each trainable parameter in the shape this process steps over (whole, or an
    FSDP row shard) and in the precision's dtype (or its own with `keep_dtypes`). The optimizer is
    then built over it exactly as the what-if builds it (`model_optimizer_what_if`), so that GaLore
    finds its target modules and LOMO its model. A raw parameter count is one flat tensor."""
    dtype = PRECISION_DTYPES[setup.precision]
    if model is None:
        holder = nn.Module()
        for index, shape in enumerate(layout.optimizer_shapes):
            holder.register_parameter(f"flat_{index}", nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")))
        return holder
    stand_in = meta_stand_in(model)
    trainable = [param for param in stand_in.parameters() if param.requires_grad]  # the layout's order
    replacements = {
        id(param): nn.Parameter(torch.empty(shape, dtype=param.dtype if keep_dtypes else dtype, device="meta"))
        for param, shape in zip(trainable, layout.optimizer_shapes)
    }
    for module in stand_in.modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) in replacements:  # a tied weight gets the same one
                module._parameters[key] = replacements[id(param)]
    return stand_in


def _notes(layout: ModelStatesLayout, setup: Setup, specs: Sequence[ParamSpec], rows: Sequence[OptimizerPlan]) -> List[str]:
    """Sentences on figures a reader could take for a mistake."""
    notes = []
    trainable_sizes = {spec.element_size or PRECISIONS[setup.precision] for spec in specs if spec.trainable}
    if setup.is_zero and layout.master_weights_bytes and trainable_sizes == {_FP32}:
        notes.append(
            "master weights: ZeRO gives the optimizer an fp32 copy of this process's partition even when the "
            "parameters are fp32 already (DeepSpeed 0.19.8: stage_1_and_2.py clones it into "
            "single_partition_of_fp32_groups; stage3.py's branch that would reuse an fp32 partition compares a "
            "torch.device with a device name and never matches, so it copies too)")
    fused = [row.name for row in rows if row.updates_in_backward]
    if fused:
        where = f", {layout.largest_grad_param}" if layout.largest_grad_param else ""
        notes.append(
            f"gradients of {', '.join(fused)}: updated inside backward one parameter at a time, so one gradient at a "
            f"time, the largest parameter's{where}, in its dtype")
    return notes


def _model_specs(model: Union[nn.Module, int], model_name: Optional[str], keep_dtypes: bool,
                 param_groups: str) -> Tuple[List[ParamSpec], str, Optional[nn.Module]]:
    """(the parameters, the model's name, the module or None for a raw count): a model is read
    parameter by parameter in the Trainer's groups (or one), a count becomes one flat tensor; a
    model with nothing to train is refused, since there would be no optimizer to plan."""
    if isinstance(model, nn.Module):
        specs = param_specs(model, keep_dtypes=keep_dtypes,
                            groups=trainer_param_groups(model) if param_groups == "trainer" else None)
        name = model_name or type(model).__name__
        module: Optional[nn.Module] = model
    elif isinstance(model, int) and not isinstance(model, bool) and model > 0:
        specs = [ParamSpec(shape=(model,), is_count=True, name="(one flat tensor)")]
        name = model_name or f"{model:,} parameters"
        module = None
    else:
        raise ValueError(f"model={model!r}: expected an nn.Module or a positive parameter count")
    if not any(spec.trainable for spec in specs):
        raise ValueError(f"{name} has no trainable parameter")
    return specs, name, module


def _reference_of(reference_model: bool, module: Optional[nn.Module], specs: Sequence[ParamSpec],
                  setup: Setup) -> Tuple[int, Optional[str]]:
    """(a frozen reference model's bytes per process, the note that says why they are 0): a PEFT
    model is its own reference, its adapters disabled, so it adds nothing."""
    if not reference_model:
        return 0, None
    if _is_peft_model(module):
        return 0, PEFT_REFERENCE_NOTE
    return reference_model_bytes(specs, setup), None


def _optimizer_row(optimizer_name: str, layout: ModelStatesLayout, setup: Setup, args: Any,
                   module: Optional[nn.Module], stand_in: Optional[nn.Module], memory: Optional[int]) -> OptimizerPlan:
    """One optimizer's row, its state built as the what-if builds it: over the model's stand-in when
    it steps over the model's parameters, else over ZeRO's (or DeepSpeed's) flat fp32 stand-ins; a
    name the plan does not model in this setup gets a row that says why."""
    deepspeed = setup.is_zero or setup.precision.startswith("deepspeed-")
    refused = unplanned_reason(optimizer_name, world_size=setup.world_size, sharding=setup.sharding,
                               deepspeed=deepspeed)
    if refused is not None:  # not planned: its gradients as a plain optimizer's, no note
        return _combine(optimizer_name, layout, setup, None, None, refused, None, memory)
    if stand_in is not None:
        found = model_optimizer_what_if(optimizer_name, args, stand_in)
    else:
        params, embeddings = _stand_ins(layout)
        found = optimizer_what_if(optimizer_name, params, args=args, model=module, embeddings=embeddings)
    estimate = found.estimate
    return _combine(optimizer_name, layout, setup, estimate.num_bytes if estimate else None,
                    found.optimizer_class, found.problem, estimate.source if estimate else None, memory,
                    updates_in_backward(optimizer_name))


def plan_model_states(
    model: Union[nn.Module, int],
    optimizers: Union[str, Iterable[str]] = DEFAULT_OPTIMIZERS,
    setup: Optional[Setup] = None,
    *,
    args: Any = None,
    device_memory: Union[None, int, str] = None,
    model_name: Optional[str] = None,
    param_groups: str = "trainer",
    optim_args: Union[None, str, Mapping[str, Any]] = None,
    optim_target_modules: Union[None, str, Sequence[str]] = None,
    keep_dtypes: bool = False,
    reference_model: bool = False,
) -> ModelStatesPlan:
    """Plan the model states of the fullest process, for each optimizer.

    Every name the what-if takes is planned the way the what-if builds it: over the model's
    stand-in (whole, or FSDP's row shards) the Trainer's own optimizer, GaLore's and APOLLO's target
    groups, LOMO's model and the layer-wise variants included; over ZeRO's flat fp32 partitions the
    optimizer with its class and arguments. In one process the optimizer-state figure equals the
    what-if's to the byte. LOMO, AdaLomo and the layer-wise variants update inside backward: their
    gradients are the largest parameter's alone (`trainer_memcb.plan.optimizers.update_kinds`). A name the plan
    does not model in a setup (GaLore over ZeRO's flat partitions, layer-wise over several
    processes, which the Trainer refuses) gets a row that says why.

    Args:
        model: a model (any device, the meta device included; not changed), or a raw parameter
            count, taken as one flat trainable tensor (the ZeRO paper's Psi).
        optimizers: the Trainer's `optim` names.
        setup: world size, sharding, precision, offload; default one fp32 process.
        args: `TrainingArguments` for the optimizers' hyperparameters; None uses the defaults.
        device_memory: the accelerator's memory per process (`"80GiB"` or bytes), for fits / margin.
        model_name: how to name the model.
        param_groups: `"trainer"`: the trainable parameters in the Trainer's two groups, with and
            without weight decay (`Trainer.create_optimizer`), which ZeRO pads and partitions one
            by one; `"one"`: all in one group.
        optim_args: replaces `args.optim_args`, as in `what_if`: `"momentum=0.9"` or a dict.
        optim_target_modules: replaces `args.optim_target_modules` (GaLore, APOLLO), as in `what_if`.
        keep_dtypes: take each parameter's own dtype (a model loaded in the precision's dtype, whose
            LoRA adapters PEFT keeps in float32) rather than the precision's for all.
        reference_model: add a frozen reference model, as DPO-style training holds: a copy of
            the parameters in the same dtype, no gradients, no optimizer state; 0 for a PEFT
            model, whose reference is itself with its adapters disabled (`reference_model_note`).

    Raises:
        ValueError: a bad setup, an unknown optimizer, a model with nothing to train, a bad size,
            a malformed `optim_args` or `optim_target_modules`.

    Examples:
        >>> from trainer_memcb.plan.answers.model_states import plan_model_states
        >>> from trainer_memcb.plan.settings.setup import Setup
        >>> plan = plan_model_states(7_500_000_000, "adamw", Setup(world_size=64, sharding="zero3",
        ...                          precision="deepspeed-fp16"))
        >>> round(plan.optimizers[0].model_states_bytes / 1e9, 1)  # the ZeRO paper's 1.9 GB
        1.9
    """
    setup = setup or Setup()
    names = resolve_optimizer_names(optimizers)
    memory = parse_bytes(device_memory) if device_memory is not None else None
    if param_groups not in PARAM_GROUPINGS:
        raise ValueError(f"param_groups={param_groups!r} is not one of: {', '.join(PARAM_GROUPINGS)}")
    args = training_args_with(args, optim_args=optim_args, optim_target_modules=optim_target_modules)
    specs, name, module = _model_specs(model, model_name, keep_dtypes, param_groups)
    layout = layout_model_states(specs, setup)
    stand_in = _model_stand_in(module, layout, setup, keep_dtypes) if layout.optimizer_over_model else None
    reference, note = _reference_of(reference_model, module, specs, setup)
    rows = [_optimizer_row(optimizer_name, layout, setup, args, module, stand_in, memory) for optimizer_name in names]
    rows = [_with_reference(row, reference, layout, setup, memory) for row in rows]
    return ModelStatesPlan(
        model=name, setup=setup,
        total_params=sum(spec.numel for spec in specs),
        trainable_params=sum(spec.numel for spec in specs if spec.trainable),
        device_memory_bytes=memory, optimizers=rows, notes=_notes(layout, setup, specs, rows),
        reference_model=bool(reference_model), reference_model_note=note,
    )
