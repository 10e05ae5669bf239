"""Make it fit: the settings a user can change without changing what is learned, each planned by
the traced step, ranked by what they cost in step time.

`search_fits` plans the user's own settings and a set of proposals, each a `TrainingArguments`
dict (and a DeepSpeed config where it uses ZeRO) planned by the same trace as the user's own
(`plan_step_memory`, through the caller's `planner`): no formula, no shortcut.

- the per-device batch, with the gradient accumulation that keeps the effective batch
  (batch x accumulation x processes) equal to the user's: the largest batch that fits, found among
  the divisors of batch x accumulation by bisection (the peak grows with the batch);
- gradient checkpointing (non-reentrant, as the Trainer turns it on), alone and with the batch;
- the optimizers the Trainer offers that hold less (`LEANER_OPTIMIZERS`: 8-bit, paged 8-bit,
  Adafactor), marked as changing the optimizer;
- with several processes: DeepSpeed ZeRO-1, 2 and 3, ZeRO-3 with the optimizer offloaded to the
  CPU, FSDP2, and tensor parallelism (`tensor_parallel_sizes`: alone on all the processes, or with
  FSDP2 on the rest as accelerate's `ParallelismConfig(tp_size, dp_shard_size)` lays them out), its
  accumulation raised to keep the effective batch (its `tp_size` processes share one batch);
- expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`), only where the plan
  models the caching allocator (`expandable_segments_option`);
- transformers' flash_attention_2 where the user's own step traced eager attention and the caller
  allows it (`flash_attention_proposable`: CUDA, 16 bits, a class that supports it), marked as
  needing the flash-attn package;
- Liger's kernels (`use_liger_kernel=True`) where the caller allows them (`liger_kernel_proposable`:
  CUDA, a model type whose patching is planned), marked as needing the liger-kernel package;
- the trainer's own settings the caller names (`trainer_proposals`: TRL's
  `precompute_ref_log_probs` for DPO and KTO, which then hold no reference model; `trainer_searches`,
  the largest that fits of an ordered list: GRPO's and RLOO's `generation_batch_size` and colocated
  vLLM's `vllm_gpu_memory_utilization`, `trainer_memcb.plan.answers.grpo_fit`), and the trainer's
  rule for a setting's arguments (`settle_args`: GRPO and RLOO keep their generation batch as the
  batch changes; KTO takes no micro-batch of 1 with its KL term, `trainer_memcb.plan.answers.kto_fit`);
- with `allow`: a shorter sequence (`seq-len`) and LoRA adapters (`lora`), which change the training.

Activation offloading is not proposed. transformers (5.x) has none of its own; TRL's
(`SFTConfig.activation_offloading`, `trl.models.activation_offloading.get_act_offloading_ctx_manager`)
is an `SFTConfig` field, not a `TrainingArguments` one, and its `OffloadActivations` cannot be built
without an accelerator (its `__init__` reads `torch.accelerator.current_accelerator().type` and
makes that device's streams and pinned host memory), while the step is traced on the host under
fake tensors: running the trace under it is not possible there, and a formula would not be the trace.

Its parts: the cost model (`trainer_memcb.plan.answers.fit_cost`: each proposal's step time
relative to the user's own, from the FLOPs its trace counted, with its collectives' bytes at the
links' bandwidth from `trainer_memcb.plan.answers.fit_comm`), the candidates
(`trainer_memcb.plan.answers.fit_candidates`: one setting planned, its verdict, the settings it
writes) and the search, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from trainer_memcb.plan.answers.fit_candidates import (ALLOWED_CHANGES, FLASH_ATTENTION, LEANER_OPTIMIZERS,
                                                       LIGER_KERNEL, FitCandidate, FitSearch, deepspeed_config_of,
                                                       describe_changes, expandable_segments_option,
                                                       flash_attention_proposable, liger_kernel_proposable, same_state,
                                                       needs_package, step_verdict, training_args_of)
from trainer_memcb.plan.answers.fit_comm import Links, ModelShape, communication_seconds, layout_sizes
from trainer_memcb.plan.answers.fit_cost import (FLOPS_PER_SECOND, HOST_BANDWIDTH, MICRO_BATCH_SECONDS,
                                                 offload_transfer_bytes, step_seconds)
from trainer_memcb.plan.answers.step_memory import StepMemoryPlan, plan_step_memory
from trainer_memcb.plan.step.trace import counting_flops, sharing_traces, traced_micro_batches

# The cost model and the candidates are modules of their own; their names stay importable here.
__all__ = ["FitCandidate", "FitSearch", "FitBatch", "step_verdict", "search_fits", "largest_fitting_batch",
           "fit_batch_size", "step_planner", "training_args_of", "describe_changes",
           "deepspeed_config_of", "expandable_segments_option", "flash_attention_proposable",
           "liger_kernel_proposable", "ALLOWED_CHANGES", "LEANER_OPTIMIZERS",
           "FLOPS_PER_SECOND", "MICRO_BATCH_SECONDS", "HOST_BANDWIDTH"]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_that_fits(search: "_Search", divisors: List[int], samples: int, base: Dict[str, Any],
                       base_changes: Dict[str, Any], deepspeed: Optional[Dict[str, Any]]) -> Optional[FitCandidate]:
    """The largest of `divisors` (ascending) whose step fits as the per-device batch, with the
    accumulation that keeps `samples` per process, searched by halving (a larger batch never
    holds less); None when none fits or the search's budget runs out first."""
    sizes = [dict(per_device_train_batch_size=batch, gradient_accumulation_steps=samples // batch) for batch in divisors]
    return _largest_fitting(search, [(dict(base_changes, **each), dict(base, **each)) for each in sizes], deepspeed)


def _largest_fitting(search: "_Search", options: Sequence[Tuple[Dict[str, Any], Dict[str, Any]]],
                     deepspeed: Optional[Dict[str, Any]]) -> Optional[FitCandidate]:
    """The last of `options` (changes and `TrainingArguments` dict each, ordered so that a later one
    never holds less) whose step fits, searched by halving; None when none fits or the search's
    budget runs out first."""
    chosen: Optional[FitCandidate] = None
    low, high = 0, len(options) - 1
    while low <= high:
        middle = (low + high) // 2
        changes, args = options[middle]
        candidate = search.plan(dict(changes), dict(args), deepspeed)
        if candidate is None or candidate.peak_bytes is None:
            break
        if candidate.fits:
            chosen, low = candidate, middle + 1
        else:
            high = middle - 1
    return chosen


@dataclass
class _Search:
    """The search's state: the planner, the limit, the cost model, the proposals planned so far."""

    planner: Callable[..., StepMemoryPlan]
    usable: int
    world_size: int
    device_type: str
    trainable_values: int
    value_bytes: int
    budget: int
    own_args: Dict[str, Any] = field(default_factory=dict)
    own_deepspeed: Optional[Dict[str, Any]] = None
    planned: Dict[str, FitCandidate] = field(default_factory=dict)
    traces: int = 0
    links: Optional[Links] = None
    shape: Optional[ModelShape] = None
    parameter_bytes: int = 0
    # The trainer's own rule for a setting's arguments (`search_fits`' `settle_args`).
    settle: Optional[Callable[[Dict[str, Any]], Optional[Dict[str, Any]]]] = None

    def takes(self, args: Dict[str, Any]) -> bool:
        """Whether the trainer takes a setting of these arguments (`settle_args`)."""
        return self.settle is None or self.settle(dict(args)) is not None

    def plan(self, changes: Dict[str, Any], args: Dict[str, Any], deepspeed: Optional[Dict[str, Any]],
             extra: Optional[Dict[str, Any]] = None, own: bool = False,
             micro_batch_flops: Optional[int] = None) -> Optional[FitCandidate]:
        """Plan one setting (once per distinct setting), or None when the budget is spent or the
        trainer does not take it (`settle`); `micro_batch_flops`, where given, are one
        micro-batch's FLOPs on a process, in place of the trace's count."""
        if self.settle is not None:
            settled = self.settle(dict(args))
            if settled is None:
                return None
            args = settled
        key = repr((sorted(args.items(), key=str), deepspeed, sorted((extra or {}).items())))
        if key in self.planned:
            return self.planned[key]
        if not own and self.traces >= self.budget:
            return None
        self.traces += 0 if own else 1
        with counting_flops():  # the step time is read from them
            plan = self.planner(args, deepspeed, **(extra or {}))
        micro = int(args.get("gradient_accumulation_steps") or 1)
        batch = int(args.get("per_device_train_batch_size") or 1)
        transfer = offload_transfer_bytes(deepspeed, self.trainable_values, self.value_bytes, self.world_size,
                                          self.device_type)
        # The trace runs up to three micro-batches (the first, the second, the last: each the same
        # forward and backward), so one micro-batch's FLOPs are the trace's over their number.
        flops = plan.timeline.flops if plan.timeline is not None else None
        # Under tensor parallelism the counter sees the DTensor ops at their whole shapes (it counts
        # above DTensor's dispatch), while each rank multiplies its column or row shard and runs its
        # heads: a rank's FLOPs are the count over `tp`.
        tp = layout_sizes(args, self.world_size)[0]
        step_flops = (flops // len(traced_micro_batches(micro)) // tp
                      if flops is not None and plan.step.problem is None else None)
        if micro_batch_flops is not None and plan.step.problem is None:
            step_flops = micro_batch_flops
        fits, margin = step_verdict(plan, self.usable)
        optim = args.get("optim")
        seconds = step_seconds(step_flops, micro, transfer, self.device_type)
        if seconds is not None:
            seconds += communication_seconds(args, deepspeed, self.world_size, self.parameter_bytes,
                                             self.trainable_values * self.value_bytes, self.shape, self.links)
        candidate = FitCandidate(
            changes=changes, training_args=args, deepspeed=deepspeed, peak_bytes=plan.step.peak_bytes,
            reserved_peak_bytes=plan.device.reserved_peak_bytes,
            fits=fits, margin_bytes=margin, relative_step_time=None,
            effective_batch=batch * micro * layout_sizes(args, self.world_size)[1], micro_batches=micro,
            step_flops=step_flops,
            host_transfer_bytes=transfer, changes_optimizer=optim != self.own_args.get("optim"),
            alters_training=bool({"seq_len", "lora_r"} & set(changes)), problem=plan.step.problem, plan=plan,
            needs_package=needs_package(changes), seconds=seconds)
        self.planned[key] = candidate
        return candidate


def search_fits(planner: Callable[..., StepMemoryPlan], own_args: Dict[str, Any], usable_bytes: int, *,
                own_deepspeed: Optional[Dict[str, Any]] = None, world_size: int = 1, device_type: str = "cuda",
                trainable_values: int = 0, value_bytes: int = 2, allow: Iterable[str] = (),
                seq_len: Optional[int] = None, max_candidates: int = 16,
                optimizers: Sequence[str] = LEANER_OPTIMIZERS,
                expandable_segments: Optional[Dict[str, str]] = None, flash_attention: bool = False,
                liger_kernel: bool = False, trainer_proposals: Sequence[Dict[str, Any]] = (),
                tensor_parallel_sizes: Sequence[int] = (), context_parallel_sizes: Sequence[int] = (),
                links: Optional[Links] = None,
                shape: Optional[ModelShape] = None, parameter_bytes: int = 0,
                trainer_searches: Optional[Callable[[FitCandidate], Sequence[Sequence[Dict[str, Any]]]]] = None,
                settle_args: Optional[Callable[[Dict[str, Any]], Optional[Dict[str, Any]]]] = None) -> FitSearch:
    """Plan the user's own settings and the proposals that may fit, ranked by step time.

    Args:
        planner: `planner(training_args, deepspeed, **extra) -> StepMemoryPlan`: the step plan of
            a `TrainingArguments` dict and a DeepSpeed config (or None), the user's other settings
            (sequence length, processes, precision flags) kept; `extra` is `seq_len=`, `lora_r=`
            or the allocator option of `expandable_segments`.
        own_args: the user's own settings as a `TrainingArguments` dict (`training_args_of`).
        usable_bytes: the device's memory less the reserve, per process.
        own_deepspeed: the user's DeepSpeed config, if any.
        world_size: processes (the effective batch counts them; ZeRO and FSDP2 need 2 or more).
        device_type: "cuda" or "cpu": the step time's device (`FLOPS_PER_SECOND`, ...).
        trainable_values: the trainable parameter values, for the host transfers of offload.
        value_bytes: the bytes of each trainable value on the device.
        allow: changes that alter the training (`ALLOWED_CHANGES`): "seq-len" halves the sequence
            (`seq_len` needed), "lora" trains LoRA adapters of rank 16, "qlora" the same over a
            4-bit base (both through `extra`'s `lora_r`, `load_in_4bit`).
        max_candidates: the most proposals planned (the own setting not counted); `optimizers` the
            leaner optimizers tried.
        expandable_segments: `expandable_segments_option(...)` of the planner (None: not proposed).
        flash_attention: propose `FLASH_ATTENTION` (through `extra`'s `attn_implementation`) where
            the user's own step traced eager attention; `flash_attention_proposable` says where.
        liger_kernel: propose `LIGER_KERNEL` (a `TrainingArguments` field); `liger_kernel_proposable`
            says where.
        trainer_proposals: changes of the trainer's own config (TRL's fields), each planned at the
            user's batch as its `TrainingArguments` dict with the change.
        trainer_searches: given the user's own setting planned, lists of such changes, each
            ordered so that a later one never holds less (TRL's `generation_batch_size`, ascending):
            of each list the last that fits is proposed, found by halving.
        settle_args: the trainer's own rule for a setting's `TrainingArguments` dict: the dict as
            the trainer takes it (GRPO: the generation batch kept as the batch changes), or None
            where it refuses it (then not planned).
        tensor_parallel_sizes: the tensor-parallel sizes proposed (each divides `world_size`; the
            model's heads split over it, its MLP width too beside FSDP2): `tp` alone where it is `world_size`, else with
            FSDP2 on `world_size / tp` (a `parallelism_config` in the `TrainingArguments` dict).
        context_parallel_sizes: the context-parallel sizes proposed (each divides `world_size`, where
            accelerate and the plan take them): `cp` with FSDP2 over `dp_shard x cp`.
        links: the links' bandwidths, for the collectives' share of the step time (None: not counted).
        shape: the model's shape, for the collectives' bytes (`fit_comm.communication_seconds`).
        parameter_bytes: the model's parameters' bytes on the device, likewise.

    Raises:
        ValueError: an unknown change in `allow`, a bad `max_candidates`.
    """
    allow = _checked_search(allow, max_candidates)
    search = _Search(planner, usable_bytes, world_size, device_type, trainable_values, value_bytes, max_candidates,
                     own_args=dict(own_args), own_deepspeed=own_deepspeed, links=links, shape=shape,
                     parameter_bytes=parameter_bytes, settle=settle_args)
    # Each step traced once; a proposal that changes the optimizer alone steps from a trace made before.
    with sharing_traces():
        own = search.plan({}, dict(own_args), own_deepspeed, own=True)
        base = dict(own_args)
        _propose_kernels_and_trainers(search, own, base, own_deepspeed, flash_attention, liger_kernel,
                                      trainer_proposals, trainer_searches)
        checkpointed = _propose_each_change(search, base, own_deepspeed, optimizers, world_size)
        _propose_layouts(search, base, tensor_parallel_sizes, own, context_parallel_sizes)
        if expandable_segments:
            search.plan({"PYTORCH_CUDA_ALLOC_CONF": expandable_segments["alloc_conf"]}, dict(base), own_deepspeed,
                        dict(expandable_segments))
        _propose_allowed(search, base, own_deepspeed, allow, seq_len)
        # The batch: the largest that fits, below the user's when the own does not fit, any other else;
        # with checkpointing too where checkpointing alone does not fit.
        _batch_search(search, {}, base, own_deepspeed, below=not own.fits)
        if checkpointed is not None and checkpointed.fits is False:
            _batch_search(search, {"gradient_checkpointing": True}, checkpointed.training_args, own_deepspeed, below=True)
        if not own.fits and not any(c.fits for c in search.planned.values() if c is not own):
            _propose_last_resorts(search, base, own_deepspeed)
        return _ranked(search, own)


def _propose_kernels_and_trainers(search: "_Search", own: FitCandidate, base: Dict[str, Any],
                                  own_deepspeed: Optional[Dict[str, Any]], flash_attention: bool, liger_kernel: bool,
                                  trainer_proposals: Sequence[Dict[str, Any]], trainer_searches: Any) -> None:
    """First, as they cost no step time and no change to what is learned, and save the most where
    they apply (flash attention: the probabilities of every layer, [B, H, L, L] each): the kernels,
    then the trainer's own proposals and searches (`search_fits`)."""
    if flash_attention and own.plan is not None and own.plan.settings.attn_implementation == "eager":
        search.plan(dict(FLASH_ATTENTION), dict(base), own_deepspeed, dict(FLASH_ATTENTION))
    if liger_kernel:
        search.plan(dict(LIGER_KERNEL), dict(base, **LIGER_KERNEL), own_deepspeed)
    for changes in trainer_proposals:
        search.plan(dict(changes), dict(base, **changes), own_deepspeed)
    for options in (trainer_searches(own) if trainer_searches is not None else ()):
        _largest_fitting(search, [(dict(changes), dict(base, **changes)) for changes in options], own_deepspeed)


def _checked_search(allow: Iterable[str], max_candidates: Any) -> Tuple[str, ...]:
    """`allow` as a tuple, each change known, and a whole `max_candidates` of at least 1.

    Raises:
        ValueError: naming the bad value and what is allowed.
    """
    allow = tuple(allow)
    unknown = [name for name in allow if name not in ALLOWED_CHANGES]
    if unknown:
        raise ValueError(f"allow={unknown[0]!r} is not one of: {', '.join(ALLOWED_CHANGES)}")
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
        raise ValueError(f"max_candidates={max_candidates!r}: expected a whole number of at least 1")
    return allow


def _propose_last_resorts(search: "_Search", base: Dict[str, Any], own_deepspeed: Optional[Dict[str, Any]]) -> None:
    """Nothing fits alone: checkpointing with the leanest of each kind, at batch 1 (Adafactor; with
    several processes ZeRO-3 with the optimizer on the CPU, on all of them as data parallelism)."""
    own_args, world_size = search.own_args, search.world_size
    samples = int(own_args.get("per_device_train_batch_size") or 1) * int(own_args.get("gradient_accumulation_steps") or 1)
    one = dict(per_device_train_batch_size=1, gradient_accumulation_steps=samples, gradient_checkpointing=True)
    if own_args.get("optim") != "adafactor":
        search.plan(dict(one, optim="adafactor"), dict(base, **one, optim="adafactor"), own_deepspeed)
    if world_size > 1:
        config = deepspeed_config_of(3, True, "bf16" if own_args.get("bf16") else "fp32")
        data = _data_parallel_args(base, world_size)
        if data is not None:
            one = dict(one, gradient_accumulation_steps=data["per_device_train_batch_size"]
                       * data["gradient_accumulation_steps"])
            search.plan(dict(one, deepspeed="DeepSpeed ZeRO-3 with the optimizer on the CPU"),
                        dict(data, deepspeed=config, **one), config)


def _propose_each_change(search: "_Search", base: Dict[str, Any], own_deepspeed: Optional[Dict[str, Any]],
                         optimizers: Sequence[str], world_size: int) -> Optional[FitCandidate]:
    """Gradient checkpointing at the user's batch, the leaner optimizers, and with several processes
    the engines that shard; the checkpointing proposal, or None where the user's own checkpoints."""
    checkpointed = None
    if not base.get("gradient_checkpointing"):
        checkpointed = search.plan({"gradient_checkpointing": True}, dict(base, gradient_checkpointing=True),
                                   own_deepspeed)
    for name in optimizers:
        if not same_state(base.get("optim"), name):
            search.plan({"optim": name}, dict(base, optim=name), own_deepspeed)
    if world_size == 1:
        return checkpointed
    precision = "bf16" if base.get("bf16") else ("fp16" if base.get("fp16") else "fp32")
    own_stage = ((own_deepspeed or {}).get("zero_optimization") or {}).get("stage", 0) if own_deepspeed else 0
    data = _data_parallel_args(base, world_size)
    if data is None:
        return checkpointed
    sizes = {key: data[key] for key in ("per_device_train_batch_size", "gradient_accumulation_steps")
             if data[key] != base.get(key)}
    for stage, offload in ((1, False), (2, False), (3, False), (3, True)):
        if own_deepspeed is not None and stage == own_stage and not offload:
            continue
        config = deepspeed_config_of(stage, offload, precision)
        name = f"DeepSpeed ZeRO-{stage}" + (" with the optimizer on the CPU" if offload else "")
        args = {key: value for key, value in data.items() if key not in ("fsdp", "fsdp_config")}
        search.plan(dict(_both_sizes(sizes, data), deepspeed=name), dict(args, deepspeed=config), config)
    if not base.get("fsdp") or "parallelism_config" in base:
        args = dict({k: v for k, v in data.items() if k != "deepspeed"}, fsdp="full_shard",
                    fsdp_config={"version": 2, "reshard_after_forward": True})
        search.plan(dict(_both_sizes(sizes, data), fsdp="full_shard"), args, None)
    return checkpointed


def _both_sizes(sizes: Dict[str, Any], args: Dict[str, Any]) -> Dict[str, Any]:
    """The batch and the accumulation both, where either changed (a proposal's words name both)."""
    if not sizes:
        return {}
    return {key: args[key] for key in ("per_device_train_batch_size", "gradient_accumulation_steps")}


def _data_parallel_args(base: Dict[str, Any], world_size: int) -> Optional[Dict[str, Any]]:
    """`base` on all `world_size` processes as data parallelism (its `parallelism_config` left out),
    the per-process batch and accumulation chosen to keep the effective batch: a tensor-parallel
    (or context-parallel) setting's processes share a batch, data parallelism's each take their own. None where the
    effective batch does not split over the processes."""
    _, dp = layout_sizes(base, world_size)
    args = {key: value for key, value in base.items() if key != "parallelism_config"}
    if dp == world_size:
        return args
    batch = int(base.get("per_device_train_batch_size") or 1)
    samples = batch * int(base.get("gradient_accumulation_steps") or 1) * dp
    if samples % world_size:
        return None
    per_process = samples // world_size
    batch = max(d for d in _divisors(per_process) if d <= batch)
    return dict(args, per_device_train_batch_size=batch, gradient_accumulation_steps=per_process // batch)


def _propose_layouts(search: "_Search", base: Dict[str, Any], sizes: Sequence[int], own: FitCandidate,
                     context_sizes: Sequence[int] = ()) -> None:
    """Tensor parallelism of each size in `sizes`, alone on the processes or with FSDP2 on the rest,
    and context parallelism of each of `context_sizes` with FSDP2 over the rest (as accelerate runs
    it), the accumulation multiplied by the size: the processes of a `tp` or `cp` group share each
    row (`tp` its layers' widths, `cp` its tokens), so the data-parallel groups are fewer and each
    takes more micro-batches of the user's batch to keep the effective batch. A tensor-parallel
    process computes `1/tp` of each micro-batch: its FLOPs are the own step's over `tp` (the
    counter, above DTensor's dispatch, sees the sharded layers at their whole shapes and misses the
    sharded attention's kernel); a context-parallel one's are its trace's (its tensors are its share)."""
    world = search.world_size
    own_tp, own_dp = layout_sizes(base, world)
    own_cp = world // (own_tp * own_dp)
    args = {key: value for key, value in base.items()
            if key not in ("deepspeed", "fsdp", "fsdp_config", "parallelism_config")}
    samples = int(base.get("gradient_accumulation_steps") or 1) * own_dp  # micro-batches per step, all groups
    layouts = [(tp, 1) for tp in sizes] + [(1, cp) for cp in context_sizes]
    # Both beside each other, as accelerate lays the mesh out (dp_shard, cp, tp), tp inside a node.
    layouts += [(tp, cp) for tp in sizes for cp in context_sizes if world % (tp * cp) == 0]
    for tp, cp in layouts:
        size = tp * cp
        if size <= 1 or world % size or samples % (world // size) or (tp, cp) == (own_tp, own_cp):
            continue
        layout = {"tp_size": tp, "dp_shard_size": world // size, "dp_replicate_size": 1, "cp_size": cp}
        text = ",".join([f"tp={tp}"] * (tp > 1) + [f"cp={cp}"] * (cp > 1) + [f"dp_shard={world // size}"] * (world > size))
        sizes_kept = dict(per_device_train_batch_size=int(base.get("per_device_train_batch_size") or 1),
                          gradient_accumulation_steps=samples // (world // size))
        # Beside cp, a tensor-parallel rank's tokens are its cp share: the own step's FLOPs over both.
        flops = (own.step_flops * own_tp // size if tp > 1 and own.step_flops is not None and own_cp == 1
                 else None)
        search.plan(dict(sizes_kept, parallelism=text), dict(args, parallelism_config=layout, **sizes_kept), None,
                    micro_batch_flops=flops)


def _propose_allowed(search: "_Search", base: Dict[str, Any], own_deepspeed: Optional[Dict[str, Any]],
                     allow: Sequence[str], seq_len: Optional[int]) -> None:
    """The changes that alter the training, where `allow` opens them."""
    if "seq-len" in allow and seq_len is not None and seq_len > 1:
        search.plan({"seq_len": seq_len // 2}, dict(base), own_deepspeed, {"seq_len": seq_len // 2})
    if "lora" in allow:
        search.plan({"lora_r": 16}, dict(base), own_deepspeed, {"lora_r": 16})
    if "qlora" in allow:
        search.plan({"lora_r": 16, "load_in_4bit": True}, dict(base), own_deepspeed, {"lora_r": 16, "load_in_4bit": True})


def _batch_search(search: "_Search", base_changes: Dict[str, Any], base: Dict[str, Any],
                  deepspeed: Optional[Dict[str, Any]], below: bool) -> Optional[FitCandidate]:
    """The largest batch (a divisor of the user's batch x accumulation) whose step fits, with the
    accumulation that keeps the effective batch; `below`: only batches under the user's."""
    batch = int(search.own_args.get("per_device_train_batch_size") or 1)
    samples = batch * int(search.own_args.get("gradient_accumulation_steps") or 1)
    divisors = [d for d in _divisors(samples) if (d < batch if below else d != batch)
                and search.takes(dict(base, per_device_train_batch_size=d, gradient_accumulation_steps=samples // d))]
    return _largest_that_fits(search, divisors, samples, base, base_changes, deepspeed)


def _ranked(search: _Search, own: FitCandidate) -> FitSearch:
    own_seconds = own.seconds

    def relative(candidate: FitCandidate) -> FitCandidate:
        ratio = None
        if candidate.seconds is not None and own_seconds:
            ratio = round(candidate.seconds / own_seconds, 4)
        return dataclasses.replace(candidate, relative_step_time=ratio)

    own = relative(own)
    proposals = [relative(c) for c in search.planned.values() if c.changes]
    # Fastest first among those that fit; a change that alters the training (`allow`) after all
    # that keep it.
    fitting = sorted((c for c in proposals if c.fits),
                     key=lambda c: (c.alters_training, c.relative_step_time or float("inf")))
    missed = sorted((c for c in proposals if not c.fits), key=lambda c: -(c.margin_bytes if c.margin_bytes is not None
                                                                         else -float("inf")))
    return FitSearch(fits_as_is=bool(own.fits), own=own, candidates=fitting + missed, usable_bytes=search.usable)


def largest_fitting_batch(planner: Callable[..., StepMemoryPlan], own_args: Dict[str, Any], usable_bytes: int,
                          world_size: int = 1, device_type: str = "cuda") -> Tuple[Optional[FitCandidate], FitCandidate]:
    """The largest per-device batch (a divisor of batch x accumulation) whose step fits, with the
    accumulation that keeps the effective batch; and the user's own setting, planned. The first is
    the own itself when no larger batch fits but it does, None when not even batch 1 fits."""
    search = _Search(planner, usable_bytes, world_size, device_type, 0, 2, budget=64, own_args=dict(own_args))
    own = search.plan({}, dict(own_args), None, own=True)
    samples = int(own_args.get("per_device_train_batch_size") or 1) * int(own_args.get("gradient_accumulation_steps") or 1)
    return _largest_that_fits(search, _divisors(samples), samples, dict(own_args), {}, None), own


def step_planner(build_model: Callable[[], torch.nn.Module], seq_len: Optional[int], *, device_type: str = "cuda",
                 world_size: int = 1, **plan_options: Any) -> Callable[..., StepMemoryPlan]:
    """A `planner` for `search_fits`: each `TrainingArguments` dict and DeepSpeed config resolved
    into settings (`resolve_settings`, `world_size` processes) and its step planned with
    `plan_step_memory(build_model, ...)` (`plan_options`: `attn_implementation`, `dtype`, ...).
    `extra` may change the sequence (`seq_len`), add LoRA adapters (`lora_r`, over a 4-bit base
    with `load_in_4bit`), pass an allocator option (`alloc_conf`) or an attention
    (`attn_implementation`)."""
    from trainer_memcb.plan.settings import resolve_settings

    def plan(training_args: Dict[str, Any], deepspeed: Optional[Dict[str, Any]], **extra: Any) -> StepMemoryPlan:
        options = dict(plan_options)
        rank = extra.get("lora_r")

        def build() -> torch.nn.Module:
            if not rank:
                return build_model()
            from trainer_memcb.plan.model.lora import add_lora_adapters

            return add_lora_adapters(build_model(), rank, None, None)

        if rank:
            options["keep_dtypes"] = True
        if extra.get("load_in_4bit"):
            from trainer_memcb.plan.model.quantized import Quantization

            options["quantization"] = Quantization()
        for name in ("alloc_conf", "attn_implementation"):
            if name in extra:
                options[name] = extra[name]
        meta = build()
        config = getattr(meta, "config", None)
        hidden = getattr(config, "hidden_size", None) if config is not None else None
        settings = resolve_settings(training_args, deepspeed=deepspeed, hidden_size=hidden, world_size=world_size)
        unused = [meta]

        def first_then_new() -> torch.nn.Module:
            return unused.pop() if unused else build()

        return plan_step_memory(first_then_new, seq_len=extra.get("seq_len", seq_len), settings=settings,
                                device_type=device_type, model_states=False, **options)[0]

    return plan


@dataclass(frozen=True)
class FitBatch:
    """`fit_batch_size`'s answer.

    Attributes:
        batch_size, gradient_accumulation_steps: the largest per-device batch whose step fits and
            the accumulation that keeps the effective batch (None, None when not even 1 fits).
        effective_batch: batch x accumulation x processes, the user's.
        peak_bytes: the planned step's peak at that batch; `usable_bytes`: the limit.
        own_peak_bytes: the peak of the user's own setting.
    """

    batch_size: Optional[int]
    gradient_accumulation_steps: Optional[int]
    effective_batch: int
    peak_bytes: Optional[int]
    own_peak_bytes: Optional[int]
    usable_bytes: int


def fit_batch_size(model: Any, args: Any, *, seq_len: int, device_memory: int, reserve_bytes: int = 0,
                   device_type: str = "cuda", world_size: int = 1, **plan_options: Any) -> FitBatch:
    """The largest per-device batch whose training step fits, and the gradient accumulation that
    keeps the effective batch: a planned alternative to the Trainer's `auto_find_batch_size`,
    which runs out of memory, halves the batch and leaves the accumulation (so the effective batch)
    changed without a word. Nothing is allocated: each batch is one fake step.

    Args:
        model: the model (any device; a meta-device stand-in is traced, the model is untouched),
            or a function that builds it on the meta device.
        args: `TrainingArguments` (or a dict of them): the batch and accumulation whose product is
            kept, the optimizer, checkpointing, precision, the DeepSpeed or FSDP config.
        seq_len: the sequence length of the longest batch.
        device_memory: bytes per process.
        reserve_bytes: the part of `device_memory` the step cannot use.
        device_type: "cuda" or "cpu".
        world_size: processes.
        plan_options: passed to `plan_step_memory` (`attn_implementation`, ...).

    Raises:
        ValueError: a bad memory size or reserve, a bad sequence length.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from trainer_memcb import fit_batch_size
        >>> def build():
        ...     with torch.device("meta"):
        ...         return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                                             num_attention_heads=4, vocab_size=256))
        >>> args = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "optim": "adamw_torch"}
        >>> found = fit_batch_size(build, args, seq_len=64, device_memory=6 * 2**20, device_type="cpu")
        >>> found.batch_size * found.gradient_accumulation_steps
        16
    """
    from trainer_memcb.plan.model.stand_ins import meta_stand_in
    from trainer_memcb.plan.settings import resolve_settings

    for name, value in (("device_memory", device_memory), ("reserve_bytes", reserve_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: expected a whole number of bytes, at least 0")
    if reserve_bytes >= device_memory:
        raise ValueError(f"reserve_bytes={reserve_bytes} leaves nothing of device_memory={device_memory}")
    build = model if callable(model) and not isinstance(model, torch.nn.Module) else (lambda: meta_stand_in(model))
    if hasattr(args, "to_dict"):  # the optimizers' hyperparameters; a new TrainingArguments would reset accelerate's state
        plan_options.setdefault("args", args)
    settings = resolve_settings(args, world_size=world_size)
    own_args = training_args_of(settings, _args_dict(args))
    planner = step_planner(build, seq_len, device_type=device_type, world_size=world_size, **plan_options)
    best, own = largest_fitting_batch(planner, own_args, device_memory - reserve_bytes, world_size, device_type)
    return FitBatch(batch_size=best.training_args["per_device_train_batch_size"] if best else None,
                    gradient_accumulation_steps=best.training_args["gradient_accumulation_steps"] if best else None,
                    effective_batch=own.effective_batch, peak_bytes=best.peak_bytes if best else None,
                    own_peak_bytes=own.peak_bytes, usable_bytes=device_memory - reserve_bytes)


def _args_dict(args: Any) -> Dict[str, Any]:
    """The user's arguments as a dict of what the plan reads (the deepspeed and FSDP configs kept)."""
    if args is None:
        return {}
    if isinstance(args, dict):
        return dict(args)
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "optim", "gradient_checkpointing",
            "max_grad_norm", "bf16", "fp16", "deepspeed", "fsdp", "fsdp_config")
    return {key: getattr(args, key) for key in keys if getattr(args, key, None) is not None}
