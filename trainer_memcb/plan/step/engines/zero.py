"""DeepSpeed ZeRO-1/2/3 modelled in the step's fake timeline, buffer by buffer, from the config.

DeepSpeed's engine does not run under fake tensors (its optimizer flattens real storages and
talks to an accelerator), so each buffer it allocates is made here as a fake tensor at the moment
deepspeed 0.19.8 allocates it, and freed when it frees it; the model's own forward and backward
run as traced. The Trainer's optimizer class and hyperparameters are kept, on DeepSpeed's flat
fp32 partitions (the client optimizer DeepSpeed wraps).

The figures of the process `settings.rank` names (rank 0 unless given): under ZeRO-1/2 each rank's
partition is its own range of each group's flat buffer, so which gradients overlap it, and when
it makes its gradient partition, differ by rank (with the group padding at the end the last
rank's partition may hold zeros instead of values, the same bytes). Per param group of the
Trainer's optimizer (decay, no decay):

- ZeRO-1/2 (`runtime/zero/stage_1_and_2.py`, `DeepSpeedZeroOptimizer`):
  - `__init__`: the fp32 master partition (`single_partition_of_fp32_groups`,
    `zero12_partition_numel` values), on the CPU with `offload_optimizer`;
    `initialize_optimizer_states` steps the optimizer once on zero gradients, so the optimizer
    state exists before the first step (and lives where the master partition does);
  - backward (`setup_buckets`, from the first gradient's hook, `process_gradients`): the reduce
    bucket, `reduce_bucket_size` values (a second one with `overlap_comm`), in the gradients' dtype for ZeRO-2 and fp32 for
    ZeRO-1 (`_gradient_reduction_buffer_dtype`); dropped at the end of backward
    (`independent_gradient_partition_epilogue` → `_release_ipg_buffers`);
  - ZeRO-2, or ZeRO-1 with `overlap_comm`: each gradient is copied into the bucket as soon as it is
    accumulated and freed (`reduce_ready_partitions_and_remove_grads` from the grad hook); ZeRO-1
    without `overlap_comm` keeps every gradient whole until the end of backward
    (`reduce_gradients`, then the same per-parameter reduction);
  - the gradients of the parameters that overlap the partition, copied whole into one buffer
    (`copy_grads_in_partition`: `grads_in_partition`, `zero12_gradient_numel` values);
  - the step (`step` → `_optimizer_step`): the fp32 gradient partition
    (`flat_grad_partition.to(fp32)`, the partition's values) exists only inside it, on the CPU with
    `offload_optimizer`; then the 16-bit partition is updated in place.
- ZeRO-3 (`runtime/zero/stage3.py`, `DeepSpeedZeroOptimizer_Stage3`, `partition_parameters.py`):
  - each parameter keeps its `ceil(numel / W)` 16-bit partition; parameters under
    `stage3_param_persistence_threshold` values stay whole (`persistent_parameters`) beside theirs;
  - a module's parameters are whole, beside their partitions, from its forward (backward) pre-hook
    to its post-hook (`PartitionedParameterCoordinator.fetch_sub_module` / `release_sub_module`),
    and from its forward to its backward when the trace reaches them again within
    `stage3_max_reuse_distance` values (`__params_to_release`); in backward, the next uses'
    parameters are prefetched, the queue passed over and released as
    `PartitionedParameterCoordinator` does once its trace is complete (`fetch_sub_module`,
    `__all_gather_params`, `release_sub_module`: zero3_fetch.py), up to
    `stage3_prefetch_bucket_size` values a time and within `stage3_max_live_parameters`; forward's
    own timeline fetches each module's parameters on demand (the next uses are known once it has
    run), its decisions replayed at the start of backward;
  - gradients go through the reduce bucket into the 16-bit gradient partition
    (`grad_partitions_flat_buffer`, allocated at init); the fp32 master sub-groups
    (`zero3_sub_group_numels`) and their optimizer state, on the CPU with `offload_optimizer`;
    the fp32 gradient of one sub-group at a time inside the step, every parameter released to its
    partition for the step, the persistent ones too (`step` → `_partition_all_parameters`), and
    the persistent ones gathered whole again at its end (`_post_step`).

- ZeRO-1/2 with `offload_optimizer` (`_offload_zero12_buffers`): the partition's 16-bit host copy and
  the largest parameter's host staging buffer (`offload_buffers`, on the host), its device staging
  buffer (`engine_buffers`), the fp32 gradient partition kept on the host between steps instead of
  the device's 16-bit one; each gradient larger than the bucket kept whole to the next gradient's
  arrival (`extra_large_param_to_reduce`, with or without offload) and, with offload, cloned
  beside itself; the fp64 copy of each gradient's slice for its norm; the optimizer step's own
  temporaries on the host (`host_temporaries`), where it steps.

- ZeRO-3 with `offload_optimizer` (`initialize_optimizer_states`): each fp32 sub-group's gradient
  made on the host at init and kept (`_release_sub_group` drops it only without offload);
  `offload_param` moves the 16-bit partitions to the host (`_create_param_groups_fp16_flat_cpu_memory`):
  counted there, a parameter on the device only while it is gathered whole.

Gradient accumulation (accelerate's `DeepSpeedEngineWrapper.backward`: `set_gradient_accumulation_boundary`
true on the last micro-batch only, `engine.step()` after it only; no `no_sync`):
- ZeRO-1 (`reduce_ready_partitions_and_remove_grads` reduces only at the boundary, and
  `DeepSpeedEngine.allreduce_gradients` calls `reduce_gradients` only there): before the last
  micro-batch nothing is reduced; the whole gradients accumulate in `param.grad` and the reduce
  bucket made at the first gradient's hook (`setup_buckets`) stays until the boundary's epilogue;
- ZeRO-2 (reduces every micro-batch, `overlapping_partition_gradients_reduce_epilogue`): each
  micro-batch's gradients go through the bucket into a new `grads_in_partition`; the first
  micro-batch's is kept by the epilogue (`all_grad_tensors`, views of it, while
  `_release_ipg_buffers` drops the attribute), each later one is added into it
  (`accumulated_grad.add_`) and freed, and at the boundary the kept one becomes the step's
  `averaged_gradients`; with `offload_optimizer`, each gradient of the partition is accumulated in
  a host buffer of the parameter's size made once and kept (`async_accumulate_grad_in_cpu_via_gpu`:
  `accumulated_grads_in_cpu`), its fp64 norm copy made at the boundary only;
- ZeRO-3 (`partition_grads`): each micro-batch's gradient partition is added into the 16-bit
  gradient partition in place (`micro_step_id > 0`), and each micro-batch's forward and backward
  fetch and release the parameters as the first's.

Streams: with `overlap_comm`, ZeRO-1/2's `reduce_ipg_grads` copies the reduced gradients into
this rank's partition under `get_accelerator().stream(self.reduction_stream)`, so the 16-bit
gradient partition `copy_grads_in_partition` makes there (`grads_in_partition`, each micro-batch's
under ZeRO-2's accumulation) is allocated on that stream (`REDUCTION_STREAM`); every other buffer
modelled here is made on the default stream. ZeRO-3 with `overlap_comm` (true unless set, for
stage 3) gathers on the coordinator's all-gather stream (parameter_offload.py `__allgather_stream`):
`fetch_sub_module` runs `all_gather_coalesced` under it and waits on the handle under it, and the
wait makes `param.data`, so each parameter made whole is allocated on `ALLGATHER_STREAM`. The plan
counts a whole parameter and its partition as one storage (`_set_whole`), so the partition's
bytes lie on that stream with it (in a run they stay in the flat 16-bit partition buffer, on the
default stream); the persistent parameters gathered again by `_post_step` run on the default
stream. The reduce-and-partition stream (stage3.py) allocates nothing modelled here: the reduce
bucket and the gradient partition are made at init on the default stream, and
`reduce_scatter_coalesced`'s own temporaries are not modelled. Not replayed: the frees the
`record_stream` calls delay (`free_param` records the compute stream on a whole parameter,
`__add_grad_to_ipg_bucket` and `partition_grads` the reduce-and-partition stream on a gradient;
ZeRO-1/2's `_record_gradient_stream` with `offload_optimizer`): how long depends on how far the
host runs ahead of the GPU, and the replay takes the GPU to keep up, so they free at once.

Not modelled: ZeRO-3's prefetching in forward's own timeline, ZeRO-3's offload staging
buffers on an accelerator, the all-gather of the updated 16-bit partitions (done in place
in the flat 16-bit buffers, `allgather_bucket_size` bounding each call's chunk, no new memory in
0.19.8's `all_gather_dp_groups`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from trainer_memcb.plan.step.engines.base import StepEngine
from trainer_memcb.plan.step.engines.zero3_fetch import FetchCoordinator
from trainer_memcb.state.rules.deepspeed_zero import (
    zero3_partition_numel,
    zero3_sub_group_numels,
    zero12_gradient_numel,
    zero12_partition_numel,
)

__all__ = ["ZeroEngine", "REDUCTION_STREAM", "ZERO3_STREAMS"]

# DeepSpeedZeroOptimizer's `reduction_stream` (stage_1_and_2.py `__init__`), by the number the plan
# gives it (`Timeline.streams`).
REDUCTION_STREAM = 1
# ZeRO-3's side streams with overlap_comm: DeepSpeedZeRoOffload's `__allgather_stream`
# (parameter_offload.py, handed to the PartitionedParameterCoordinator) and
# DeepSpeedZeroOptimizer_Stage3's `reduce_and_partition_stream` (stage3.py `__init__`).
ALLGATHER_STREAM, REDUCE_AND_PARTITION_STREAM = 1, 2
ZERO3_STREAMS = {ALLGATHER_STREAM: "allgather_stream", REDUCE_AND_PARTITION_STREAM: "reduce_and_partition_stream"}


class ZeroEngine(StepEngine):
    """DeepSpeed ZeRO's buffers beside the traced step.

    Args:
        settings: resolved settings (`zero_stage`, `zero`, `world_size`, `overlap_comm`,
            `offload_optimizer`, `max_grad_norm`).
    """

    name = "zero"
    state_resident = True

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.settings = settings
        self.stage = settings.zero_stage
        # ZeRO-0 (DeepSpeed's precision without a ZeRO stage): one partition, the whole model.
        self.world = settings.world_size if self.stage else 1
        self.tracker_params: List[torch.Tensor] = []
        self.optimizer_builder: Any = None
        self.offload = bool(settings.offload_optimizer)
        # ZeRO-3's offload_param: every 16-bit partition on the host, a parameter on the device
        # only while it is gathered whole.
        self.offload_params = self.stage == 3 and bool(settings.offload_params)
        self.host_parts = ("master_weights", "optimizer_state", "fp32_gradients", "offload_buffers",
                           "host_temporaries") if self.offload else (("offload_buffers",) if self.offload_params else ())
        self._masters: List[torch.Tensor] = []
        self._optimizer: Any = None
        self._buckets: List[torch.Tensor] = []
        self._grad_partition: List[torch.Tensor] = []
        self._hooks: List[Any] = []
        self._mode: Any = None
        self._groups: List[List[torch.Tensor]] = []
        self._trainable: List[torch.Tensor] = []
        self._gathered: Dict[int, None] = {}
        self._fp32_grads: List[torch.Tensor] = []  # ZeRO-1/2 offload: kept between steps, on the host
        self._offload_buffers: List[torch.Tensor] = []  # host: the 16-bit copies and the gradient staging
        self._host_bit16: List[torch.Tensor] = []
        self._host_bit16_serials: set = set()
        # ZeRO-1/2's reduce bucket, as `reduce_independent_p_g_buckets_and_remove_grads` fills it:
        # the parameters whose gradients it holds (one kept whole: `extra_large_param_to_reduce`)
        # and their values.
        self._bucket_params: List[torch.Tensor] = []
        self._bucket_values = 0
        self.rank = settings.rank
        self._in_partition: Dict[int, int] = {}  # id(param): its values in this rank's partition (ZeRO-1/2)
        self._norms: List[torch.Tensor] = []
        self._persistent_partitions: List[torch.Tensor] = []  # ZeRO-3: the persistent parameters' partitions
        self._device_staging: List[torch.Tensor] = []
        # Gradient accumulation: the last micro-batch is DeepSpeed's accumulation boundary.
        self.accumulation = int(getattr(settings, "gradient_accumulation_steps", 1) or 1)
        self._boundary = True
        self._accumulated: List[torch.Tensor] = []  # ZeRO-2: the first micro-batch's grads_in_partition
        self._host_accumulation: List[torch.Tensor] = []  # ZeRO-1/2 offload: accumulated_grads_in_cpu
        # ZeRO-1/2 reduce on their own stream with overlap_comm; the stream allocations go to now.
        self._reduces_on_stream = self.stage in (1, 2) and bool(settings.overlap_comm)
        # ZeRO-3 gathers on its all-gather stream with overlap_comm (its default), else on the default one.
        self._gathers_on_stream = self.stage == 3 and bool(settings.overlap_comm)
        self.stream_names = ({REDUCTION_STREAM: "reduction_stream"} if self._reduces_on_stream
                             else dict(ZERO3_STREAMS) if self._gathers_on_stream else {})
        self._stream = 0

    # -- construction (deepspeed.initialize) ------------------------------------------------------
    def wrap(self, model: nn.Module, mode: Any) -> nn.Module:
        self._mode = mode
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        trainer_optimizer = self.optimizer_builder(model) if self.optimizer_builder is not None else None
        if trainer_optimizer is not None:
            inner = getattr(trainer_optimizer, "optimizer", trainer_optimizer)
            self._groups = [[p for p in group["params"] if p.requires_grad] for group in inner.param_groups]
            self._groups = [group for group in self._groups if group]
        else:
            self._groups = [self._trainable]
        with mode:
            if self.stage == 3:
                numels = [zero3_sub_group_numels([p.numel() for p in group], self.world,
                                                 int(self.settings.zero["sub_group_size"])) for group in self._groups]
                self._masters = [torch.empty(n, dtype=torch.float32) for group in numels for n in group]
                total16 = sum(zero3_partition_numel(p.numel(), self.world) for p in self._trainable)
                dtype = self._trainable[0].dtype if self._trainable else torch.float32
                # stage3.py: grad_partitions_flat_buffer, made at init.
                self._grad_partition = [torch.empty(total16, dtype=dtype)]
                # The persistent parameters (under `stage3_param_persistence_threshold` values) stay
                # whole, and keep their partition too: `fp16_partitioned_groups_flat` holds every
                # parameter's `ds_tensor` (`_create_fp16_partitions_with_defragmentation`); the others'
                # partitions are counted with their parameters (`_set_whole`).
                threshold = int(self.settings.zero["stage3_param_persistence_threshold"])
                persistent = sum(zero3_partition_numel(p.numel(), self.world) for p in model.parameters()
                                 if p.numel() < threshold)
                self._persistent_partitions = [torch.empty(persistent, dtype=dtype)] if persistent else []
                if self.offload_params:
                    # `_create_param_groups_fp16_flat_cpu_memory`: every 16-bit partition is in one
                    # flat host buffer, the persistent parameters' too (counted as parameters).
                    gathered = sum(zero3_partition_numel(p.numel(), self.world) for p in model.parameters()
                                   if p.numel() >= threshold)
                    self._host_bit16 = self._persistent_partitions + [torch.empty(gathered, dtype=dtype)]
                    self._persistent_partitions = []
                if self.offload:
                    # stage3.py `initialize_optimizer_states`: with offload_optimizer each fp32
                    # sub-group's gradient (`subgroup_gradient_buffer`) is made on the host and kept
                    # (`_release_sub_group` drops it only without offload); the 16-bit gradient
                    # partition is made on `self.device`, the host with offload (`resident`).
                    self._fp32_grads = [torch.empty(master.numel(), dtype=torch.float32) for master in self._masters]
            else:
                self._masters = [torch.empty(zero12_partition_numel([p.numel() for p in group], self.world), dtype=torch.float32)
                                 for group in self._groups]
                self._find_partition()
                if self.world > 1:
                    self.notes.append(f"ZeRO-{self.stage}: the figures of rank {self.rank}'s process; each rank's "
                                      "partition keeps other gradients, so its peak may differ (--rank R for another)")
                if self.offload:
                    self._offload_zero12_buffers()
                    if self.accumulation > 1:
                        # async_accumulate_grad_in_cpu_via_gpu: one host buffer per parameter of the
                        # partition, of its whole size in its dtype, made at its first accumulation, kept.
                        self._host_accumulation = [torch.empty(p.numel(), dtype=p.dtype) for p in self._trainable
                                                   if self._in_partition.get(id(p), 0)]
                        self._offload_buffers = self._offload_buffers + self._host_accumulation
            if trainer_optimizer is not None:
                inner = getattr(trainer_optimizer, "optimizer", trainer_optimizer)
                accepted = set(inspect.signature(type(inner).__init__).parameters)
                options = [{key: value for key, value in group.items() if key in accepted and key != "params"}
                           for group in inner.param_groups if any(p.requires_grad for p in group["params"])]
                if self.stage == 3:  # sub-groups: each keeps its param group's options (the first's here)
                    options = [options[0]] * len(self._masters)
                self._optimizer = type(inner)([dict(option, params=[master]) for option, master in zip(options, self._masters)])
                # initialize_optimizer_states: one step on zero gradients makes the state now.
                for master in self._masters:
                    master.grad = torch.zeros_like(master)
                self._optimizer.step()
                for master in self._masters:
                    master.grad = None
        if self.stage == 3:
            self._partition_parameters(model)
        else:
            for param in self._trainable:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_ready))
        return model

    def _offload_zero12_buffers(self) -> None:
        """What `offload_optimizer` adds to ZeRO-1/2, made at init and kept (deepspeed 0.19.8,
        stage_1_and_2.py, `DeepSpeedZeroOptimizer`): all in the model's dtype but the fp32
        gradient partition; "host" is `self.device`, the CPU with offload."""
        dtype = self._trainable[0].dtype if self._trainable else torch.float32
        largest = max((p.numel() for group in self._groups for p in group), default=0)
        # __init__: per param group, `temp_buffer_bit16` (`param_buffer_of_bit16_for_cpu_offload_groups`),
        # the partition's 16-bit copy on the host, the step's way back to the device's partition.
        self._host_bit16 = [torch.empty(master.numel(), dtype=dtype) for master in self._masters]
        # __init__: `temp_grad_buffer_for_cpu_offload` (host) and `temp_grad_buffer_for_gpu_offload`
        # (the device, `current_device_name()`), the largest parameter's values each.
        self._offload_buffers = self._host_bit16 + [torch.empty(largest, dtype=dtype)]
        self._device_staging = [torch.empty(largest, dtype=dtype)]
        # initialize_optimizer_states: the fp32 gradient partition (`single_partition_of_fp32_groups[i].grad`)
        # is made on the host and, with offload, never set to None: backward copies each reduced
        # gradient's slice into it (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`), and the
        # step reads it in place; no 16-bit gradient partition on the device (`copy_grads_in_partition`
        # returns before making `grads_in_partition`).
        self._fp32_grads = [torch.empty(master.numel(), dtype=torch.float32) for master in self._masters]

    def _find_partition(self) -> None:
        """Each parameter's values in this rank's partition: values `rank * partition_size` to
        `(rank + 1) * partition_size` of each group's flat buffer, the parameters in the group's
        order (`get_partition_info`)."""
        for group, master in zip(self._groups, self._masters):
            start, end = self.rank * master.numel(), (self.rank + 1) * master.numel()
            offset = 0
            for param in group:
                self._in_partition[id(param)] = max(0, min(offset + param.numel(), end) - max(offset, start))
                offset += param.numel()

    def resident(self) -> Dict[str, List[torch.Tensor]]:
        parts: Dict[str, List[torch.Tensor]] = {"master_weights": list(self._masters)}
        if self._fp32_grads:
            parts["fp32_gradients"] = list(self._fp32_grads)
            parts["offload_buffers"] = list(self._offload_buffers)
            parts["engine_buffers"] = list(self._device_staging)
        if self.offload_params:  # ZeRO-3's 16-bit partitions on the host
            parts.setdefault("offload_buffers", []).extend(self._host_bit16)
        if self._optimizer is not None:
            parts["optimizer_state"] = [value for state in self._optimizer.state.values() for value in state.values()
                                        if isinstance(value, torch.Tensor)]
        if self._grad_partition:
            # ZeRO-3 with offload_optimizer: `grad_partitions_flat_buffer` is made on `self.device`,
            # the CPU (stage3.py `__init__`), so it is among the host's offload buffers.
            part = "offload_buffers" if self.stage == 3 and self.offload else "gradients"
            parts.setdefault(part, []).extend(self._grad_partition)
        if self._persistent_partitions:
            parts["parameters"] = list(self._persistent_partitions)
        return parts

    def attach(self, tracker: Any, counter: Any) -> None:
        super().attach(tracker, counter)
        if self._reduces_on_stream or self._gathers_on_stream:
            tracker.stream_of = self._stream_now
        self._host_bit16_serials = set(tracker.serials(self._host_bit16))
        if self.stage == 3:
            # Each parameter is its 16-bit partition outside its module's use, and made so: under
            # the Trainer, `from_pretrained` runs in `deepspeed.zero.Init`, which partitions each
            # parameter as it is made, so the whole parameters counted a moment ago never coexist
            # (nor take the allocator's memory together, in its replay of the steps' setup).
            for param in self.tracker_params:
                storage = param.untyped_storage()
                tracker.made_at_size(storage, self._partition_bytes(param), "parameters")
            tracker.restart_peak()

    # -- ZeRO-3's partitioned parameters -----------------------------------------------------------
    def _partition_parameters(self, model: nn.Module) -> None:
        threshold = int(self.settings.zero["stage3_param_persistence_threshold"])
        self.tracker_params = [p for p in model.parameters() if p.numel() >= threshold]
        self._tracked = {id(p) for p in self.tracker_params}
        self._persistent = [p for p in model.parameters() if p.numel() < threshold]
        # PartitionedParameterCoordinator.__params_to_release (from the second step on, the trace
        # complete): a module's parameters are kept whole at its release when the modules that come
        # next in the step's trace reach them again before `stage3_max_reuse_distance` values are
        # traversed. After a module's forward the next use is its backward, and between them come the
        # forward of every later module and their backward: 2 x the values of the later modules'
        # own parameters (persistent ones included, as `iter_params` counts them).
        self._reuse_distance = int(self.settings.zero.get("stage3_max_reuse_distance", 1_000_000_000))
        self._forward_values = 0
        self._total_values = sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False))
        # The coordinator's trace (PartitionedParameterCoordinator.record_module / record_parameters):
        # each use of a module with parameters of its own, in `ds_id` order (the model's parameter
        # order), recorded in forward; backward is taken to use them in the reverse order
        # (`expects` checks it as it goes).
        self._by_key = dict(enumerate(model.parameters()))
        self._keys = order = {id(p): key for key, p in self._by_key.items()}
        self._forward_trace: List[Any] = []
        self._coordinator: Optional[FetchCoordinator] = None
        self._backward_index: Dict[int, int] = {}  # id(module): its use's step in the trace
        for module in model.modules():
            mine = list(module.parameters(recurse=False))
            if not mine:
                continue
            own = [p for p in mine if p.numel() >= threshold]
            keys = sorted(order[id(p)] for p in mine)
            values = sum(p.numel() for p in mine)
            self._hooks.append(module.register_forward_pre_hook(
                lambda m, i, own=own, values=values, keys=keys: self._fetch_forward(m, own, values, keys)))
            self._hooks.append(module.register_forward_hook(lambda m, i, o, own=own: self._release_after_forward(own)))
            self._hooks.append(module.register_full_backward_pre_hook(lambda m, g, own=own: self._fetch_backward(m, own)))
            self._hooks.append(module.register_full_backward_hook(lambda m, gi, go, own=own: self._release_backward(m, own)))
        for param in self._trainable:
            self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_ready))

    def _fetch_forward(self, module: nn.Module, own: List[torch.Tensor], values: int, keys: List[int]) -> None:
        if self.tracker is not None and self.tracker.phase == "forward":
            self._forward_trace.append((id(module), keys))
        if own:  # forward's timeline as before: each module's own parameters, on demand
            self._fetch(own, values)

    def _start_backward_trace(self) -> None:
        """The coordinator at the start of backward: its forward decisions replayed over the traced
        forward (which fetched each module's own parameters only: the order of the next uses is
        known once forward has run), and every parameter set whole or partitioned as it left them.
        Forward's prefetches are therefore missing from forward's own timeline, not from backward's."""
        if not self._forward_trace:
            return
        zero = self.settings.zero
        threshold = int(zero["stage3_param_persistence_threshold"])
        # The model itself is a use at the start of each pass with no parameters of its own: its
        # forward pre-hook comes first in forward and, its output being the loss, its pre-backward
        # first in backward (parameter_offload.py `_pre_backward_module_hook`). The one between the
        # last module's forward and its backward keeps that module whole into backward when a
        # prefetch passed over its backward use (__params_to_release: `most_recent > step_id`).
        root = [("model", [])]
        trace = root + self._forward_trace + root + self._forward_trace[::-1]
        numel = {key: p.numel() for key, p in self._by_key.items()}
        persistent = {key for key, p in self._by_key.items() if p.numel() < threshold}
        self._coordinator = coordinator = FetchCoordinator(
            trace, numel, persistent, int(zero["stage3_prefetch_bucket_size"]),
            int(zero["stage3_max_live_parameters"]), int(zero["stage3_max_reuse_distance"]))
        for index in range(len(self._forward_trace) + 1):
            coordinator.fetch()
            if index:  # the model's own post-hook comes after backward
                coordinator.release(index)
        coordinator.fetch()  # the model's pre-backward
        for param in self.tracker_params:
            self._set_whole(param, self._keys[id(param)] in coordinator.available)

    def _fetch_backward(self, module: nn.Module, own: List[torch.Tensor]) -> None:
        coordinator = self._coordinator
        if coordinator is None or not coordinator.expects(id(module)):
            if coordinator is not None:  # DeepSpeed drops its trace then and fetches on demand
                self.notes.append("ZeRO-3: backward did not use the modules in the reverse of forward's "
                                  "order; its prefetching is not modelled from there on")
                self._coordinator = None
            self._fetch(own)
            return
        self._backward_index[id(module)] = coordinator.step
        for key in coordinator.fetch():
            param = self._by_key[key]
            if id(param) in self._tracked:
                self._set_whole(param, True)

    def _release_backward(self, module: nn.Module, own: List[torch.Tensor]) -> None:
        coordinator = self._coordinator
        index = self._backward_index.pop(id(module), None)
        if coordinator is None or index is None:
            self._release(own)
            return
        for key in coordinator.release(index):
            param = self._by_key[key]
            if id(param) in self._tracked:
                self._set_whole(param, False)

    def _partition_bytes(self, param: torch.Tensor) -> int:
        """The bytes of the parameter's 16-bit partition on the device (none with offload_param:
        the partition is in the host's flat buffer, counted there)."""
        return 0 if self.offload_params else zero3_partition_numel(param.numel(), self.world) * param.element_size()

    def _set_whole(self, param: torch.Tensor, whole: bool) -> None:
        # partition_parameters.py (`_allgather_param`, `all_gather_coalesced`): the gathered
        # parameter is a new whole buffer (`param.data`) beside its partition (`param.ds_tensor`, a
        # view of the flat `fp16_partitioned_groups_flat`), which stays: whole, both count.
        storage = param.untyped_storage()
        partition = self._partition_bytes(param)
        size = storage.nbytes() + partition if whole else partition
        # fetch_sub_module → __all_gather_params_ runs `all_gather_coalesced` under the all-gather
        # stream, and waits on its handle there too: the whole `param.data` (`torch.cat` of the
        # partitions in `AllGatherCoalescedHandle.wait`, a view of `param_buffer` for one
        # parameter) is allocated on that stream. The partition rides with it here (one storage).
        self._stream = ALLGATHER_STREAM if whole and self._gathers_on_stream else 0
        try:
            self.tracker.set_size(storage, size, "unsharded_parameters" if whole else "parameters")
        finally:
            self._stream = 0

    def _fetch(self, params: List[torch.Tensor], values: int = 0) -> None:
        if self.tracker is not None:
            if self.tracker.phase == "forward":
                self._forward_values += values
            for param in params:
                self._set_whole(param, True)

    def _release_after_forward(self, params: List[torch.Tensor]) -> None:
        later = self._total_values - self._forward_values
        if self.tracker is not None and self.tracker.phase == "forward" and 2 * later < self._reuse_distance:
            return  # kept whole until its backward (a recomputation in backward releases as before)
        self._release(params)

    def _release(self, params: List[torch.Tensor]) -> None:
        if self.tracker is not None:
            for param in params:
                self._set_whole(param, False)

    # -- backward -------------------------------------------------------------------------------------
    def micro_batch(self, number: int, last: bool) -> None:
        self._boundary = last
        if self.stage == 3:  # each micro-batch's forward records the trace its backward replays
            self._forward_trace = []
            self._forward_values = 0
            self._coordinator = None
            self._backward_index = {}

    def backward(self, loss: torch.Tensor) -> None:
        if self.stage == 1 and not self._boundary:
            # Before the boundary ZeRO-1 reduces nothing: the hooks make the bucket only, and the
            # gradients accumulate whole in `param.grad`.
            loss.backward()
            self.tracker.tag([p.grad for p in self._trainable if p.grad is not None], "gradients")
            return
        if self.stage == 3:
            self._setup_buckets()  # under the trace's fake mode already
            self._start_backward_trace()
        with warnings.catch_warnings():
            # The release hooks on modules whose inputs need no gradient (the embedding's token
            # ids): torch says their hook fires on the outputs' gradients, which is when it is wanted.
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            loss.backward()
        if self.stage == 3:  # every module released by the end of backward (a module without an
            self._release(self.tracker_params)  # input gradient never runs its backward hook)
        if self.stage == 1 and not self.settings.overlap_comm:
            # reduce_gradients: the whole gradients, walked at the end of backward group by group
            # through the grad hook's own path (`reduce_ready_partitions_and_remove_grads`).
            for group in self._groups:
                for param in group:
                    if param.grad is not None:
                        self._bucket_or_hold(param)
        if self._bucket_params:  # independent_gradient_partition_epilogue → reduce_ipg_grads
            self._reduce_bucket()
        if self.stage != 3:
            # independent_gradient_partition_epilogue → _release_ipg_buffers: the reduce buckets
            # are dropped at the end of backward (setup_buckets makes them again at the next one),
            # so they are not alive at the optimizer step.
            self._buckets = []
        if self.stage == 2 and self.accumulation > 1 and not self._fp32_grads:
            # The epilogue keeps the first micro-batch's gradient partition (`all_grad_tensors`);
            # a later one's is added into it and freed; at the boundary the kept one is the step's.
            if not self._accumulated:
                self._accumulated, self._grad_partition = self._grad_partition, []
            else:
                self._grad_partition = []
            if self._boundary:
                self._grad_partition, self._accumulated = self._accumulated, []

    def _setup_buckets(self) -> None:
        if self._buckets:
            return
        if not self.settings.zero.get("contiguous_gradients", True):
            return
        # The gradients' dtype (`_gradient_reduction_buffer_dtype`: the model's unless
        # data_types.grad_accum_dtype differs); two with overlap_comm for ZeRO-1/2, one for ZeRO-3
        # (stage3.py makes it at init; the difference in time does not change a step's peak).
        dtype = self._trainable[0].dtype if self._trainable else torch.float32
        count = 2 if (self.settings.overlap_comm and self.stage != 3) else 1
        self._buckets = [torch.empty(int(self.settings.zero["reduce_bucket_size"]), dtype=dtype) for _ in range(count)]
        if self.tracker is not None:
            self.tracker.tag(self._buckets, "engine_buffers")

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self.stage != 3:
            # stage_1_and_2.py `process_gradients` → `setup_buckets`: ZeRO-1/2 make their buckets at
            # the first gradient's hook, not when backward starts, so the first gradient's own
            # backward (the output layer's, whose input gradient is freed by then) runs without them.
            self._setup_buckets()
        if self.stage == 1 and (not self.settings.overlap_comm or not self._boundary):
            return
        if self.stage == 3:
            self._reduce(param)
            return
        self._bucket_or_hold(param)

    def _bucket_or_hold(self, param: torch.Tensor) -> None:
        # reduce_independent_p_g_buckets_and_remove_grads: the bucket is reduced first when this
        # gradient would overflow it (`reduce_ipg_grads`); then a gradient of more values than the
        # bucket is kept whole (`extra_large_param_to_reduce`), any other copied into the bucket,
        # its own storage freed (the gradient becomes a view of the bucket).
        size = int(self.settings.zero["reduce_bucket_size"])
        if self._bucket_values + param.numel() > size:
            self._reduce_bucket()
        if param.numel() > size and self._contiguous():
            if self.offload:
                # `_offload_gradient_safety_enabled`: `grad_reduc.data = grad_reduc.detach().clone()`,
                # the copy made beside the gradient autograd made, which it then replaces.
                param.grad = param.grad.clone()
            self.tracker.tag([param.grad], "gradients")
        else:
            self.tracker.tag([param.grad], "gradients")  # the whole gradient, until it is in the bucket
            param.grad = None
        self._bucket_params.append(param)
        self._bucket_values += param.numel()

    def _reduce_bucket(self) -> None:
        """`reduce_ipg_grads`: each gradient of the bucket reduced, in the order it came."""
        params, self._bucket_params, self._bucket_values = self._bucket_params, [], 0
        for param in params:
            self._reduce(param)

    def _contiguous(self) -> bool:
        # stage_1_and_2.py __init__: `contiguous_gradients or cpu_offload`.
        return bool(self.settings.zero.get("contiguous_gradients", True)) or self.offload

    def _reduce(self, param: torch.Tensor) -> None:
        """One gradient reduced: ZeRO-3's at once (its hook), ZeRO-1/2's at its bucket's reduction
        (a gradient copied into the bucket no longer has a storage of its own by then)."""
        in_partition = self._in_partition.get(id(param), 0)
        # copy_grads_in_partition makes `grads_in_partition` at the first reduction of a gradient
        # of this rank's own partition (`is_param_in_current_partition`), not at the first one.
        if self.stage != 3 and not self._grad_partition and not self._fp32_grads and in_partition:
            numel = zero12_gradient_numel([[p.numel() for p in group] for group in self._groups], self.world, self.rank)
            # Made inside reduce_ipg_grads' `with stream(...)`: the reduction stream with overlap_comm.
            self._stream = REDUCTION_STREAM if self._reduces_on_stream else 0
            self._grad_partition = [torch.empty(numel, dtype=self._trainable[0].dtype)]
            self._stream = 0
            self.tracker.tag(self._grad_partition, "gradients")
        if param.grad is not None:
            self.tracker.tag([param.grad], "gradients")  # the whole gradient, until its reduction frees it
        if self._fp32_grads and in_partition and self._boundary:
            # copy_grads_in_partition with offload (`set_norm_for_param_grad_in_gpu`): the norm of
            # the gradient's slice in this partition, taken in fp64 (`get_norm_dtype()`): an fp64
            # copy of the slice for a moment, its 0-dim norm kept until the step's
            # `reset_cpu_buffers`; then the slice goes into the host's fp32 gradient partition.
            fp64_slice = [torch.empty(in_partition, dtype=torch.float64)]  # alive while the norm is taken
            self._norms.append(torch.empty((), dtype=torch.float64))
            fp64_slice.clear()
        if self.stage == 1 and not in_partition:
            # reduce_ipg_grads clears the gradients of other partitions only when it partitions
            # them (`partition_gradients`, ZeRO-2): ZeRO-1 keeps a whole gradient (one too large for
            # the bucket) until its step frees it (`free_grad_in_param_list(params_not_in_partition)`).
            return
        param.grad = None

    def gradients(self, trainable: List[torch.Tensor]) -> List[torch.Tensor]:
        return list(self._grad_partition) + [p.grad for p in trainable if p.grad is not None]

    # -- the optimizer step ---------------------------------------------------------------------------
    def step(self, build_optimizer: Any, model: nn.Module, trainable: List[torch.Tensor]) -> Any:
        optimizer = self._optimizer
        if optimizer is None:
            return None
        if self.stage != 3:
            return self._step_where_it_runs(optimizer)
        # stage3.py `step` → `_partition_all_parameters` → `release_and_reset_all` releases every
        # parameter before the sub-groups step, the persistent ones too (`__release_param` does not
        # look at `ds_persist`): their whole data is freed and only their partitions remain; the
        # step's end (`_post_step`) gathers them whole again for the next forward.
        self._persistent_whole(False)
        try:
            return self._step_where_it_runs(optimizer)
        finally:
            self._persistent_whole(True)

    def _stream_now(self) -> int:
        return self._stream

    def _persistent_whole(self, whole: bool) -> None:
        # Their partitions are counted apart (`_persistent_partitions`), so released they are none.
        # Each resize gives the storage a new serial number: the one it had until now is named
        # "parameters" too, as it was (a model parameter's), for the peaks before the step.
        if self.tracker is None:
            return
        self.tracker.tag(self._persistent, "parameters")
        for param in self._persistent:
            storage = param.untyped_storage()
            self.tracker.set_size(storage, storage.nbytes() if whole else 0, "parameters")

    def _step_where_it_runs(self, optimizer: Any) -> Any:
        if self.offload:
            # The optimizer steps on the host's partitions: what it makes there (its temporaries,
            # the clipping's norms) is on the host too, out of the device's peak.
            tracker, cursor = self.tracker, [len(self.tracker.sizes)]

            def on_host(func: Any, args: Any, kwargs: Any) -> None:
                for serial in range(cursor[0], len(tracker.sizes)):
                    tracker.tags.setdefault(serial, "host_temporaries")
                cursor[0] = len(tracker.sizes)

            previous, tracker.on_op = tracker.on_op, on_host
            try:
                return self._step(optimizer)
            finally:
                tracker.on_op = previous
        return self._step(optimizer)

    def _step(self, optimizer: Any) -> Any:
        # One fp32 gradient partition (ZeRO-3: one sub-group) at a time, freed after its step;
        # ZeRO-1/2 with offload: the one kept on the host, read in place.
        for index, master in enumerate(self._masters):
            if self.stage != 3:
                # free_grad_in_param_list(params_not_in_partition[i]): ZeRO-1's kept whole gradients.
                for param in self._groups[index]:
                    if not self._in_partition.get(id(param), 0):
                        param.grad = None
            if self._fp32_grads:
                fp32 = self._fp32_grads[index]
            else:
                fp32 = torch.empty(master.numel(), dtype=torch.float32)
                self.tracker.tag([fp32], "fp32_gradients")
            master.grad = fp32
            del fp32
            if self.max_grad_norm:
                torch.nn.utils.clip_grad_norm_([master], self.max_grad_norm)
            optimizer.step()
            master.grad = None
        self._norms = []  # reset_cpu_buffers, after the last group's step
        return optimizer

    def state_of(self, part: str, serial: int) -> Optional[str]:
        # The offload's 16-bit host copies carry parameters, its staging buffers gradients.
        if part == "offload_buffers":
            return "parameters" if serial in self._host_bit16_serials else "gradients"
        return super().state_of(part, serial)

    def state_tensors(self, optimizer: Any) -> List[torch.Tensor]:
        return [] if optimizer is None else super().state_tensors(optimizer)

    def zero_grad(self, optimizer: Any) -> None:
        for param in self._trainable:
            param.grad = None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.tracker is not None and self.tracker.stream_of == self._stream_now:
            self.tracker.stream_of = None
        self._buckets = []
        self._grad_partition = []
        self._accumulated = []
        self._host_accumulation = []
        self._fp32_grads = []
        self._offload_buffers = []
        self._device_staging = []
