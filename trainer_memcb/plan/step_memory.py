"""Will one training step fit? Its activations and its peak, from a step run under fake tensors.

`plan_step_memory` runs one training step of the model as the Trainer runs it: the model prepared
as the Trainer prepares it (`trainer_memcb.plan.trainer_model`: `use_cache=False`, checkpointing,
`model.train()`), the forward with the batch a collator makes for its head
(`trainer_memcb.plan.step_inputs`) and, for models that take loss keyword arguments, `num_items_in_batch`
as the Trainer passes it (the loss computed by the model, in fp32 where the model upcasts its
logits), `loss.backward()`, gradient clipping (`max_grad_norm=1.0`, the Trainer's default), the
optimizer the Trainer builds for `optim`, and `zero_grad(set_to_none=True)`, all under
`torch._subclasses.fake_tensor.FakeTensorMode`: every tensor has a shape, a dtype and a device but
no memory, so nothing is allocated and a 7B model steps in seconds on a laptop's CPU.

Two things are counted while it runs:

- the activations, with `SavedTensorsCounter` exactly as a real run counts them (the storages
  autograd saved for backward during the forward, each once, the parameters excluded, alive at the
  end of forward), and their peak (with checkpointing: during the recomputation in backward);
- every storage alive at each moment (`LiveStorages`), whose peak is the step's peak, with what was
  alive then: parameters, gradients, optimizer state, activations (saved for backward), the batch
  and buffers, and everything else (temporaries: the fp32 logits of the loss, an attention's scores
  before they are saved, the optimizer's foreach intermediates).

The optimizer state of a step after the first is alive through the whole step, while the fake step
creates it in its optimizer step; the plan's peak is therefore
`max(peak of forward and backward + optimizer state, peak of the optimizer step)`, which is the
peak of every step after the first. Each storage counts with its full size and is freed when its
last tensor is gone: that is the memory a caching-free allocator holds (on CPU, what the profiler
records, see the tests); a CUDA caching allocator rounds each block up to 512 bytes and may hold
freed blocks (fragmentation), which is not counted.

Device. The trace runs on fake CPU tensors: on a CPU-only build of torch, autograd aborts the
process on fake CUDA tensors. On CPU, `scaled_dot_product_attention` runs the flash kernel for CPU,
which saves the output and an fp32 logsumexp, as CUDA's flash and memory-efficient kernels do; the
eager path saves the same tensors on any device.

Engines. The step runs under the engine the settings name (`trainer_memcb.plan.engines`): one
process, DDP's buckets, FSDP2's real `fully_shard` on a fake process group, DeepSpeed ZeRO's
buffers modelled from its source. Each wraps the model and runs the backward and the optimizer
step its way inside the same timeline, so the peak is always the largest sum at one moment of what
one process holds. The settings (`trainer_memcb.plan.settings`) are resolved once from the
`TrainingArguments`, the engine's config and the explicit arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainer_memcb.plan.engines import StepEngine, engine_for
from trainer_memcb.plan.engines.base import MODEL_STATES
from trainer_memcb.plan.fake_kernels import grouped_mm_any_dtype
from trainer_memcb.plan.settings import StepSettings, resolve_settings
from trainer_memcb.plan.live_storages import LiveStorages
from trainer_memcb.plan.step_inputs import step_inputs
from trainer_memcb.plan.trainer_model import prepare_like_trainer
from trainer_memcb.plan.value_reads import passed_checks, unpadded_batch
from trainer_memcb.plan.model_states import PRECISIONS, ModelStatesPlan, Setup, plan_model_states
from trainer_memcb.state.saved_tensors import SavedTensorsCounter, storages_of

__all__ = ["StepMemoryPlan", "plan_step_memory", "states_during_step", "max_batch_size", "NOT_COUNTED", "fake_copy", "enable_checkpointing", "ATTENTION_PATHS", "DEVICE_TYPES", "MAX_GRAD_NORM"]

ATTENTION_PATHS = ("eager", "sdpa")
DEVICE_TYPES = ("cuda", "cpu")
# transformers' TrainingArguments.max_grad_norm default: the Trainer clips before each step.
MAX_GRAD_NORM = 1.0
_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "batch_and_buffers", "other")
# What a real process holds beyond the storages the trace counts, by device type: the reason for a
# reserve (`plan_step_memory(reserve_bytes=...)`, the command's --reserve).
NOT_COUNTED = {
    "cuda": ("the CUDA context (hundreds of MiB per process)", "cuBLAS and NCCL workspaces",
             "the caching allocator's rounding of each block up to 512 bytes, and the freed blocks it keeps "
             "cached (fragmentation)"),
    "cpu": ("the CPU allocator's own bookkeeping and rounding",),
}


@dataclass(frozen=True)
class StepMemoryPlan:
    """One training step's memory on one process.

    Attributes:
        batch_size, seq_len: the micro-batch.
        attn_implementation: the attention path traced (`config._attn_implementation`).
        device_type: the device type asked for; `traced_on`: the fake tensors' device.
        gradient_checkpointing: non-reentrant activation checkpointing on the model's layers.
        precision: the setup's precision; `param_dtype`: the traced parameters' dtype.
        activations_bytes: saved for backward, alive at the end of forward (as `activations_bytes`).
        activations_peak_bytes: the most saved bytes alive during forward and backward.
        peak_bytes: the step's peak; `peak_phase`: forward, backward or optimizer step;
            `peak_parts`: what was alive then, by part (they sum to `peak_bytes`).
        model_states_plan: the model-states plan of the same setup (per-process states).
        model_states_most_bytes: per model state (parameters, gradients, optimizer_state,
            master_weights), the most this process's device held at one moment of the step, the
            engine's buffers for it included (DDP's buckets and ZeRO's reduce buckets as
            gradients, FSDP2's all-gather buffers and gathered parameters as parameters);
            `model_states_host_bytes`: the same, of what lives on the host (offload);
            `model_states_at_optimizer_step_bytes`: what each held at the optimizer phase's peak,
            device and host together ({} without an optimizer step). The model-states table of a
            step plan shows these (`states_during_step`).
        device_memory_bytes, reserve_bytes: the device's memory and the part of it left out for
            what the plan does not count (`reserve_bytes`, see `not_counted`).
        fits, margin_bytes: against `device_memory_bytes - reserve_bytes`, from the peak.
        not_counted: what a real process on `device_type` holds that the plan does not count.
        problem: why no step could be traced (then only the model states are known), or None.
    """

    model: str
    batch_size: int
    seq_len: int
    attn_implementation: Optional[str]
    device_type: str
    traced_on: str
    gradient_checkpointing: bool
    precision: str
    optimizer: str
    param_dtype: Optional[str]
    activations_bytes: Optional[int]
    activations_peak_bytes: Optional[int]
    peak_bytes: Optional[int]
    peak_phase: Optional[str]
    peak_parts: Dict[str, int] = field(default_factory=dict)
    forward_backward_peak_bytes: Optional[int] = None
    optimizer_step_peak_bytes: Optional[int] = None
    model_states_most_bytes: Dict[str, int] = field(default_factory=dict)
    model_states_host_bytes: Dict[str, int] = field(default_factory=dict)
    model_states_at_optimizer_step_bytes: Dict[str, int] = field(default_factory=dict)
    device_memory_bytes: Optional[int] = None
    fits: Optional[bool] = None
    margin_bytes: Optional[int] = None
    problem: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    reserve_bytes: Optional[int] = None
    not_counted: List[str] = field(default_factory=list)
    engine: str = "none"
    optimizer_implementation: Optional[str] = None
    host_bytes: Dict[str, int] = field(default_factory=dict)
    settings_used: List[List[Any]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def fake_copy(model: nn.Module, mode: Any, device: str = "cpu", dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Give `model` (on the meta device) fake parameters and buffers, in place: same shapes,
    `requires_grad` and ties, on `device`, floating ones in `dtype` when given."""
    made: Dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                new = made.get(id(param))
                if new is None:
                    target = dtype if (dtype is not None and param.is_floating_point()) else param.dtype
                    new = nn.Parameter(torch.empty(param.shape, dtype=target, device=device), requires_grad=param.requires_grad)
                    made[id(param)] = new
                module._parameters[name] = new
            for name, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                new = made.get(id(buffer))
                if new is None:
                    new = made[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
                module._buffers[name] = new
    return model


def _freeze_older_objects() -> bool:
    """Move every object alive now out of the collector's sight for the trace (`gc.freeze`):
    a fake step makes cyclic garbage all along, and each full collection would otherwise walk the
    whole heap (torch's and transformers' modules, the meta model), 0.8 s of a 70B step's 11 s.
    Objects made during the trace are collected as before. False, and nothing done, when the
    program has frozen objects itself (its freeze is left as it is)."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def _step_dtype(precision: str, model: nn.Module) -> Optional[torch.dtype]:
    if precision in ("bf16", "deepspeed-bf16"):
        return torch.bfloat16
    if precision in ("fp16", "deepspeed-fp16"):
        return torch.float16
    if precision in ("fp32", "autocast-bf16", "autocast-fp16"):
        return torch.float32
    return None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


@dataclass
class _Traced:
    activations_bytes: int
    activations_peak_bytes: int
    peak_bytes: int
    peak_phase: str
    peak_parts: Dict[str, int]
    state_bytes: int
    notes: List[str]
    forward_backward_peak: int
    optimizer_peak: Optional[int]
    optimizer_failure: Optional[str] = None
    states_most: Dict[str, int] = field(default_factory=dict)
    states_at_optimizer_step: Dict[str, int] = field(default_factory=dict)
    # Of forward_backward_peak and optimizer_peak: the bytes of the engine's host parts (offload).
    forward_backward_host: int = 0
    optimizer_host: int = 0


def _trace_step(model: nn.Module, batch_size: int, seq_len: Optional[int], precision: str,
                build_optimizer: Optional[Callable[[nn.Module], Any]], gradient_checkpointing: bool,
                engine: Optional[StepEngine] = None, input_options: Optional[Dict[str, Any]] = None) -> _Traced:
    """Run the step under fake tensors (the model already fake), counting as the module says;
    `engine` wraps the model and runs the backward and the optimizer step its way."""
    mode = _MODE[0]
    engine = engine or StepEngine()
    notes: List[str] = []
    model.train()
    engine.optimizer_builder = build_optimizer
    model = engine.wrap(model, mode)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    tracker = LiveStorages(keep_timeline=True)
    with mode:
        inputs = step_inputs(model, batch_size, seq_len, **(input_options or {}))
    labels = inputs.labels
    batch_tensors = inputs.tensors()
    for tensor in params + list(model.buffers()) + batch_tensors:
        tracker.add(tensor)
    for part, tensors in engine.resident().items():
        for tensor in tensors:
            tracker.add(tensor)
        tracker.tag(tensors, part)
    counter = SavedTensorsCounter(exclude=params, watch_recomputation=gradient_checkpointing)
    tracker.watch = counter._book.live
    engine.attach(tracker, counter)
    autocast = None
    if precision.startswith("autocast-"):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16 if precision.endswith("bf16") else torch.float16)
    grads: List[int] = []
    state_keys: List[int] = []
    optimizer_peak = 0
    optimizer_keys: List[int] = []
    optimizer_watch: List[int] = []
    optimizer_failure: Optional[str] = None
    try:
        with mode, tracker:
            tracker.phase = "forward"
            kwargs: Dict[str, Any] = dict(inputs.forward)
            if labels is not None:
                if _accepts_loss_kwargs(model):
                    kwargs["num_items_in_batch"] = _num_items_in_batch(labels)
            with counter:
                if autocast is not None:
                    with autocast:
                        outputs = model(**kwargs)
                else:
                    outputs = model(**kwargs)
            loss = outputs["loss"] if outputs.get("loss") is not None else outputs[0].float().sum()
            del outputs
            activations = counter.saved_bytes
            tracker.phase = "backward"
            engine.backward(loss)
            del loss
            grads = tracker.serials(engine.gradients(trainable))
            forward_backward = (tracker.peak_bytes, tracker.peak_label, tracker.peak_keys, tracker.peak_watch)
            if build_optimizer is not None:
                tracker.phase = "optimizer step"
                tracker.peak_bytes = 0  # the optimizer phase's own peak, from here
                try:
                    optimizer = engine.step(build_optimizer, model, trainable)
                except Exception as error:  # a constructor that reads values (bitsandbytes' 8-bit)
                    optimizer_failure = _one_line(error)
                    build_optimizer = None
                    for p in trainable:
                        p.grad = None
                else:
                    state_keys = tracker.serials(engine.state_tensors(optimizer))
                    optimizer_peak, optimizer_keys, optimizer_watch = tracker.peak_bytes, tracker.peak_keys, tracker.peak_watch
                    engine.zero_grad(optimizer)
                    del optimizer
    finally:
        counter.close()
        engine.close()
    notes.extend(engine.notes)
    sizes = tracker.sizes
    # Optimizer state an engine makes before the step (DeepSpeed's) is in the timeline already.
    state_bytes = 0 if engine.state_resident else sum(sizes[key] for key in set(state_keys))
    fb_bytes, fb_phase, fb_keys, fb_watch = forward_backward
    # The fake step is the first: the optimizer makes each parameter's state as it reaches it, so at
    # the optimizer phase's peak the state of the parameters after it is not alive yet; in every
    # later step it is. Add it.
    unique_state = set(state_keys)
    not_yet = 0 if engine.state_resident else sum(sizes[key] for key in unique_state - set(optimizer_keys))
    if build_optimizer is not None:
        optimizer_peak += not_yet
    # What of each phase's peak lives on the host (offload), so that the phases are compared by the
    # device's bytes. Each phase's own moment is still its most bytes alive, host included.
    host_parts = set(getattr(engine, "host_parts", ()))
    tags = tracker.tags

    def host_bytes_of(keys: List[int], state_extra: int) -> int:
        found = sum(sizes[key] for key in set(keys) if tags.get(key) in host_parts)
        return found + (state_extra if "optimizer_state" in host_parts else 0)

    fb_host = host_bytes_of(fb_keys, state_bytes)
    optimizer_host = host_bytes_of(optimizer_keys, not_yet) if build_optimizer is not None else 0
    if fb_bytes + state_bytes - fb_host >= optimizer_peak - optimizer_host:
        peak, phase, keys, watch, extra_state = fb_bytes + state_bytes, fb_phase, fb_keys, fb_watch, state_bytes
    else:
        peak, phase, keys, watch, extra_state = optimizer_peak, "optimizer step", optimizer_keys, optimizer_watch, not_yet
    param_keys = set(tracker.serials(params))
    other_fixed = set(tracker.serials(list(model.buffers()) + batch_tensors))
    groups = [("parameters", param_keys), ("gradients", set(grads)), ("optimizer_state", set(state_keys)),
              ("activations", set(watch)), ("batch_and_buffers", other_fixed)]
    tags = tracker.tags

    def part_of(key: int) -> str:
        tag = tags.get(key)
        if tag is not None:
            return tag
        for name, members in groups:
            if key in members:
                return name
        return "other"

    parts = {name: 0 for name in _PARTS}
    for key in keys:
        part = part_of(key)
        parts[part] = parts.get(part, 0) + sizes[key]
    parts["optimizer_state"] += extra_state
    most, at_step = _states_in_step(tracker, engine, part_of, state_bytes, optimizer_keys, not_yet,
                                    build_optimizer is not None)
    return _Traced(activations, counter.peak_bytes, peak, phase, parts, state_bytes, notes, fb_bytes + state_bytes,
                   optimizer_peak if build_optimizer is not None else None, optimizer_failure, most, at_step,
                   fb_host, optimizer_host)


# A state's bytes on the host (offloaded) are kept apart from the device's under this suffix.
_HOST = "@host"


def _states_in_step(tracker: LiveStorages, engine: StepEngine, part_of: Callable[[int], str], state_bytes: int,
                    optimizer_keys: List[int], not_yet: int, stepped: bool) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Per model state (`MODEL_STATES`, `_HOST` added for what lives on the host): the most it
    held at one moment of the step, the engine's buffers for it included (the timeline replayed,
    each storage in the state `engine.state_of` gives its part), and what it held at the
    optimizer phase's peak ({} without an optimizer step). The optimizer state of a step after
    the first is alive from its start (`state_bytes`, 0 where the engine made it before the step,
    as DeepSpeed does), and at the optimizer phase's peak the state not made yet (`not_yet`) is
    alive too, as the peak counts them."""
    host = set(getattr(engine, "host_parts", ()))

    def state_of(key: int) -> Optional[str]:
        part = part_of(key)
        state = engine.state_of(part, key)
        return None if state is None else state + (_HOST if part in host else "")

    most = tracker.most_by(state_of)
    optimizer = "optimizer_state" + (_HOST if "optimizer_state" in host else "")
    most[optimizer] = max(most.get(optimizer, 0), state_bytes)
    at_step: Dict[str, int] = {}
    if stepped:
        for key in optimizer_keys:
            state = state_of(key)
            if state is not None:
                at_step[state] = at_step.get(state, 0) + tracker.sizes[key]
        at_step[optimizer] = at_step.get(optimizer, 0) + not_yet
    return most, at_step


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether the Trainer passes `num_items_in_batch` to this model: its `model_accepts_loss_kwargs`
    (transformers' trainer.py: the unwrapped model's `accepts_loss_kwargs`, else a forward that
    takes `**kwargs`)."""
    import inspect

    unwrapped = model.base_model.model if hasattr(model, "peft_config") and hasattr(model, "base_model") else model
    declared = getattr(unwrapped, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    parameters = inspect.signature(unwrapped.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def _num_items_in_batch(labels: torch.Tensor) -> torch.Tensor:
    """The count of labelled tokens, as the Trainer passes it: transformers 5's
    `Trainer._get_num_items_in_batch` divides the int64 count by the tensor/context/sequence
    parallel sizes, a true division, so a 0-dim float32 tensor. The loss is then a sum divided by
    it, and the division saves it for backward (4 bytes); the value does not matter here."""
    return torch.tensor(float(labels.numel()))


# One FakeTensorMode per trace, set by `plan_step_memory`.
_MODE: List[Any] = [None]


def plan_step_memory(
    build_model: Callable[[], nn.Module],
    *,
    batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    setup: Optional[Setup] = None,
    optimizer: Optional[str] = None,
    args: Any = None,
    attn_implementation: Optional[str] = None,
    gradient_checkpointing: Optional[bool] = None,
    device_type: str = "cuda",
    device_memory: Optional[int] = None,
    model_name: Optional[str] = None,
    model_states: bool = True,
    states_plan: Optional[ModelStatesPlan] = None,
    dtype: Optional[torch.dtype] = None,
    reserve_bytes: int = 0,
    settings: Optional[StepSettings] = None,
    target_len: Optional[int] = None,
    image_size: Optional[int] = None,
    padding: int = 0,
    keep_dtypes: bool = False,
    quantization: Any = None,
) -> Tuple[StepMemoryPlan, Optional[ModelStatesPlan]]:
    """Plan one training step's memory on one process.

    Args:
        build_model: makes the model on the meta device (`trainer_memcb.plan.whatif.build_meta_model`
            plus LoRA adapters); called once per trace, its parameters are replaced by fake ones.
        batch_size, seq_len: the per-device micro-batch (None: `args.per_device_train_batch_size`).
        setup: world size, sharding, precision (as the model-states plan); given, it overrides
            `args` and `settings`.
        optimizer: the Trainer's `optim` name for the traced optimizer step (None: `args.optim`,
            else adamw_torch).
        args: `TrainingArguments`: the optimizer's hyperparameters, and the settings the Trainer
            reads from them (batch size, bf16/fp16, optim, gradient checkpointing, clipping, the
            DeepSpeed and FSDP configs) unless given here explicitly.
        attn_implementation: "eager", "sdpa" or another transformers attention; None keeps the
            config's.
        gradient_checkpointing: the Trainer's `gradient_checkpointing=True` (non-reentrant).
        device_type: "cuda" or "cpu": the device the run will use (see the module docstring).
        device_memory: bytes per process, for fits / margin.
        reserve_bytes: the part of `device_memory` the step cannot use (the CUDA context, the
            libraries' workspaces, the allocator's cache: `NOT_COUNTED`); fits? is answered
            against `device_memory - reserve_bytes`.
        model_states: also plan the model states (the sharded setups need them).
        states_plan: a model-states plan made already for this model and setup (reused).
        dtype: the parameters' dtype; None takes the precision's (fp32, bf16; 16-bit for DeepSpeed's).
        settings: settings resolved already (`trainer_memcb.plan.settings.resolve_settings`), the
            engine's options among them (DDP's buckets, FSDP2's resharding and offload, ZeRO's config);
            the explicit arguments above still override it.
        target_len, image_size, padding: the batch's other sizes (`trainer_memcb.plan.step_inputs`):
            a seq2seq model's labels length, an image model's height and width, padded positions.
        quantization: a `trainer_memcb.plan.quantized.Quantization`: the base model's linear layers
            loaded in 4-bit or 8-bit by bitsandbytes (QLoRA), as `BitsAndBytesConfig` loads them.
        keep_dtypes: trace each parameter in the dtype `build_model` made it (PEFT's float32 adapters
            over a 16-bit base, as `get_peft_model` keeps them) rather than casting all to `dtype`.

    Returns:
        The step plan, and the model-states plan (or None).

    Raises:
        ValueError: a bad batch size, sequence length, attention path, device type or reserve.
    """
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise ValueError(f"reserve_bytes={reserve_bytes!r}: expected a whole number of bytes, at least 0")
    meta = build_model()
    config = getattr(meta, "config", None)
    hidden = getattr(getattr(config, "get_text_config", lambda: config)(), "hidden_size", None) if config is not None else None
    settings = _resolve(settings, args, setup, batch_size=batch_size, optimizer=optimizer,
                        gradient_checkpointing=gradient_checkpointing, hidden_size=hidden)
    batch_size = settings.batch_size if settings.batch_size is not None else batch_size
    optimizer, gradient_checkpointing = settings.optimizer, settings.gradient_checkpointing
    setup = setup_of(settings, setup)
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("target_len", target_len),
                        ("image_size", image_size)):
        if value is None and name != "batch_size":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type={device_type!r} is not one of: {', '.join(DEVICE_TYPES)}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    if model_states and states_plan is None:
        states_plan = plan_model_states(meta, optimizer, setup, args=args, model_name=model_name)
    name = model_name or type(meta).__name__
    config = getattr(meta, "config", None)
    if attn_implementation is not None and config is not None:
        check_attn_implementation(meta, attn_implementation)
        config._attn_implementation = attn_implementation
    input_options = dict(target_len=target_len, image_size=image_size, padding=padding)
    with FakeTensorMode():  # the options the model has no use for are refused before anything runs
        step_inputs(meta, 1, seq_len, **input_options)
    attention = getattr(config, "_attn_implementation", None) if config is not None else None
    precision = setup.precision
    step_dtype = dtype or _step_dtype(precision, meta)
    common = dict(param_dtype=str(step_dtype).replace("torch.", "") if step_dtype is not None else None, model=name, batch_size=batch_size, seq_len=seq_len, attn_implementation=attention,
                  device_type=device_type, traced_on="cpu", gradient_checkpointing=gradient_checkpointing,
                  precision=precision, optimizer=optimizer, device_memory_bytes=device_memory,
                  reserve_bytes=reserve_bytes if device_memory is not None else None,
                  not_counted=list(NOT_COUNTED[device_type]))
    engine = engine_for(settings)
    mode = FakeTensorMode()
    _MODE[0] = mode
    quantization_note = None
    frozen = _freeze_older_objects()
    try:
        model = fake_copy(meta, mode, "cpu", None if keep_dtypes else step_dtype)
        if quantization is not None:
            from trainer_memcb.plan.quantized import quantize_linear_layers

            quantized = quantize_linear_layers(model, mode, quantization, device_type)
            if quantization.bits == 8:
                path = ("MatMul8bitFp, as bitsandbytes trains on the CPU" if device_type == "cpu" else
                        f"MatMul8bitLt with the outlier columns (llm_int8_threshold {quantization.threshold:g}) "
                        f"planned as none: their number is data, each adds 2 bytes per input row")
                quantization_note = (
                    f"{quantized} linear layers loaded in 8-bit (LLM.int8): their int8 codes (parameters) and fp32 "
                    f"row scales (buffers) as bitsandbytes stores them, their dequantized copies as temporaries, "
                    f"traced through {path}; the model-states plan counts them so, and unquantized without a step")
            else:
                quantization_note = (
                    f"{quantized} linear layers loaded in 4-bit ({quantization.quant_type}"
                    f"{', double quantization' if quantization.double_quant else ''}): their packed values (parameters) "
                    f"and quantization state (buffers) as bitsandbytes stores them, their dequantized copies as "
                    f"temporaries; the model-states plan counts them so, and unquantized without a step" + (
                    "; on the CPU, bitsandbytes' dequantization also makes int32 codes and an fp32 lookup of the "
                    "whole layer inside its kernel (backends/default/ops.py, _dequantize_4bit_compute), which the "
                    "trace cannot see: up to 8 bytes per value of the largest 4-bit layer, not counted"
                    if device_type == "cpu" else ""))
        prepare_like_trainer(model, args=args, gradient_checkpointing=gradient_checkpointing)
        build_optimizer, implementation = _optimizer_builder(optimizer, args, device_type)
        unpadded = unpadded_batch() if not padding else contextlib.nullcontext()
        with grouped_mm_any_dtype(), unpadded, passed_checks():
            traced = _trace_step(model, batch_size, seq_len, precision, build_optimizer, gradient_checkpointing, engine,
                                 input_options)
    except Exception as error:  # a forward fake tensors cannot run (data-dependent control flow, ...)
        engine.close()
        return StepMemoryPlan(activations_bytes=None, activations_peak_bytes=None, peak_bytes=None, peak_phase=None,
                              problem=f"the step cannot run under fake tensors ({_one_line(error)})", **common), states_plan
    finally:
        _MODE[0] = None
        gc.collect()  # the trace's own garbage: the objects frozen before it are not scanned
        if frozen:
            gc.unfreeze()
    notes = list(traced.notes) + ([quantization_note] if quantization_note else [])
    if gradient_checkpointing and device_type == "cpu":
        notes.append("with gradient checkpointing, torch.utils.checkpoint keeps the CPU generator's state "
                     "(torch.get_rng_state(), 5,056 bytes) from a block's forward to its recomputation, outside "
                     "autograd: the trace does not see it, not counted")
    implementation = implementation[0]
    if implementation:
        notes.append(f"optimizer traced with its {implementation} implementation, as torch runs it on {device_type}")
    peak, parts = traced.peak_bytes, dict(traced.peak_parts)
    most = {state: traced.states_most.get(state, 0) for state in MODEL_STATES}
    most_host = {state: traced.states_most.get(state + _HOST, 0) for state in MODEL_STATES}
    at_step = {state: traced.states_at_optimizer_step.get(state, 0) + traced.states_at_optimizer_step.get(state + _HOST, 0)
               for state in MODEL_STATES} if traced.states_at_optimizer_step else {}
    fb_peak, optimizer_peak = traced.forward_backward_peak, traced.optimizer_peak
    phase = traced.peak_phase
    if traced.optimizer_failure is not None:
        # Its state, as its estimate rule plans it, is alive through every later step's forward
        # and backward; the update's own temporaries are not known.
        rule_plan = states_plan if states_plan is not None else \
            plan_model_states(build_model(), optimizer, setup, args=args, model_name=model_name)
        estimated = rule_plan.optimizers[0].optimizer_state_bytes
        if estimated is None:
            return StepMemoryPlan(activations_bytes=traced.activations_bytes,
                                  activations_peak_bytes=traced.activations_peak_bytes, peak_bytes=None,
                                  peak_phase=None, problem=f"{optimizer}: its constructor cannot run under fake "
                                  f"tensors ({traced.optimizer_failure}) and no rule estimates its state", **common), \
                states_plan
        peak, phase = fb_peak + estimated, traced.peak_phase
        fb_peak, optimizer_peak = peak, None
        parts["optimizer_state"] += estimated
        most["optimizer_state"], at_step = estimated, {}
        notes.append(f"{optimizer}: its constructor cannot run under fake tensors ({traced.optimizer_failure}); "
                     f"its state ({estimated} bytes) is its estimate rule's, alive through forward and backward, "
                     f"and the optimizer step's own temporaries are not traced")
    host = {part: parts.pop(part) for part in getattr(engine, "host_parts", ()) if parts.get(part)}
    if host:
        # Offloaded states: on the CPU in a real run; the trace holds them beside the device's bytes.
        peak -= sum(host.values())
        fb_peak -= traced.forward_backward_host
        optimizer_peak = None if optimizer_peak is None else optimizer_peak - traced.optimizer_host
        notes.append(f"offloaded to the CPU, not in the device peak: {', '.join(f'{k} {v} bytes' for k, v in host.items())}")
    reference = states_plan.optimizers[0].reference_model_bytes if states_plan is not None else 0
    if reference:
        # A frozen reference model (DPO-style training) is alive through the whole step. Its own
        # forward's temporaries are not traced.
        parts["reference_model"] = reference
        if True:
            peak += reference
            fb_peak = fb_peak + reference
            optimizer_peak = None if optimizer_peak is None else optimizer_peak + reference
        notes.append("a frozen reference model's parameters are in the peak; its forward's temporaries are not")
    fits = margin = None
    if device_memory is not None:
        margin = device_memory - reserve_bytes - peak
        fits = margin >= 0
    return StepMemoryPlan(activations_bytes=traced.activations_bytes,
                          activations_peak_bytes=traced.activations_peak_bytes, peak_bytes=peak, peak_phase=phase,
                          peak_parts=parts, forward_backward_peak_bytes=fb_peak,
                          optimizer_step_peak_bytes=optimizer_peak, model_states_most_bytes=most,
                          model_states_host_bytes=most_host, model_states_at_optimizer_step_bytes=at_step, fits=fits, margin_bytes=margin, notes=notes,
                          engine=engine.name, optimizer_implementation=implementation, host_bytes=host,
                          settings_used=[list(row) for row in settings.used()], **common), states_plan


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
    if step.problem is not None or not step.model_states_most_bytes or len(states.optimizers) != 1:
        return states
    [row] = states.optimizers
    if row.model_states_bytes is None:
        return states
    device, host = step.model_states_most_bytes, step.model_states_host_bytes
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
        fits=None if margin is None else margin >= 0, margin_bytes=margin, engine=step.engine,
        at_optimizer_step_bytes=dict(step.model_states_at_optimizer_step_bytes))
    return dataclasses.replace(states, optimizers=[row])


def _resolve(settings: Optional[StepSettings], args: Any, setup: Optional[Setup], **given: Any) -> StepSettings:
    """The settings: those given (or resolved from `args`), the explicit arguments over them."""
    hidden_size = given.pop("hidden_size")
    flags = {key: value for key, value in given.items() if value is not None}
    if setup is not None:
        flags.update(world_size=setup.world_size, nodes=setup.nodes, sharding=setup.sharding, precision=setup.precision)
        if setup.offload_params and setup.is_fsdp:
            flags["fsdp_cpu_offload"] = True
    if settings is None:
        training_args = args if (args is not None and hasattr(args, "to_dict")) else None
        return resolve_settings(training_args, hidden_size=hidden_size, **flags)
    if not flags:
        return settings
    sources = dict(settings.sources)
    sources.update({key: "flag" for key in flags})
    if flags.get("sharding") == "fsdp-shard-grad-op":
        flags["reshard_after_forward"] = False
    elif flags.get("sharding") == "fsdp-full-shard":
        flags["reshard_after_forward"] = True
    return dataclasses.replace(settings, sources=sources, **flags)


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
    allowed = ["eager"] + list(ALL_ATTENTION_FUNCTIONS.valid_keys())
    unsupported = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}
    allowed = [key for key in allowed if getattr(inner, unsupported.get(key, ""), True) is not False]
    if name not in allowed:
        why = "is not one of transformers' attention implementations" if name not in unsupported else \
            f"is not supported by {type(inner).__name__}"
        raise ValueError(f"--attn-implementation {name!r} {why}: give one of {', '.join(allowed)}")


def setup_of(settings: StepSettings, setup: Optional[Setup] = None) -> Setup:
    """The model-states plan's `Setup` of resolved settings (`setup` itself when given)."""
    if setup is not None:
        return setup
    return Setup(world_size=settings.world_size, nodes=settings.nodes, sharding=settings.sharding,
                 precision=settings.precision, offload_optimizer=settings.offload_optimizer and settings.zero_stage > 0,
                 offload_params=settings.offload_params and settings.sharding in ("zero3", "fsdp-full-shard", "fsdp-shard-grad-op"),
                 sub_group_size=int(settings.zero.get("sub_group_size", 1_000_000_000)), replicate=settings.replicate)


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing, as the Trainer's `gradient_checkpointing=True`
    turns it on (transformers 5: `activation_checkpointing_enable`; 4.x:
    `gradient_checkpointing_enable`)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _enable_checkpointing(model: nn.Module, name: str) -> None:
    enable_checkpointing(model)


def _optimizer_builder(name: str, args: Any, device_type: str = "cpu") -> Tuple[Callable[[nn.Module], Any], List[Optional[str]]]:
    """The Trainer's optimizer builder, and the implementation torch runs it with on `device_type`.

    torch's `_default_to_fused_or_foreach` (torch/optim/optimizer.py) picks foreach when `foreach`
    is None and every parameter is on CUDA, the single-tensor loop on the CPU; `fused=True` (the
    Trainer's `adamw_torch_fused`) is fused on both. The trace runs on fake CPU tensors, so for
    `device_type="cuda"` the groups get `foreach=True`, which runs on (fake) CPU tensors too."""
    from trainer_memcb.plan.trainer_optimizers import build_trainer_optimizer, import_optimizer_source

    import_optimizer_source()  # outside the trace: what an import makes is no part of the step
    if args is None or not hasattr(args, "optim"):
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir="trainer-memcb-plan", report_to=[])
    implementation: List[Optional[str]] = [None]

    def build(model: nn.Module) -> Any:
        optimizer = build_trainer_optimizer(name, args, model)
        inner = getattr(optimizer, "optimizer", optimizer)
        groups = getattr(inner, "param_groups", [])
        if groups and all("foreach" in group for group in groups):
            if any(group.get("fused") for group in groups):
                implementation[0] = "fused"
            elif all(group.get("foreach") is None for group in groups) and device_type == "cuda":
                for group in groups:
                    group["foreach"] = True
                implementation[0] = "foreach"
            else:
                implementation[0] = "foreach" if all(group.get("foreach") for group in groups) else "single-tensor"
        return optimizer

    return build, implementation


# The largest batch `max_batch_size` searches: an answer equal to it means "at least this many".
MAX_BATCH_SEARCH_LIMIT = 1 << 20


def max_batch_size(plan_at: Callable[[int], StepMemoryPlan], device_memory: int,
                   limit: int = MAX_BATCH_SEARCH_LIMIT) -> Tuple[Optional[int], List[StepMemoryPlan]]:
    """The largest per-device batch whose planned peak fits in `device_memory`, and the plans traced.

    The peak is the larger of forward/backward's, which grows by the same bytes per sample at a
    given sequence length (activations and temporaries are proportional to the batch), and the
    optimizer step's, which does not depend on the batch. Two traces (batches 1 and 2) therefore
    predict the answer; fake steps at the predicted batch and one above check it, and doubling
    and bisection take over wherever the prediction misses. None when batch 1 does not fit, or
    when a step cannot be traced: then the last plan searched has a `problem` that says why (a
    missing peak is never read as "does not fit"), and the search stops.

    Args:
        plan_at: the step plan at a batch size.
        device_memory: bytes per process the step may use (the device's memory less the reserve).
        limit: the largest batch searched; an answer equal to it means that batch fits, and
            larger ones were not tried.
    """
    plans: Dict[int, StepMemoryPlan] = {}

    class _CannotTrace(Exception):
        pass

    def fits(batch: int) -> bool:
        if batch not in plans:
            plans[batch] = plan_at(batch)
        peak = plans[batch].peak_bytes
        if peak is None:
            raise _CannotTrace()
        return peak <= device_memory

    def done(best: Optional[int]) -> Tuple[Optional[int], List[StepMemoryPlan]]:
        return best, [plans[b] for b in sorted(plans)]

    try:
        return _search(fits, plans, device_memory, limit, done)
    except _CannotTrace:
        return done(None)


def _search(fits: Callable[[int], bool], plans: Dict[int, StepMemoryPlan], device_memory: int, limit: int,
            done: Callable[[Optional[int]], Tuple[Optional[int], List[StepMemoryPlan]]]
            ) -> Tuple[Optional[int], List[StepMemoryPlan]]:
    """`max_batch_size`'s search, over `fits` (which traces and records each batch in `plans`)."""
    if not fits(1):
        return done(None)
    if limit == 1 or not fits(2):
        return done(1)
    low, high = 2, None  # low fits; high (when known) does not
    # A first guess from the activations' bytes per sample (the peak grows at least that fast once
    # the activations dominate it).
    per_sample = (plans[2].activations_peak_bytes or 0) - (plans[1].activations_peak_bytes or 0)
    guess = min(limit, max(3, 1 + (device_memory - plans[1].peak_bytes) // max(1, per_sample)))
    while high is None:
        if guess <= low:
            guess = low + 1
        if guess > limit:
            return done(low)
        if fits(guess):
            low, guess = guess, min(guess * 2, limit + 1) if guess < limit else limit + 1
        else:
            high = guess
    # The peak is the larger of affine functions of the batch (convex): the chord from low to high
    # lies above it, so the batch where the chord reaches the memory fits; check one above it.
    while high - low > 1:
        slope = (plans[high].peak_bytes - plans[low].peak_bytes) / (high - low)
        candidate = low + int((device_memory - plans[low].peak_bytes) // slope) if slope > 0 else (low + high) // 2
        candidate = min(max(candidate, low + 1), high - 1)
        if fits(candidate):
            low = candidate
            if low + 1 < high and not fits(low + 1):
                high = low + 1
        else:
            high = candidate
    return done(low)
