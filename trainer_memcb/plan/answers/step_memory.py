"""Will one training step fit? Its activations, its peak and the peak's parts, the model states
during the step, and fits? against the device's memory, read from the traced step.

`plan_step_memory` resolves the settings once, traces one step of the model as the Trainer runs
it (`trainer_memcb.plan.step.trace`: what is traced and how it is counted), and reads the answer:
the step's peak is `max(peak of forward and backward + optimizer state, peak of the optimizer
step)`, the peak of every step after the first; what lives on the host (offload) is left out of
the device's peak. What a run holds through the whole step that the trace does not make (a frozen
reference model; the optimizer state its estimate rule gives, where the optimizer cannot be built
under fake tensors) enters the timeline as a storage of its own (`Timeline.with_resident`) before
anything is read, so the peak, its parts, the model states and the allocator replay are each read
from one timeline, and no figure is patched after it. On CUDA the step's allocations are replayed
over two steps through the caching allocator (`trainer_memcb.plan.answers.step_replay`): the
reserved peak, the fragmentation and the device total, and fits? from that replay on the device's
memory less the CUDA context and the reserve; on the CPU, fits? is the peak against the memory less
the reserve. `states_during_step` puts the step's own figures in the model-states table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainer_memcb.plan.answers.model_states import ModelStatesPlan, plan_model_states
from trainer_memcb.plan.answers.grpo_answer import with_vllm_share
from trainer_memcb.plan.answers.step_plan import (DeviceFigures, PackedBatch, PlannedSettings,
                                                  StepMemoryPlan, StepPeak, Verdict)
from trainer_memcb.plan.answers.trl_answers import planned_trl_step, trl_answer
from trainer_memcb.plan.answers.step_replay import ReplayOptions, StepReplay, step_replayer
from trainer_memcb.plan.device.alloc_conf import AllocConf, alloc_conf_from_environment, as_alloc_conf
from trainer_memcb.plan.model.step_inputs import step_inputs
from trainer_memcb.plan.model.trainer_model import checkpointing_kwargs
from trainer_memcb.plan.settings import StepSettings, resolve_settings
from trainer_memcb.plan.settings.attention import (HUB_FLASH_ATTN_2, fa3_refusal, hub_kernel_repo, is_flash_path,
                                                   is_planned_hub_flash)
from trainer_memcb.plan.settings.setup import setup_of
from trainer_memcb.plan.step.timeline import HOST, MODEL_STATES, PLAN_PARTS, PhasePeak, Timeline
from trainer_memcb.plan.step.trace import COMPILED_NOT_COUNTED, UntracedStep, trace_step

__all__ = ["StepMemoryPlan", "plan_step_memory", "states_during_step", "NOT_COUNTED", "COMPILED_STEP", "COMPILED_NOT_COUNTED", "check_attn_implementation"]

# What a real process holds beyond the storages the trace counts, by device type: the reason for a
# reserve (`plan_step_memory(reserve_bytes=...)`, the command's --reserve).
NOT_COUNTED = {
    "cuda": ("NCCL's communicators and buffers (several processes), outside the caching allocator",
             "the workspace of the engine cuDNN picks for its attention (its frontend's dQ_accum and "
             "softmax_sum, the flash and memory-efficient backwards' buffers and the padded logsumexp are counted)",
             "the kernels' own temporaries where they differ from the CPU's (cross-entropy's)"),
    "cpu": ("the CPU allocator's own bookkeeping and rounding",),
}

# torch_compile=True where the compiled step cannot be traced (its figures are the eager step's);
# where it is, `COMPILED_NOT_COUNTED` says what the compiled trace does not count.
COMPILED_STEP = ("torch_compile=True: the compiled step is not traced, so every figure is the eager step's: "
                 "AOTAutograd's partitioner chooses what the compiled forward saves for backward (recomputing "
                 "cheap tensors in the backward), and Inductor fuses temporaries and holds buffers of its own")


def _step_dtype(precision: str, model: nn.Module) -> Optional[torch.dtype]:
    if precision in ("bf16", "deepspeed-bf16"):
        return torch.bfloat16
    if precision in ("fp16", "deepspeed-fp16"):
        return torch.float16
    if precision in ("fp32", "autocast-bf16", "autocast-fp16"):
        return torch.float32
    return None


@dataclass(frozen=True)
class _StepFigures:
    """The step's figures, each read from its timeline: the device's peak and its parts, what lives
    on the host beside them, and the most each model state held."""

    peak_bytes: int
    peak_phase: str
    peak_parts: Dict[str, int]
    host_bytes: Dict[str, int]
    forward_backward_peak: int
    optimizer_peak: Optional[int]
    states_most: Dict[str, int]
    states_host: Dict[str, int]
    states_at_optimizer_step: Dict[str, int]
    # With accumulation: [micro-batch, its device peak with the optimizer state] per traced one.
    micro_batches: List[List[int]]
    # TRL's GRPO step: the generation phase's device peak with the optimizer state; None otherwise.
    generation_peak: Optional[int] = None


def _read_peak(timeline: Timeline) -> _StepFigures:
    """The step's peak, its phase and parts, and the most each model state held, from its timeline.

    The fake step is the first: its optimizer makes each parameter's state as it reaches it. In
    every later step the state is alive from the start, so it is added to forward and backward's
    peak, and at the optimizer phase's peak the state of the parameters after it (not made yet in
    the first step) is added too; the step's peak is the larger of the two phases', compared by
    the device's bytes. What lives on the host (offloaded, the timeline's `host_parts`) is left out
    of the device's figures and reported apart."""
    stepped = timeline.optimizer_step is not None
    fb = timeline.forward_backward
    optimizer = timeline.optimizer_step or PhasePeak("optimizer step", 0, ())
    state_keys = timeline.groups["optimizer_state"]
    # Optimizer state made before the step (DeepSpeed's, one estimated by rule) is in the timeline already.
    state_bytes = 0 if timeline.state_resident else timeline.bytes_of(state_keys)
    not_yet = 0 if timeline.state_resident else timeline.bytes_of(state_keys - set(optimizer.storages))
    host_parts, tags, sizes = timeline.host_parts, timeline.tags, timeline.sizes

    def host_bytes_of(keys: Tuple[int, ...], state_extra: int) -> int:
        found = sum(sizes[key] for key in set(keys) if tags.get(key) in host_parts)
        return found + (state_extra if "optimizer_state" in host_parts else 0)

    fb_peak = fb.bytes + state_bytes - host_bytes_of(fb.storages, state_bytes)
    optimizer_peak = optimizer.bytes + not_yet - host_bytes_of(optimizer.storages, not_yet) if stepped else None
    if optimizer_peak is None or fb_peak >= optimizer_peak:
        at, extra_state = fb, state_bytes
    else:
        at, extra_state = optimizer, not_yet
    generation = timeline.generation
    generation_peak = None
    if generation is not None:  # GRPO: the optimizer state of a later step is alive through its generation
        generation_peak = generation.bytes + state_bytes - host_bytes_of(generation.storages, state_bytes)
        if generation_peak > max(fb_peak, optimizer_peak or 0):
            at, extra_state = generation, state_bytes
    parts = {name: 0 for name in PLAN_PARTS}
    for key in at.storages:
        part = timeline.part_of(key, at.saved)
        parts[part] = parts.get(part, 0) + sizes[key]
    parts["optimizer_state"] += extra_state
    host = {part: parts.pop(part) for part in host_parts if parts.get(part)}
    # The device's peak is its parts' sum: an engine's host parts are tagged storages (ZeRO's) or
    # whole plan parts (FSDP2's offloaded parameters, gradients and optimizer state).
    peak = sum(parts.values())
    # The most each model state held at one moment (the engine's buffers for it included); the
    # optimizer state of a later step is alive from its start (`state_bytes`).
    most = timeline.most_by(timeline.states.get)
    optimizer_state = "optimizer_state" + (HOST if "optimizer_state" in host_parts else "")
    most[optimizer_state] = max(most.get(optimizer_state, 0), state_bytes)
    at_step: Dict[str, int] = {}
    if stepped:
        for key in optimizer.storages:
            state = timeline.states.get(key)
            if state is not None:
                at_step[state] = at_step.get(state, 0) + sizes[key]
        at_step[optimizer_state] = at_step.get(optimizer_state, 0) + not_yet
    micro_batches = [[number, one.bytes + state_bytes - host_bytes_of(one.storages, state_bytes)]
                     for number, one in timeline.micro_batch_peaks]
    return _StepFigures(
        peak, at.phase, parts, host, fb_peak, optimizer_peak,
        states_most={state: most.get(state, 0) for state in MODEL_STATES},
        states_host={state: most.get(state + HOST, 0) for state in MODEL_STATES},
        states_at_optimizer_step={state: at_step.get(state, 0) + at_step.get(state + HOST, 0)
                                  for state in MODEL_STATES} if at_step else {},
        micro_batches=micro_batches, generation_peak=generation_peak)


def _check_batch(settings: StepSettings) -> None:
    """A batch size, and one the trainer takes (`TrlStep.check_batch`: GRPO's whole groups, KTO's KL rows).

    Raises:
        ValueError: naming the batch and the rule.
    """
    if settings.batch_size is None:
        raise ValueError("batch_size=None: expected a whole number of at least 1")
    if settings.preference is not None:
        settings.preference.check_batch(settings.batch_size)


def plan_step_memory(
    build_model: Callable[[], nn.Module], settings: Optional[StepSettings] = None, *, args: Any = None,
    model_name: Optional[str] = None, model_states: bool = True, states_plan: Optional[ModelStatesPlan] = None,
    dtype: Optional[torch.dtype] = None, keep_dtypes: bool = False, quantization: Any = None, **flags: Any,
) -> Tuple[StepMemoryPlan, Optional[ModelStatesPlan]]:
    """Plan one training step's memory on one process.

    The settings are resolved once (`trainer_memcb.plan.settings.resolve_settings`): `settings`
    when given, else those `args` holds; the `flags` over them. The trace, the engines and the
    answers read nothing else of the setup.

    Args:
        build_model: makes the model on the meta device (`trainer_memcb.plan.optimizers.whatif.build_meta_model`
            plus LoRA adapters); called once per trace, its parameters are replaced by fake ones.
        settings: settings resolved already, the engine's options among them (DDP's buckets,
            FSDP2's resharding and offload, ZeRO's config).
        args: `TrainingArguments`: the optimizer's hyperparameters, and (without `settings`) the
            settings the Trainer reads from them (batch size, bf16/fp16, optim, gradient
            checkpointing, clipping, the DeepSpeed and FSDP configs).
        model_name: the name the plan gives the model (None: its class's).
        model_states: also plan the model states (the sharded setups need them).
        states_plan: a model-states plan made already for this model and setup (reused).
        dtype: the parameters' dtype; None takes the precision's (fp32, bf16; 16-bit for DeepSpeed's).
        keep_dtypes: trace each parameter in the dtype `build_model` made it (PEFT's float32 adapters
            over a 16-bit base, as `get_peft_model` keeps them) rather than casting all to `dtype`.
        quantization: a `trainer_memcb.plan.model.quantized.Quantization`: the base model's linear layers
            loaded in 4-bit or 8-bit by bitsandbytes (QLoRA), as `BitsAndBytesConfig` loads them.
        flags: `StepSettings` fields given explicitly (`batch_size`, `seq_len`, `optimizer`,
            `device_type`, `device_memory`, `reserve_bytes`, `alloc_conf`, `gpu`, ...), their
            source "flag". `device_memory` defaults to the GPU preset's `total_bytes`; the reserve is
            taken with the CUDA context from it before the allocator replay (see the module docstring).

    Returns the step plan, and the model-states plan (or None).

    Raises:
        ValueError: an unknown setting, or a bad batch size, sequence length, attention path,
            device type, reserve, `alloc_conf` or `gpu`.
    """
    meta = build_model()
    settings = _resolve(settings, args, meta, flags)
    settings = with_vllm_share(settings)  # colocated vLLM's share of the device, out of training's reach
    _check_batch(settings)
    setup = setup_of(settings)
    dpo_reference = settings.preference is not None and settings.preference.reference == "model"
    if (model_states or dpo_reference) and states_plan is None:
        # DPO's frozen reference enters the timeline as the model-states plan counts it.
        states_plan = plan_model_states(meta, settings.optimizer, setup, args=args, model_name=model_name,
                                        reference_model=dpo_reference)
    _check_model_inputs(meta, settings)
    step_dtype = dtype or _step_dtype(settings.precision, meta)
    planned = _planned_settings(meta, settings, args, model_name, step_dtype)
    device = _device_before_replay(settings)
    try:
        timeline = trace_step(meta, settings, args=args, step_dtype=step_dtype, keep_dtypes=keep_dtypes,
                              quantization=quantization)
    except UntracedStep as error:
        return StepMemoryPlan(planned, StepPeak(problem=f"the step cannot run under fake tensors ({error})"),
                              device), states_plan
    notes = list(timeline.notes)
    if timeline.optimizer_failure is not None:
        rule_plan = states_plan if states_plan is not None else \
            plan_model_states(build_model(), settings.optimizer, setup, args=args, model_name=model_name)
        estimated = _with_rule_estimated_state(timeline, settings.optimizer, rule_plan, notes)
        if estimated is None:
            step = StepPeak(activations_bytes=timeline.activations_bytes,
                            activations_peak_bytes=timeline.activations_peak_bytes, problem=notes.pop())
            return StepMemoryPlan(planned, step, device), states_plan
        timeline = estimated
    reference = states_plan.optimizers[0].reference_model_bytes if states_plan is not None else 0
    if dpo_reference and not reference:
        raise ValueError("TRL's DPO step with a reference model: the model-states plan given has none "
                         "(plan_model_states(..., reference_model=True))")
    if reference:
        # A frozen reference model (DPO-style training) is alive through the whole step. Its own
        # forward is traced in TRL's DPO step (`settings.preference`), not in the plain Trainer's.
        timeline = timeline.with_resident("reference_model", reference)
    return _answer(timeline, settings, planned, device, notes), states_plan


def _with_rule_estimated_state(timeline: Timeline, optimizer: str, rule_plan: ModelStatesPlan,
                               notes: List[str]) -> Optional[Timeline]:
    """The timeline of a step whose optimizer cannot be built under fake tensors, with its state as
    its estimate rule plans it, alive through every later step's forward and backward (the
    update's own temporaries are not known), and a note that says so; None, with the reason as the
    last note, where no rule estimates it."""
    estimated = rule_plan.optimizers[0].optimizer_state_bytes
    failure = f"{optimizer}: its constructor cannot run under fake tensors ({timeline.optimizer_failure})"
    if estimated is None:
        notes.append(f"{failure} and no rule estimates its state")
        return None
    notes.append(f"{failure}; its state ({estimated} bytes) is its estimate rule's, alive through forward and "
                 f"backward, and the optimizer step's own temporaries are not traced")
    return timeline.with_resident("optimizer_state", estimated, state="optimizer_state", group="optimizer_state")


def _answer(timeline: Timeline, settings: StepSettings, planned: PlannedSettings, device: DeviceFigures,
            notes: List[str]) -> StepMemoryPlan:
    """The step plan, every figure read from `timeline`: the peak and its parts, the model states,
    and fits? from the allocator replay on CUDA, from the peak on the CPU."""
    traced = _read_peak(timeline)
    if timeline.compiled:  # the compiled step traced: what it does not count, in place of the eager step's line
        device = dataclasses.replace(device, not_counted=[COMPILED_NOT_COUNTED if line == COMPILED_STEP else line
                                                          for line in device.not_counted])
    if settings.torch_compile and timeline.compiled:
        notes.append("torch_compile=True: traced compiled, what the forward saves for backward chosen by "
                     "AOTAutograd's min-cut partitioner (as Inductor's step chooses it), its graphs run as traced")
    elif settings.torch_compile:
        notes.append("torch_compile=True: traced as the eager step (the compiled step's saved tensors and Inductor's "
                     "buffers are not planned); the peak and fits? hold for torch_compile=False")
    if traced.host_bytes:
        notes.append("offloaded to the CPU, not in the device peak: "
                     + ", ".join(f"{k} {v} bytes" for k, v in traced.host_bytes.items()))
    preference = settings.preference
    if preference is not None:
        notes.extend(trl_answer(preference).notes(preference, settings))
    elif "reference_model" in traced.peak_parts:
        notes.append("a frozen reference model's parameters are in the peak; its forward's temporaries are not")
    verdict = Verdict()
    replay_options = None
    if settings.device_type == "cuda":
        conf = alloc_conf_from_environment() if settings.alloc_conf is None else as_alloc_conf(settings.alloc_conf)
        verdict, device, replay_options = _replayed(timeline, conf, settings, device)
        if device.out_of_memory_at is not None:
            notes.append(f"the allocator replay runs out of memory in {device.out_of_memory_at}")
    elif device.device_memory_bytes is not None:
        margin = device.device_memory_bytes - settings.reserve_bytes - traced.peak_bytes
        verdict = Verdict(fits=margin >= 0, margin_bytes=margin)
    planned = dataclasses.replace(
        planned, optimizer_implementation=timeline.optimizer_implementation, engine=timeline.engine,
        gradient_accumulation_steps=timeline.gradient_accumulation_steps)
    step = StepPeak(
        activations_bytes=timeline.activations_bytes, activations_peak_bytes=timeline.activations_peak_bytes,
        peak_bytes=traced.peak_bytes, peak_phase=traced.peak_phase, peak_parts=traced.peak_parts,
        host_bytes=traced.host_bytes, forward_backward_peak_bytes=traced.forward_backward_peak,
        optimizer_step_peak_bytes=traced.optimizer_peak,
        peak_micro_batch=timeline.peak_micro_batch if traced.peak_phase != "optimizer step" else None,
        micro_batch_peak_bytes=traced.micro_batches, model_states_most_bytes=traced.states_most,
        model_states_host_bytes=traced.states_host, model_states_at_optimizer_step_bytes=traced.states_at_optimizer_step,
        notes=notes, phases=_phases(traced, settings))
    return StepMemoryPlan(planned, step, device, verdict, timeline=timeline, replay_options=replay_options)


def _input_options(settings: StepSettings) -> Dict[str, Any]:
    options = dict(target_len=settings.target_len, image_size=settings.image_size, padding=settings.padding)
    return dict(options, packing=settings.packing) if settings.packing is not None else options


def _check_model_inputs(meta: nn.Module, settings: StepSettings) -> None:
    """Set the attention path asked for, after checking that transformers would take it for this
    model, and refuse the batch options the model has no use for, before anything is traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = getattr(meta, "config", None)
    if settings.tp_size > 1:  # the model's heads split whole, its plan in torch's styles
        from trainer_memcb.plan.model.tp_plan import model_tp_plan, torch_tp_plan
        from trainer_memcb.plan.settings.parallelism import check_tensor_parallel_model

        check_tensor_parallel_model(config, settings.tp_size, own_rules=bool(settings.tp_plan))
        torch_tp_plan(model_tp_plan(meta, settings.tp_plan))
    if settings.cp_size > 1:  # the Trainer's and accelerate's rules for the model
        from trainer_memcb.plan.settings.parallelism import check_context_parallel_model

        attention = settings.attn_implementation or getattr(config, "_attn_implementation", None)
        check_context_parallel_model(meta, attention, settings.cp_size)
    if settings.attn_implementation is not None and config is not None:
        check_attn_implementation(meta, settings.attn_implementation)
        flash = settings.attn_implementation.startswith("flash_attention") or is_flash_path(settings.attn_implementation)
        if flash and settings.device_type != "cuda":
            # transformers would look for a kernel on the hub; flash-attn's kernels are CUDA's alone.
            raise ValueError(f"--attn-implementation {settings.attn_implementation!r} runs on CUDA only "
                             f"(flash-attn's kernels), not on {settings.device_type}: give --device-type cuda, "
                             "or sdpa or eager")
        if settings.attn_implementation == "flash_attention_3":
            _check_flash_attention_3(settings)
        config._attn_implementation = settings.attn_implementation
    if settings.use_liger_kernel:
        _check_liger_kernel(meta, settings)
    with FakeTensorMode():
        step_inputs(meta, 1, settings.seq_len, **_input_options(settings))


def _check_flash_attention_3(settings: StepSettings) -> None:
    """Refuse flash_attention_3 on a GPU whose FA3 kernels are not planned (`fa3_refusal`: Ampere,
    Ada and Hopper are)."""
    compute_capability = settings.compute_capability
    refusal = fa3_refusal(compute_capability)
    if refusal is not None:
        gpu = f"--gpu {settings.gpu}" if settings.gpu is not None else "no --gpu: an sm80 GPU assumed"
        raise ValueError(f"--attn-implementation 'flash_attention_3' on compute capability "
                         f"{'.'.join(map(str, compute_capability))} ({gpu}): {refusal}; it is planned on Ampere, Ada "
                         "and Hopper (compute capability 8.x and 9.0): give the --gpu of one (a100-80gb, a10g, l40s, "
                         "h100, ...), or flash_attention_2, sdpa or eager")


def _check_liger_kernel(meta: nn.Module, settings: StepSettings) -> None:
    """Refuse `use_liger_kernel` where liger-kernel's Triton kernels would not run (off CUDA) or its
    patching is not planned (a model type other than `LIGER_MODEL_TYPES`)."""
    from trainer_memcb.plan.settings.step_settings import LIGER_MODEL_TYPES

    if settings.device_type != "cuda":
        raise ValueError(f"use_liger_kernel runs on CUDA only (liger-kernel's Triton kernels), not on "
                         f"{settings.device_type}: give --device-type cuda, or leave liger's kernels out")
    inner = meta.get_base_model() if hasattr(meta, "peft_config") and hasattr(meta, "get_base_model") else meta
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type not in LIGER_MODEL_TYPES or not hasattr(inner, "lm_head"):
        raise ValueError(f"use_liger_kernel with {type(inner).__name__} (model type {model_type!r}) is not planned: "
                         f"liger-kernel's kernels are planned for the causal LMs of "
                         f"{', '.join(LIGER_MODEL_TYPES)}")


def _planned_settings(meta: nn.Module, settings: StepSettings, args: Any, model_name: Optional[str],
                      step_dtype: Optional[torch.dtype]) -> PlannedSettings:
    """What the plan plans, known before the trace: the setup as the settings resolved it."""
    config = getattr(meta, "config", None)
    return PlannedSettings(
        model=model_name or type(meta).__name__, batch_size=settings.batch_size, seq_len=settings.seq_len,
        attn_implementation=getattr(config, "_attn_implementation", None) if config is not None else None,
        device_type=settings.device_type, traced_on="cpu", gradient_checkpointing=settings.gradient_checkpointing,
        checkpointing_kwargs=(checkpointing_kwargs(args, settings.checkpointing_kwargs)
                              if settings.gradient_checkpointing else {}),
        precision=settings.precision,
        param_dtype=str(step_dtype).replace("torch.", "") if step_dtype is not None else None,
        optimizer=settings.optimizer, used=[list(row) for row in settings.used()], packing=_packed_batch(settings),
        preference=planned_trl_step(settings.preference, settings) if settings.preference is not None else None)


def _phases(traced: Any, settings: StepSettings) -> List[Dict[str, Any]]:
    """Each phase's device peak of TRL's GRPO and RLOO steps (generation, then training) and DPO's
    and KTO's (training alone); none for the other steps."""
    training = {"phase": "training", "peak_bytes": max(traced.forward_backward_peak, traced.optimizer_peak or 0)}
    if traced.generation_peak is not None:
        return [{"phase": "generation", "peak_bytes": traced.generation_peak}, training]
    return [training] if settings.preference is not None else []


def _packed_batch(settings: StepSettings) -> Optional[PackedBatch]:
    """The packed row and its padded equivalent, for `--packing`; None for a batch of rows."""
    from trainer_memcb.plan.model.step_inputs import packed_lengths

    if settings.packing is None or settings.seq_len is None:
        return None
    rows = settings.packing // settings.seq_len
    return PackedBatch(tokens=settings.packing, sequences=len(packed_lengths(settings.seq_len, settings.packing)),
                       padded_batch_size=rows, padded_tokens=rows * settings.seq_len)


def _device_before_replay(settings: StepSettings) -> DeviceFigures:
    """The device as the settings give it: its memory (the GPU preset's where none is given), the
    reserve, and what a process on it holds that the plan does not count."""
    device_memory = settings.device_memory_bytes
    return DeviceFigures(device_memory_bytes=device_memory,
                         reserve_bytes=settings.reserve_bytes if device_memory is not None else None,
                         not_counted=list(NOT_COUNTED[settings.device_type])
                         + ([COMPILED_STEP] if settings.torch_compile else []))


def _replayed(timeline: Timeline, conf: AllocConf, settings: StepSettings,
              device: DeviceFigures) -> Tuple[Verdict, DeviceFigures, ReplayOptions]:
    """fits? with its margin, the device with the allocator's figures, and the arguments of the
    replay those figures come from (`ReplayOptions`), from the step's
    allocations replayed over two steps (`step_replayer`): first with no limit; when its reserved
    peak exceeds what the allocator may take (the device's memory less the CUDA context and the
    reserve), again with that limit, where the allocator frees its cache and retries before it
    fails, as torch does."""
    preset, context, capability = settings.gpu_preset, settings.cuda_context_bytes, settings.compute_capability
    replay_under = step_replayer(timeline, compute_capability=capability,
                                 empty_cache_steps=settings.torch_empty_cache_steps)
    device_memory = device.device_memory_bytes
    fraction = conf.per_process_memory_fraction < 1.0
    if fraction and device_memory is None:
        raise ValueError(f"alloc_conf {conf.text!r}: per_process_memory_fraction is a fraction of the device's "
                         "memory: give device_memory or gpu too")
    limit = None if device_memory is None else max(0, device_memory - context - settings.reserve_bytes)
    # A memory fraction caps the allocator below the device: replayed with the limit from the start.
    replayed_under = limit if fraction else None
    replay: StepReplay = replay_under(conf, replayed_under)
    verdict = Verdict()
    out_of_memory = None
    if limit is not None and fraction:
        verdict = Verdict(replay.oom is None, limit - replay.reserved_peak_bytes)
        out_of_memory = replay.oom
    elif limit is not None:
        if replay.reserved_peak_bytes <= limit:
            verdict = Verdict(True, limit - replay.reserved_peak_bytes)
        else:
            limited = replay_under(conf, limit)
            if limited.oom is None:
                replay, replayed_under = limited, limit
                verdict = Verdict(True, limit - limited.reserved_peak_bytes)
            else:
                verdict, out_of_memory = Verdict(False, limit - replay.reserved_peak_bytes), limited.oom
    used = ReplayOptions(conf, replayed_under, capability, settings.torch_empty_cache_steps)
    return verdict, dataclasses.replace(
        device, reserved_peak_bytes=replay.reserved_peak_bytes,
        allocator_allocated_peak_bytes=replay.allocated_peak_bytes, fragmentation_bytes=replay.fragmentation_bytes,
        cuda_workspace_bytes=replay.cuda_workspace_bytes, cuda_context_bytes=context,
        device_total_bytes=replay.reserved_peak_bytes + context, gpu=preset.name if preset is not None else None,
        alloc_conf=conf.text, out_of_memory_at=out_of_memory), used


def states_during_step(states: ModelStatesPlan, step: StepMemoryPlan) -> ModelStatesPlan:
    """The model-states plan with the step's own figures in the row of its optimizer: each state
    the most it held at one moment of the step as the engine ran it (`model_states_most_bytes`
    and `model_states_host_bytes`: DDP's gradients with their buckets, ZeRO-1's whole gradients
    before the reduction, FSDP2's shards with the gathered parameters), what it held at the
    optimizer step beside it, and the sums, fits? and margin from them; so the table and the
    step's peak come from one trace. `states` itself when the step has no figures (a step that
    could not be traced) or `states` has no row for its optimizer alone.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from trainer_memcb.plan.settings import resolve_settings
        >>> def build():
        ...     with torch.device("meta"):
        ...         return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                                             num_attention_heads=4, vocab_size=256))
        >>> settings = resolve_settings(world_size=2, sharding="ddp", batch_size=1, optimizer="adamw_torch")
        >>> step, states = plan_step_memory(build, seq_len=8, settings=settings, device_type="cpu")
        >>> row = states_during_step(states, step).optimizers[0]
        >>> row.grads_bytes == 2 * states.optimizers[0].grads_bytes  # the gradients and DDP's buckets
        True
    """
    if step.step.problem is not None or not step.step.model_states_most_bytes or len(states.optimizers) != 1:
        return states
    [row] = states.optimizers
    if row.model_states_bytes is None:
        return states
    device, host = step.step.model_states_most_bytes, step.step.model_states_host_bytes
    figure = {state: device.get(state, 0) + host.get(state, 0) for state in MODEL_STATES}
    reference = row.reference_model_bytes
    # A frozen reference model lives where the parameters do (offloaded with them).
    cpu = sum(host.values()) + (reference if states.setup.offload_params else 0)
    total = sum(figure.values()) + reference
    memory = states.device_memory_bytes
    margin = None if memory is None else memory - (total - cpu)
    row = dataclasses.replace(
        row, params_bytes=figure["parameters"], grads_bytes=figure["gradients"],
        optimizer_state_bytes=figure["optimizer_state"], master_weights_bytes=figure["master_weights"],
        model_states_bytes=total, device_bytes=total - cpu, cpu_bytes=cpu,
        cpu_bytes_per_node=cpu * states.setup.processes_per_node, transient_bytes={},
        fits=None if margin is None else margin >= 0, margin_bytes=margin, engine=step.settings.engine,
        at_optimizer_step_bytes=dict(step.step.model_states_at_optimizer_step_bytes))
    return dataclasses.replace(states, optimizers=[row])


def _resolve(settings: Optional[StepSettings], args: Any, meta: nn.Module, flags: Dict[str, Any]) -> StepSettings:
    """The settings: those given (or resolved from `args`, with the model's hidden size for
    DeepSpeed's "auto" buckets), the explicit flags over them; the precision as the setup names it."""
    flags = {key: value for key, value in flags.items() if value is not None}
    if settings is None:
        config = getattr(meta, "config", None)
        text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
        training_args = args if (args is not None and hasattr(args, "to_dict")) else None
        settings = resolve_settings(training_args, hidden_size=getattr(text, "hidden_size", None), **flags)
    elif flags:
        known = {item.name for item in dataclasses.fields(StepSettings)} - {"sources", "zero"}
        unknown = sorted(set(flags) - known)
        if unknown:
            raise ValueError(f"unknown settings {unknown}: expected some of {sorted(known)}")
        sources = dict(settings.sources)
        sources.update({key: "flag" for key in flags})
        if flags.get("sharding") == "fsdp-shard-grad-op":
            flags["reshard_after_forward"] = False
        elif flags.get("sharding") == "fsdp-full-shard":
            flags["reshard_after_forward"] = True
        settings = dataclasses.replace(settings, sources=sources, **flags)
    precision = setup_of(settings).precision
    return settings if precision == settings.precision else dataclasses.replace(settings, precision=precision)


def check_attn_implementation(model: nn.Module, name: str) -> None:
    """Refuse an attention implementation transformers would refuse for `model`
    (`PreTrainedModel.get_correct_attn_implementation`: "eager" or a key of `ALL_ATTENTION_FUNCTIONS`,
    and "sdpa" / "flex_attention" only where the class supports them).

    Raises:
        ValueError: naming the implementation and the ones allowed.
    """
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # an older transformers without the registry: the trace will say
        return
    inner = model.base_model.model if hasattr(model, "peft_config") and hasattr(model, "base_model") else model
    if hub_kernel_repo(name) is not None:
        _check_hub_kernel(inner, name)
        return
    allowed = ["eager"] + list(ALL_ATTENTION_FUNCTIONS.valid_keys())
    unsupported = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}
    allowed = [key for key in allowed if getattr(inner, unsupported.get(key, ""), True) is not False]
    if name not in allowed:
        why = "is not one of transformers' attention implementations" if name not in unsupported else \
            f"is not supported by {type(inner).__name__}"
        raise ValueError(f"--attn-implementation {name!r} {why}: give one of {', '.join(allowed)}")


def _check_hub_kernel(inner: nn.Module, name: str) -> None:
    """A hub kernel (transformers' "org/repo[@revision]"): planned where it is flash-attn 2's
    (`HUB_FLASH_ATTN_2`) and the class lets flash attention run (`_supports_flash_attn`, as
    transformers' `_check_and_adjust_attn_implementation` asks of a hub flash kernel)."""
    if not is_planned_hub_flash(name):
        raise ValueError(f"--attn-implementation {name!r}: the hub kernel {hub_kernel_repo(name)} is not planned; "
                         f"the hub kernels planned are {', '.join(HUB_FLASH_ATTN_2)} (flash-attn 2's kernels)")
    supports = getattr(inner, "_supports_flash_attn", None)
    if supports is None:  # transformers before 4.54
        supports = getattr(inner, "_supports_flash_attn_2", False)
    if not supports:
        raise ValueError(f"--attn-implementation {name!r}: {type(inner).__name__} does not support flash attention, "
                         "so it cannot use a hub flash kernel: give sdpa or eager")
