"""One training step run under fake tensors, counting its activations and every storage alive.

`trace_step` runs one training step of the model as the Trainer runs it: the model prepared
as the Trainer prepares it (`trainer_memcb.plan.model.trainer_model`: `use_cache=False`, checkpointing,
`model.train()`), the forward with the batch a collator makes for its head
(`trainer_memcb.plan.model.step_inputs`) and, for models that take loss keyword arguments, `num_items_in_batch`
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
peak of every step after the first (`trainer_memcb.plan.answers.step_memory`). Each storage counts with its full size and is freed when its
last tensor is gone: that is the memory a caching-free allocator holds (on CPU, what the profiler
records, see the tests); a CUDA caching allocator rounds each block up to 512 bytes and may hold
freed blocks (fragmentation), which is not counted.

Gradient accumulation. With `gradient_accumulation_steps` above 1 the step's micro-batches run in
turn before the optimizer step, each with a batch of its own, all on the device from the step's
start to its end (as the Trainer fetches and keeps them): the trace runs the first, the second
(the first's gradients alive, as the engine keeps them) and the last (where the engines reduce), in
that order in one timeline (`traced_micro_batches`); forward and backward's peak is the worst
micro-batch's (`Timeline.peak_micro_batch`), each one's kept in `Timeline.micro_batch_peaks`.

Device. The trace runs on fake CPU tensors: on a CPU-only build of torch, autograd aborts the
process on fake CUDA tensors. On CPU, `scaled_dot_product_attention` runs the flash kernel for CPU,
which saves the output and an fp32 logsumexp, as CUDA's flash and memory-efficient kernels do; the
eager path saves the same tensors on any device. For a run on CUDA, autocast casts by CUDA's op
lists (`trainer_memcb.plan.step.cuda_autocast`) and dropout saves CUDA's 1-byte mask
(`trainer_memcb.plan.step.cuda_dropout`), not the CPU kernels' choices.

Engines. The step runs under the engine the settings name (`trainer_memcb.plan.step.engines`): one
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from trainer_memcb.plan.device.gpus import DEFAULT_COMPUTE_CAPABILITY
from trainer_memcb.plan.settings import StepSettings
from trainer_memcb.plan.settings.step_settings import DEVICE_TYPES
from trainer_memcb.plan.step.cuda_autocast import autocast_as, autocast_policy_for
from trainer_memcb.plan.step.cuda_dropout import dropout_as_cuda
from trainer_memcb.plan.step.cuda_sdpa import sdpa_as_cuda
from trainer_memcb.plan.step.engines import StepEngine, engine_for
from trainer_memcb.plan.step.flops import FlopCounting
from trainer_memcb.plan.model.fake_kernels import grouped_mm_any_dtype
from trainer_memcb.plan.step.live_storages import LiveStorages
from trainer_memcb.plan.step.rng_states import rng_states_counted
from trainer_memcb.plan.step.timeline import HOST, PhasePeak, Timeline
from trainer_memcb.plan.model.step_inputs import step_inputs
from trainer_memcb.plan.model.trainer_model import prepare_like_trainer
from trainer_memcb.plan.model.value_reads import passed_checks, unpadded_batch
from trainer_memcb.state.saved_tensors import SavedTensorsCounter

__all__ = ["trace_step", "trace_step_once", "sharing_traces", "counting_flops", "model_fingerprint", "traced_micro_batches", "UntracedStep", "fake_copy",
           "ATTENTION_PATHS", "DEVICE_TYPES", "MAX_GRAD_NORM"]

ATTENTION_PATHS = ("eager", "sdpa")
# transformers' TrainingArguments.max_grad_norm default: the Trainer clips before each step.
MAX_GRAD_NORM = 1.0


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


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def _trace_step(model: nn.Module, batch_size: int, seq_len: Optional[int], precision: str,
                build_optimizer: Optional[Callable[[nn.Module], Any]], gradient_checkpointing: bool,
                engine: Optional[StepEngine] = None, input_options: Optional[Dict[str, Any]] = None,
                accumulation: int = 1, device_type: str = "cpu",
                compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY) -> Timeline:
    """Run the step under fake tensors (the model already fake), counting as the module says;
    `engine` wraps the model and runs the backward and the optimizer step its way. With
    `accumulation` above 1, the micro-batches of `traced_micro_batches(accumulation)` run their
    forward and backward in turn before the optimizer step, each after the gradients the ones
    before it left (`StepEngine.micro_batch` tells the engine which one runs). On "cuda", the
    casts of autocast are CUDA autocast's (`trainer_memcb.plan.step.cuda_autocast`) and dropout
    saves CUDA's 1-byte mask (`trainer_memcb.plan.step.cuda_dropout`), and attention runs the
    backend a GPU of `compute_capability` takes (`trainer_memcb.plan.step.cuda_sdpa`), for the
    whole step, so that checkpointing's recomputation runs as the forward did."""
    mode = _MODE[0]
    engine = engine or StepEngine()
    notes: List[str] = []
    model.train()
    engine.optimizer_builder = build_optimizer
    model = engine.wrap(model, mode)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    tracker = LiveStorages(keep_timeline=True)
    # Every micro-batch of the step is on the device before the first runs, and stays to the end:
    # `Trainer.get_batch_samples` fetches them all (accelerate's dataloader sends each to the
    # device as it is yielded) into the list `batch_samples`, which the micro-batches' loop keeps.
    with mode:
        micro_batch_inputs = [step_inputs(model, batch_size, seq_len, **(input_options or {}))
                              for _ in range(accumulation)]
    inputs = micro_batch_inputs[0]
    labels = inputs.labels
    batch_tensors = [tensor for each in micro_batch_inputs for tensor in each.tensors()]
    for tensor in params + list(model.buffers()) + batch_tensors:
        tracker.add(tensor)
    for part, tensors in engine.resident().items():
        for tensor in tensors:
            tracker.add(tensor)
        tracker.tag(tensors, part)
    tensor = tensors = None  # the loops' last: no loop variable keeps a tensor alive
    counter = SavedTensorsCounter(exclude=params, watch_recomputation=gradient_checkpointing)
    tracker.watch = counter._book.live
    engine.attach(tracker, counter)
    autocast = None
    cast_policy: Any = contextlib.nullcontext()
    dropout_kernels = dropout_as_cuda() if device_type == "cuda" else contextlib.nullcontext()
    attention_kernels = sdpa_as_cuda(compute_capability) if device_type == "cuda" else contextlib.nullcontext()
    if precision.startswith("autocast-"):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16 if precision.endswith("bf16") else torch.float16)
        policy = autocast_policy_for(device_type)
        if policy is not None:
            cast_policy = autocast_as(policy)
    grads: List[int] = []
    state_keys: List[int] = []
    optimizer_peak = 0
    optimizer_keys: List[int] = []
    optimizer_watch: List[int] = []
    optimizer_failure: Optional[str] = None
    numbers = traced_micro_batches(accumulation)
    micro_peaks: List[Tuple[int, Tuple[Any, ...]]] = []
    flop_totals: List[int] = []
    try:
        # On the CPU, checkpointing's generator states are in the step's memory (`rng_states`).
        rng_states = rng_states_counted() if device_type == "cpu" else contextlib.nullcontext()
        flops = FlopCounting(flop_totals) if _COUNT_FLOPS[0] else contextlib.nullcontext()
        with cast_policy, dropout_kernels, attention_kernels, rng_states, mode, tracker, flops:
            for number in numbers:
                if len(numbers) > 1:
                    engine.micro_batch(number, last=number == accumulation)
                if number > 1:
                    tracker.peak_bytes = 0  # this micro-batch's own peak, from here
                    inputs = micro_batch_inputs[number - 1]
                    labels = inputs.labels
                tracker.phase = "forward"
                if number == 1:
                    phase_starts = {"forward": len(tracker.events)}
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
                if number == 1:
                    activations = counter.saved_bytes
                tracker.phase = "backward"
                if number == 1:
                    phase_starts["backward"] = len(tracker.events)
                engine.backward(loss)
                del loss
                micro_peaks.append((number, (tracker.peak_bytes, tracker.peak_label, tracker.peak_keys, tracker.peak_watch)))
            grads = tracker.serials(engine.gradients(trainable))
            # The worst micro-batch's (the first of equal ones).
            peak_micro_batch, forward_backward = max(micro_peaks, key=lambda item: item[1][0])
            if build_optimizer is not None:
                tracker.phase = "optimizer step"
                phase_starts["optimizer step"] = len(tracker.events)
                tracker.peak_bytes = 0  # the optimizer phase's own peak, from here
                try:
                    optimizer = engine.step(build_optimizer, model, trainable)
                except Exception as error:  # a constructor that reads values (bitsandbytes' 8-bit)
                    optimizer_failure = one_line(error)
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
    fb_bytes, fb_phase, fb_keys, fb_watch = forward_backward
    stepped = build_optimizer is not None
    groups = {"parameters": frozenset(tracker.serials(params)), "gradients": frozenset(grads),
              "optimizer_state": frozenset(state_keys),
               "batch_and_buffers": frozenset(tracker.serials(list(model.buffers()) + batch_tensors)),
               "batch": frozenset(tracker.serials(batch_tensors))}
    timeline = Timeline(
        events=tuple(tracker.events), sizes=tracker.sizes, tags=tracker.tags, groups=groups, states={},
        host_parts=tuple(getattr(engine, "host_parts", ())), step_start=tracker.step_start,
        forward_backward=PhasePeak(fb_phase, fb_bytes, tuple(fb_keys), frozenset(fb_watch)),
        optimizer_step=PhasePeak("optimizer step", optimizer_peak, tuple(optimizer_keys), frozenset(optimizer_watch))
        if stepped else None,
        state_resident=engine.state_resident, activations_bytes=activations, activations_peak_bytes=counter.peak_bytes,
        optimizer_failure=optimizer_failure, notes=tuple(notes), engine=engine.name,
        gradient_accumulation_steps=accumulation, peak_micro_batch=peak_micro_batch,
        micro_batch_peaks=tuple((number, PhasePeak(label, peak, tuple(keys), frozenset(watch)))
                                for number, (peak, label, keys, watch) in micro_peaks) if len(numbers) > 1 else (),
        phase_starts=phase_starts, first_matmul=dict(tracker.first_matmul),
        flops=flop_totals[0] if flop_totals else None)
    return dataclasses.replace(timeline, states=_states_of(timeline, engine))


def traced_micro_batches(accumulation: int) -> Tuple[int, ...]:
    """The micro-batches of an optimizer step that the trace runs, by number (1 to `accumulation`):
    the first (no gradient alive before it), the second (the first's gradients alive: every one
    up to the last runs as it does) and the last (where the engines reduce: DDP's all-reduce,
    FSDP2's reduce-scatter, DeepSpeed's accumulation boundary)."""
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"gradient_accumulation_steps={accumulation!r}: expected a whole number of at least 1")
    return tuple(sorted({1, min(2, accumulation), accumulation}))


def _states_of(timeline: Timeline, engine: StepEngine) -> Dict[int, str]:
    """Each storage's model state (`MODEL_STATES`, `HOST` added for what lives on the host), as
    the engine files its part (`StepEngine.state_of`); storages of no state are left out. The
    activations, the batch and the temporaries carry none, so a storage's state does not depend
    on the moment."""
    states: Dict[int, str] = {}
    host = timeline.host_parts
    for serial in timeline.sizes:
        part = timeline.part_of(serial)
        state = engine.state_of(part, serial)
        if state is not None:
            states[serial] = state + (HOST if part in host else "")
    return states


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


# One FakeTensorMode per trace, set by `trace_step`.
_MODE: List[Any] = [None]


class UntracedStep(Exception):
    """The step could not run under fake tensors; the message is the error that stopped it, on one line."""


def _untraced_reason(error: BaseException, sharding: str) -> str:
    """What stopped the trace, on one line; for a collective this torch's fake process group cannot
    run (torch 2.6 has no fake kernel for `c10d._allgather_base_`, which FSDP2 and ZeRO-3 gather
    with), the torch that lacks it and one that has it."""
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    name = str(getattr(error, "func", ""))
    if isinstance(error, UnsupportedOperatorException) and name.startswith(("c10d.", "_c10d_functional.")):
        return (f"this torch ({torch.__version__}) has no fake kernel for the collective {name}, which the "
                f"{sharding} step runs; torch 2.13 has one")
    return one_line(error)


# The traces shared inside `sharing_traces`: what changes the step -> its timeline, or the reason
# it could not be traced. None outside the block.
_SHARED: List[Optional[Dict[Tuple[Any, ...], Union[Timeline, UntracedStep]]]] = [None]


@contextlib.contextmanager
def sharing_traces() -> Iterator[None]:
    """Trace each distinct step once inside this block: a step traced again with what changes it
    unchanged (the model, its settings, batch, sequence, precision, optimizer, checkpointing, device
    type and the GPU's compute capability) returns the first trace's timeline, so that what the
    trace does not read (the allocator's settings, the device's memory, the reserve) is answered
    again from the same timeline without a new trace. Nested blocks share the outermost's traces."""
    if _SHARED[0] is not None:
        yield
        return
    _SHARED[0] = {}
    try:
        yield
    finally:
        _SHARED[0] = None


# Whether the steps traced now count their FLOPs (`counting_flops`).
_COUNT_FLOPS = [False]


@contextlib.contextmanager
def counting_flops() -> Iterator[None]:
    """Count each traced step's FLOPs inside this block (`Timeline.flops`; None outside it): what
    the fit search's step times are read from. Counting costs about a sixth of a trace's time, so
    a plan that does not need them does not count them. A step shared from an earlier trace
    (`sharing_traces`) that did not count them is traced again."""
    before = _COUNT_FLOPS[0]
    _COUNT_FLOPS[0] = True
    try:
        yield
    finally:
        _COUNT_FLOPS[0] = before


def model_fingerprint(meta: nn.Module) -> Tuple[Any, ...]:
    """What of the model changes its step: its class, its config (the attention path among it),
    and each parameter's and buffer's name, shape, dtype and whether it trains."""
    config = getattr(meta, "config", None)
    return (type(meta).__qualname__, repr(config), getattr(config, "_attn_implementation", None),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in meta.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in meta.named_buffers()))


def trace_step(meta: nn.Module, settings: StepSettings, *, seq_len: Optional[int], args: Any, device_type: str,
               step_dtype: Optional[torch.dtype], keep_dtypes: bool, quantization: Any, padding: int,
               input_options: Dict[str, Any],
               compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY) -> Timeline:
    """`trace_step_once`, or inside `sharing_traces` the timeline of the same step traced before."""
    shared = _SHARED[0]
    options = dict(seq_len=seq_len, args=args, device_type=device_type,
                   step_dtype=step_dtype, keep_dtypes=keep_dtypes, quantization=quantization, padding=padding,
                   input_options=input_options, compute_capability=compute_capability)
    if shared is None:
        return trace_step_once(meta, settings, **options)
    # Where each setting came from changes nothing of the step, nor do the device's memory, the
    # reserve, the allocator's settings and the GPU (its compute capability is among the options).
    step_only = dataclasses.replace(settings, sources={}, device_memory=None, reserve_bytes=0, alloc_conf=None, gpu=None)
    key = (model_fingerprint(meta), repr(step_only),
           repr(sorted(options.items())))
    found = shared.get(key)
    if found is None or (_COUNT_FLOPS[0] and isinstance(found, Timeline) and found.flops is None):
        try:
            found = trace_step_once(meta, settings, **options)
        except UntracedStep as error:
            found = error
        shared[key] = found
    if isinstance(found, UntracedStep):
        raise UntracedStep(str(found))
    return found


def trace_step_once(meta: nn.Module, settings: StepSettings, *, seq_len: Optional[int], args: Any, device_type: str,
                    step_dtype: Optional[torch.dtype], keep_dtypes: bool, quantization: Any, padding: int,
                    input_options: Dict[str, Any],
                    compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY) -> Timeline:
    """Trace one training step of `meta` (a model on the meta device, made fake here) under the
    engine `settings` name (`engine_for`): the model prepared as the Trainer prepares it (quantized first when asked), the
    Trainer's optimizer for `settings.optimizer`, in `settings.precision`, with checkpointing where
    `settings.gradient_checkpointing`, a micro-batch of `settings.batch_size` and `input_options`.
    The settings are the one source of what they hold: no keyword repeats them.

    Returns:
        The step's timeline: every storage it created and freed, by part, each phase's peak, the
        activations, and the trace's notes (the engine's, the quantized layers', the optimizer's
        implementation).

    Raises:
        UntracedStep: the step could not run under fake tensors (data-dependent control flow, ...).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch_size, precision = settings.batch_size, settings.precision
    optimizer, gradient_checkpointing = settings.optimizer, settings.gradient_checkpointing
    engine = engine_for(settings)
    mode = FakeTensorMode()
    _MODE[0] = mode
    quantization_note = None
    frozen = _freeze_older_objects()
    try:
        model = fake_copy(meta, mode, "cpu", None if keep_dtypes else step_dtype)
        if quantization is not None:
            from trainer_memcb.plan.model.quantized import quantize_linear_layers

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
        prepare_like_trainer(model, args=args, gradient_checkpointing=gradient_checkpointing,
                             checkpointing=settings.checkpointing_kwargs)
        build_optimizer, implementation = _optimizer_builder(optimizer, args, device_type)
        unpadded = unpadded_batch() if not padding else contextlib.nullcontext()
        with grouped_mm_any_dtype(), unpadded, passed_checks():
            timeline = _trace_step(model, batch_size, seq_len, precision, build_optimizer, gradient_checkpointing,
                                   engine, input_options, settings.gradient_accumulation_steps, device_type,
                                   compute_capability)
    except Exception as error:  # a forward fake tensors cannot run (data-dependent control flow, ...)
        engine.close()
        raise UntracedStep(_untraced_reason(error, settings.sharding)) from error
    finally:
        _MODE[0] = None
        gc.collect()  # the trace's own garbage: the objects frozen before it are not scanned
        if frozen:
            gc.unfreeze()
    notes = list(timeline.notes) + ([quantization_note] if quantization_note else [])
    if gradient_checkpointing and device_type == "cuda":
        notes.append("with gradient checkpointing, torch.utils.checkpoint keeps the CPU generator's state "
                     "(torch.get_rng_state(), 5,056 bytes) per block from its forward to its recomputation: "
                     "host memory on a CUDA run, not counted")
    if implementation[0]:
        notes.append(f"optimizer traced with its {implementation[0]} implementation, as torch runs it on {device_type}")
    return dataclasses.replace(timeline, notes=tuple(notes), optimizer_implementation=implementation[0])


def _optimizer_builder(name: str, args: Any, device_type: str = "cpu") -> Tuple[Callable[[nn.Module], Any], List[Optional[str]]]:
    """The Trainer's optimizer builder, and the implementation torch runs it with on `device_type`.

    torch's `_default_to_fused_or_foreach` (torch/optim/optimizer.py) picks foreach when `foreach`
    is None and every parameter is on CUDA, the single-tensor loop on the CPU; `fused=True` (the
    Trainer's `adamw_torch_fused`) is fused on both. The trace runs on fake CPU tensors, so for
    `device_type="cuda"` the groups get `foreach=True`, which runs on (fake) CPU tensors too."""
    from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer, import_optimizer_source

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


