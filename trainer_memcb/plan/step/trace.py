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

Shared steps. Inside `sharing_traces` a step is traced once however often it is planned, and a
step that differs from one traced before by its optimizer alone (on one process or under DDP) runs
no forward and backward of its own: the first trace keeps its step as its optimizer phase began
(`_Prefix`: the tracker's books, each gradient on its storage), and the other optimizer's phase
runs from there, its timeline the shared events up to that phase, its own, then the frees that
closed the first step; the same timeline, to the event, as a trace of its own (the tests hold it),
and where the phase leaves other storages alive than the first's did, the step is traced whole.

Engines. The step runs under the engine the settings name (`trainer_memcb.plan.step.engines`): one
process, DDP's buckets, FSDP2's real `fully_shard` on a fake process group, DeepSpeed ZeRO's
buffers modelled from its source. Each wraps the model and runs the backward and the optimizer
step its way inside the same timeline, so the peak is always the largest sum at one moment of what
one process holds. The settings (`trainer_memcb.plan.settings`) are resolved once from the
`TrainingArguments`, the engine's config and the explicit arguments.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from trainer_memcb.plan.device.gpus import DEFAULT_COMPUTE_CAPABILITY
from trainer_memcb.plan.settings import StepSettings
from trainer_memcb.plan.settings.step_settings import DEVICE_TYPES
from trainer_memcb.plan.step.compiled_step import COMPILED_NOT_COUNTED
from trainer_memcb.plan.step.cuda_autocast import autocast_as, autocast_policy_for
from trainer_memcb.plan.step.cuda_dropout import dropout_as_cuda
from trainer_memcb.plan.step.cuda_sdpa import sdpa_as_cuda
from trainer_memcb.plan.step.ring_attention import ring_options
from trainer_memcb.plan.step.rloo import RlooStep
from trainer_memcb.plan.step.rloo_generation import rloo_generation
from trainer_memcb.plan.step.kernel_runs import KernelRuns
from trainer_memcb.plan.step.kernel_stand_ins import kernel_stand_ins
from trainer_memcb.plan.step.engines import StepEngine, engine_class, engine_for
from trainer_memcb.plan.step.flops import FlopCounting
from trainer_memcb.plan.step.grpo_generation import grpo_generation
from trainer_memcb.plan.model.fake_kernels import grouped_mm_any_dtype
from trainer_memcb.plan.step.live_storages import LiveStorages, TrackerState
from trainer_memcb.plan.step.rng_states import rng_states_counted
from trainer_memcb.plan.step.timeline import HOST, PhasePeak, Timeline
from trainer_memcb.plan.model.loss_kwargs import accepts_loss_kwargs, num_items_in_batch
from trainer_memcb.plan.model.step_inputs import step_inputs
from trainer_memcb.plan.model.trainer_model import prepare_like_trainer
from trainer_memcb.plan.model.value_reads import passed_checks, unpadded_batch
from trainer_memcb.state.saved_tensors import SavedTensorsCounter
from trainer_memcb.utils.collector_scope import collecting_only_what_it_makes

__all__ = ["COMPILED_NOT_COUNTED", "trace_step", "trace_step_once", "sharing_traces", "counting_flops", "model_fingerprint", "traced_micro_batches", "UntracedStep", "fake_copy",
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


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


@dataclasses.dataclass
class _Step:
    """One step while it is traced: the model as its engine wrapped it, the books that count its
    storages and activations, and every micro-batch's inputs."""

    model: nn.Module
    mode: Any
    engine: StepEngine
    tracker: LiveStorages
    counter: SavedTensorsCounter
    params: List[torch.Tensor]
    trainable: List[torch.Tensor]
    inputs: List[Any]
    batch_tensors: List[torch.Tensor]
    # A TRL trainer's step (`trainer_memcb.plan.step.trl_step.TrlStep`) and its frozen reference
    # model, or None.
    preference: Any = None
    ref_model: Optional[nn.Module] = None
    # GRPO's generation phase: its peak, and the token ids generate is given.
    generation: Optional[PhasePeak] = None
    tokens: Optional[Dict[str, Any]] = None
    batch_size: int = 1
    seq_len: Optional[int] = None
    # With torch_compile=True: the model's forward as the compiled step runs it
    # (`trainer_memcb.plan.step.compiled_step.CompiledForward`); None for the eager step.
    compiled: Any = None


@dataclasses.dataclass
class _Stepped:
    """The optimizer phase's outcome: the optimizer state's storages and the phase's peak, or why
    the optimizer could not be built."""

    state: List[int] = dataclasses.field(default_factory=list)
    peak: Optional[PhasePeak] = None
    failure: Optional[str] = None


def _start_step(model: nn.Module, mode: Any, engine: StepEngine, build_optimizer: Any, batch_size: int,
                seq_len: Optional[int], input_options: Optional[Dict[str, Any]], accumulation: int,
                gradient_checkpointing: bool, preference: Any = None, ref_model: Optional[nn.Module] = None) -> _Step:
    """Wrap the model as its engine does and count what exists before the step: the parameters,
    the buffers, every micro-batch and the engine's resident tensors."""
    model.train()
    engine.optimizer_builder = build_optimizer
    model = engine.wrap(model, mode)
    params = list(model.parameters())
    tracker = LiveStorages(keep_timeline=True)
    if _RECORDING[0] is not None:  # a step folded from fewer layers (`_folded`): its log too
        tracker.keep_tokens()
    # Every micro-batch of the step is on the device before the first runs, and stays to the end:
    # `Trainer.get_batch_samples` fetches them all (accelerate's dataloader sends each to the
    # device as it is yielded) into the list `batch_samples`, which the micro-batches' loop keeps.
    with mode:
        if preference is None:
            inputs = [step_inputs(model, batch_size, seq_len, **(input_options or {})) for _ in range(accumulation)]
        else:  # the TRL trainer's collator (GRPO's batch is made by its generation phase, in the step)
            inputs = [preference.batch(model, batch_size, seq_len, input_options or {}) for _ in range(accumulation)]
        shard_inputs = getattr(engine, "shard_inputs", None)
        if shard_inputs is not None:  # context parallelism: each rank's share of the sequence
            shard_inputs(inputs)
    batch_tensors = [tensor for each in inputs if each is not None for tensor in each.tensors()]
    for tensor in params + list(model.buffers()) + batch_tensors:
        tracker.add(tensor)
    for part, tensors in engine.resident().items():
        for tensor in tensors:
            tracker.add(tensor)
        tracker.tag(tensors, part)
    counter = SavedTensorsCounter(exclude=params, watch_recomputation=gradient_checkpointing)
    tracker.watch = counter._book.live
    tracker.log_saved(counter._book)
    engine.attach(tracker, counter)
    generates = preference is not None and preference.generates
    return _Step(model, mode, engine, tracker, counter, params, [p for p in params if p.requires_grad], inputs,
                 batch_tensors, preference, ref_model, tokens=_token_ids(model) if generates else None,
                 batch_size=batch_size, seq_len=seq_len)


def _token_ids(model: nn.Module) -> Dict[str, Any]:
    """The ids GRPO's generate is given (the tokenizer's in TRL; the model config's here: their
    values change no storage): pad (0 without one), bos and the EOS ids."""
    config = getattr(model, "config", None)
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [0] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    pad = getattr(config, "pad_token_id", None)
    return {"pad_token_id": eos_ids[0] if pad is None else pad, "bos_token_id": getattr(config, "bos_token_id", None),
            "eos_token_ids": eos_ids}


def _step_contexts(mode: Any, tracker: LiveStorages, precision: str, device_type: str,
                   compute_capability: Tuple[int, int], flop_totals: Optional[List[int]],
                   ring: Any = None) -> Tuple[List[Any], Any]:
    """The contexts the whole step runs in, in the order they are entered (CUDA's autocast lists,
    dropout and attention kernels on "cuda", the attention torch's ring given `ring`, context
    parallelism's group and rotate method; the generator states counted on the CPU; the fake
    mode, the tracker and, given `flop_totals`, the FLOP counter last), and the forward's autocast
    (None without)."""
    autocast = None
    cast_policy: Any = contextlib.nullcontext()
    if precision.startswith("autocast-"):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16 if precision.endswith("bf16") else torch.float16)
        policy = autocast_policy_for(device_type)
        if policy is not None:
            cast_policy = autocast_as(policy)
    cuda = device_type == "cuda"
    # On the CPU, checkpointing's generator states are in the step's memory (`rng_states`).
    attention: Any = contextlib.nullcontext()
    if cuda:
        attention = sdpa_as_cuda(compute_capability, ring[0] if ring else None)
    return [cast_policy, dropout_as_cuda() if cuda else contextlib.nullcontext(), attention,
            ring_options(ring[1]) if ring else contextlib.nullcontext(),
            rng_states_counted() if device_type == "cpu" else contextlib.nullcontext(), mode, tracker,
            FlopCounting(flop_totals, tracker) if flop_totals is not None else contextlib.nullcontext()], autocast


def _forward_backward(step: _Step, accumulation: int, autocast: Any) -> Tuple[List[Tuple[int, Tuple[Any, ...]]], int,
                                                                               Dict[str, int], Dict[str, Any]]:
    """Each traced micro-batch's forward and backward, in turn. Returns each one's peak (bytes,
    phase, storages, activations alive), the first's activations, where forward and backward began
    in the timeline, and the last forward's keywords, which the caller keeps to the step's end (as
    the Trainer's loop keeps them)."""
    tracker, counter, engine, model = step.tracker, step.counter, step.engine, step.model
    numbers = traced_micro_batches(accumulation)
    micro_peaks: List[Tuple[int, Tuple[Any, ...]]] = []
    phase_starts: Dict[str, int] = {}
    for number in numbers:
        if len(numbers) > 1:
            engine.micro_batch(number, last=number == accumulation)
        if number > 1:
            tracker.reset_peak()  # this micro-batch's own peak, from here
        if step.preference is not None and step.preference.generates_before(number, accumulation):
            _generation_phase(step, phase_starts, autocast)
        inputs = step.inputs[number - 1]
        tracker.phase = "forward"
        phase_starts.setdefault("forward", len(tracker.events))
        kwargs: Dict[str, Any] = dict(inputs.forward)
        if step.preference is not None:  # TRL's compute_loss
            loss = _trl_loss(step, inputs, kwargs, accumulation, autocast)
        else:
            kwargs = _forward_kwargs(model, inputs)
            with counter, autocast if autocast is not None else contextlib.nullcontext():
                outputs = (step.compiled or model)(**kwargs)
            loss = outputs["loss"] if outputs.get("loss") is not None else outputs[0].float().sum()
            del outputs
        if number == 1:
            activations = counter.saved_bytes
        tracker.phase = "backward"
        phase_starts.setdefault("backward", len(tracker.events))
        engine.backward(loss)
        del loss
        tracker.take("micro-batch")
        micro_peaks.append((number, (tracker.peak_bytes, tracker.peak_label, tracker.peak_keys, tracker.peak_watch)))
    return micro_peaks, activations, phase_starts, kwargs


def _forward_kwargs(model: nn.Module, inputs: Any) -> Dict[str, Any]:
    """The Trainer's forward keywords for a micro-batch: its batch and, for a model that takes loss
    keyword arguments, `num_items_in_batch` (`Trainer.compute_loss`)."""
    kwargs: Dict[str, Any] = dict(inputs.forward)
    if inputs.labels is not None and accepts_loss_kwargs(model):
        kwargs["num_items_in_batch"] = num_items_in_batch(inputs.labels)
    return kwargs


def _compile(step: _Step, mode: Any, contexts: List[Any], autocast: Any) -> None:
    """With torch_compile=True, the model compiled as the Trainer's step compiles it
    (`CompiledForward`), by one forward and backward of the first micro-batch inside `contexts`
    (the step's own, made again, its trackers left out) before anything is counted."""
    from trainer_memcb.plan.step.compiled_step import CompiledForward

    step.compiled = CompiledForward(step.model)
    with mode:
        kwargs = _forward_kwargs(step.model, step.inputs[0])
    step.compiled.warm_up(kwargs, mode, contexts, autocast, step.tracker)


def _trl_loss(step: _Step, inputs: Any, kwargs: Dict[str, Any], accumulation: int, autocast: Any) -> torch.Tensor:
    """The micro-batch's loss as its TRL trainer's `compute_loss` makes it (`TrlStep.loss`), its
    saved tensors counted; `kwargs` keeps what the Trainer keeps to the step's end (SFT's
    `num_items_in_batch`)."""
    with step.counter:
        return step.preference.loss(step.model, inputs, step.ref_model, kwargs, accumulation, autocast)


def _generation_phase(step: _Step, phase_starts: Dict[str, int], autocast: Any) -> None:
    """The generation phase of GRPO's or RLOO's step (`plan.step.grpo_generation`,
    `plan.step.rloo_generation`) before a micro-batch's forward (`TrlStep.generates_before`): its peak kept apart (`_Step.generation`, the larger of the
    step's), the buffered generation batch the step's batch from then on (the one before it freed
    once the new one is made, as `GRPOTrainer._buffered_inputs` is replaced), the training phase's
    peak counted from there."""
    tracker = step.tracker
    tracker.phase = "generation"
    phase_starts.setdefault("generation", len(tracker.events))
    generation = rloo_generation if isinstance(step.preference, RlooStep) else grpo_generation
    inputs = generation(step.model, step.ref_model, step.preference, step.batch_size, step.seq_len, step.tokens or {},
                        autocast)
    if step.generation is None or tracker.peak_bytes > step.generation.bytes:
        step.generation = PhasePeak("generation", tracker.peak_bytes, tuple(tracker.peak_keys),
                                    frozenset(tracker.peak_watch))
    before = {id(tensor) for each in step.inputs if each is not None for tensor in each.tensors()}
    step.batch_tensors[:] = [tensor for tensor in step.batch_tensors if id(tensor) not in before]
    step.inputs = [inputs] * len(step.inputs)
    step.batch_tensors.extend(inputs.tensors())
    tracker.reset_peak()  # the training phase's own peak, from here


def _optimizer_phase(step: _Step, build_optimizer: Callable[[nn.Module], Any]) -> _Stepped:
    """Clip, build the optimizer, step it and drop the gradients (`zero_grad(set_to_none=True)`),
    the phase's peak counted from its start. An optimizer whose constructor reads values
    (bitsandbytes' 8-bit) fails here: its failure is kept and the gradients are dropped."""
    tracker, engine = step.tracker, step.engine
    tracker.phase = "optimizer step"
    tracker.reset_peak()  # the optimizer phase's own peak, from here
    try:
        optimizer = engine.step(build_optimizer, step.model, step.trainable)
    except Exception as error:
        failure = one_line(error)
        for p in step.trainable:
            p.grad = None
        return _Stepped(failure=failure)
    state = tracker.serials(engine.state_tensors(optimizer))
    if tracker.tokens is not None:  # each state tensor named by its parameter, for `layer_fold`
        names = {id(p): name for name, p in step.model.named_parameters()}
        for param, values in getattr(optimizer, "state", {}).items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    tracker.label([value], (_layerless(names.get(id(param), "")), key))
    tracker.take("optimizer step")
    peak = PhasePeak("optimizer step", tracker.peak_bytes, tuple(tracker.peak_keys), frozenset(tracker.peak_watch))
    engine.zero_grad(optimizer)
    del optimizer
    return _Stepped(state=state, peak=peak)


def _timeline_of(step: _Step, micro_peaks: List[Tuple[int, Tuple[Any, ...]]], activations: int,
                 phase_starts: Dict[str, int], grads: List[int], stepped: _Stepped,
                 flop_totals: Optional[List[int]]) -> Timeline:
    """The step's timeline, once it has run and its engine is closed; forward and backward's peak
    is the worst micro-batch's (the first of equal ones)."""
    tracker, engine, counter = step.tracker, step.engine, step.counter
    peak_micro_batch, (fb_bytes, fb_phase, fb_keys, fb_watch) = max(micro_peaks, key=lambda item: item[1][0])
    groups = {"parameters": frozenset(tracker.serials(step.params)), "gradients": frozenset(grads),
              "optimizer_state": frozenset(stepped.state),
              "batch_and_buffers": frozenset(tracker.serials(list(step.model.buffers()) + step.batch_tensors)),
              "batch": frozenset(tracker.serials(step.batch_tensors))}
    timeline = Timeline(
        events=tuple(tracker.events), sizes=tracker.sizes, tags=tracker.tags, groups=groups, states={},
        host_parts=tuple(getattr(engine, "host_parts", ())), step_start=tracker.step_start,
        forward_backward=PhasePeak(fb_phase, fb_bytes, tuple(fb_keys), frozenset(fb_watch)),
        optimizer_step=stepped.peak, state_resident=engine.state_resident, activations_bytes=activations,
        activations_peak_bytes=counter.peak_bytes, optimizer_failure=stepped.failure, notes=tuple(engine.notes),
        engine=engine.name, gradient_accumulation_steps=len(step.inputs), peak_micro_batch=peak_micro_batch,
        micro_batch_peaks=tuple((number, PhasePeak(label, peak, tuple(keys), frozenset(watch)))
                                for number, (peak, label, keys, watch) in micro_peaks) if len(micro_peaks) > 1 else (),
        phase_starts=phase_starts, first_matmul=dict(tracker.first_matmul),
        flops=flop_totals[0] if flop_totals else None, generation=step.generation,
        streams=dict(tracker.streams), stream_names=dict(engine.stream_names))
    return dataclasses.replace(timeline, states=_states_of(timeline, engine))


def _trace_step(model: nn.Module, mode: Any, batch_size: int, seq_len: Optional[int], precision: str,
                build_optimizer: Optional[Callable[[nn.Module], Any]], gradient_checkpointing: bool,
                engine: Optional[StepEngine] = None, input_options: Optional[Dict[str, Any]] = None,
                accumulation: int = 1, device_type: str = "cpu",
                compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
                kept: Optional[List["_Prefix"]] = None, preference: Any = None,
                ref_model: Optional[nn.Module] = None, compiled: bool = False) -> Timeline:
    """Run the step under fake tensors (the model already fake, `mode` its fake mode), counting as
    the module says; `engine` wraps the model and runs the backward and the optimizer step its way.
    With `accumulation` above 1, the micro-batches of `traced_micro_batches(accumulation)` run their
    forward and backward in turn before the optimizer step, each after the gradients the ones
    before it left (`StepEngine.micro_batch` tells the engine which one runs). On "cuda", the
    casts of autocast are CUDA autocast's (`trainer_memcb.plan.step.cuda_autocast`) and dropout
    saves CUDA's 1-byte mask (`trainer_memcb.plan.step.cuda_dropout`), and attention runs the
    backend a GPU of `compute_capability` takes (`trainer_memcb.plan.step.cuda_sdpa`), for the
    whole step, so that checkpointing's recomputation runs as the forward did. Given `kept`, the
    step up to its optimizer phase is appended to it where another optimizer can step from there
    (`_Prefix`). With `compiled`, the forward runs as torch_compile=True compiles it (`_compile`)."""
    step = _start_step(model, mode, engine or StepEngine(), build_optimizer, batch_size, seq_len, input_options,
                       accumulation, gradient_checkpointing, preference, ref_model)
    tracker = step.tracker
    flop_totals: Optional[List[int]] = [] if _COUNT_FLOPS[0] else None
    stepped, before = _Stepped(), None
    try:
        ring = getattr(step.engine, "ring", None)
        contexts, autocast = _step_contexts(mode, tracker, precision, device_type, compute_capability, flop_totals,
                                            ring)
        if compiled:  # the step's own contexts, fresh, before the fake mode: no tracker sees the compilation
            fresh = _step_contexts(mode, tracker, precision, device_type, compute_capability, None, ring)[0]
            _compile(step, mode, fresh[:fresh.index(mode)], autocast)
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            micro_peaks, activations, phase_starts, last_inputs = _forward_backward(step, accumulation, autocast)
            grads = tracker.serials(step.engine.gradients(step.trainable))
            if tracker.tokens is not None:  # the parameters and gradients named, for `layer_fold`
                for name, param in step.model.named_parameters():
                    tracker.label([param], (_layerless(name), "parameter"))
                    if param.grad is not None:
                        tracker.label([param.grad], (_layerless(name), "gradient"))
            if build_optimizer is not None:
                phase_starts["optimizer step"] = len(tracker.events)
                if kept is not None and step.engine.name in _BRANCHING_ENGINES:
                    before = _Before.take(step, contexts[-1])
                stepped = _optimizer_phase(step, build_optimizer)
                if before is not None:
                    before.after(tracker)
    finally:
        step.counter.close()
        step.engine.close()
    timeline = _timeline_of(step, micro_peaks, activations, phase_starts, grads, stepped, flop_totals)
    logged = None
    if tracker.tokens is not None:
        # What the step logged up to its timeline (storages freed later, as the step's objects go,
        # are not the step's).
        logged = list(tracker.tokens)
        _RECORDING[0].append((logged, dict(tracker.labels), dict(tracker.companions)))
    if compiled:
        timeline = dataclasses.replace(timeline, compiled=True)
    if before is not None and kept is not None:
        kept.extend(before.prefix(step, last_inputs, timeline, lambda totals: _step_contexts(
            mode, tracker, precision, device_type, compute_capability, totals, ring)[0], logged))
    return timeline


# The engines whose optimizer phase starts from what forward and backward left and changes nothing
# of it but the gradients: another optimizer can step from where the first began (`_Prefix`).
# FSDP2 and ZeRO keep state of their own through the step; their steps are traced whole.
_BRANCHING_ENGINES = ("none", "ddp")


@dataclasses.dataclass
class _Before:
    """What a step held as its optimizer phase began (`take`): the tracker's books, each gradient
    (its parameter, the id of its tensor if the tracker saw it, and a tensor on its storage the
    tracker never sees), the FLOPs counted so far, the activations' peak, the engine's notes; and
    how the phase left them (`after`)."""

    state: TrackerState
    grads: List[Tuple[torch.Tensor, Optional[int], torch.Tensor]]
    flops: Optional[int]
    activations_peak: int
    notes: int
    end: int = 0
    alive: frozenset = frozenset()
    only_grads_gone: bool = False
    token_end: int = 0

    @classmethod
    def take(cls, step: _Step, flop_counter: Any) -> "_Before":
        from torch.utils._python_dispatch import _disable_current_modes

        state = step.tracker.snapshot()
        with _disable_current_modes():  # out of the tracker's sight
            grads = [(p, id(p.grad) if id(p.grad) in state.seen else None, p.grad.detach())
                     for p in step.trainable if p.grad is not None]
        flops = flop_counter.so_far() if hasattr(flop_counter, "so_far") else None
        return cls(state, grads, flops, step.counter.peak_bytes, len(step.engine.notes))

    def after(self, tracker: LiveStorages) -> None:
        """Where the phase ended, the storages alive then, and whether the tensors seen before it
        that it let go are the gradients alone."""
        self.end, self.alive = len(tracker.events), tracker.alive_serials()
        self.token_end = len(tracker.tokens) if tracker.tokens is not None else 0
        gone = {ident for ident, ref in self.state.seen.items() if ref() is None}
        self.only_grads_gone = gone <= {ident for _, ident, _ in self.grads}
        watch = tracker.watch.keys() if tracker.watch is not None else None
        self.only_grads_gone &= watch == (self.state.watch.keys() if self.state.watch is not None else None)

    def prefix(self, step: _Step, last_inputs: Any, timeline: Timeline, contexts: Callable[..., List[Any]],
               logged: Optional[List[Any]] = None) -> List["_Prefix"]:
        """The step kept (`_Prefix`), in a list; an empty one where another optimizer could not
        step from here as a trace of its own would: the phase let go of more than the gradients,
        changed the activations' books or the engine's notes, or the step closed by more than
        freeing storages alive at the phase's end."""
        tail = timeline.events[self.end:]
        if not (self.only_grads_gone and self.activations_peak == timeline.activations_peak_bytes
                and self.notes == len(timeline.notes) and all(e < 0 and ~e in self.alive for e in tail)):
            return []
        tail_tokens = tuple(logged[self.token_end:]) if logged is not None else ()
        return [_Prefix(step, last_inputs, self, tail, timeline, contexts, tail_tokens=tail_tokens)]


@dataclasses.dataclass
class _Prefix:
    """A step traced up to its optimizer phase and kept (`sharing_traces`), with the first
    optimizer's timeline, the events that closed it and the contexts the step ran in (made anew),
    so that another optimizer steps from where the first began (`_another_optimizer`)."""

    step: _Step
    last_inputs: Any
    before: _Before
    tail: Tuple[int, ...]
    timeline: Timeline
    contexts: Callable[[Optional[List[int]]], List[Any]]
    quantization_note: Optional[str] = None
    kernel_notes: Tuple[str, ...] = ()
    outer: Callable[[], List[Any]] = list
    # With the tracker's log (`layer_fold`): the tokens that closed the step (as `tail` its events),
    # and the log of the last optimizer stepped from here (`_another_optimizer`).
    tail_tokens: Tuple[Any, ...] = ()
    logged: Optional[List[Any]] = None


@dataclasses.dataclass
class _FoldedPrefix:
    """The steps of 1, 2 and 3 layers kept up to their optimizer phase (`_Prefix`), for a step of
    `layers` identical layers folded from them: another optimizer steps from each, and the three
    are folded (`_from_kept_step`)."""

    prefixes: Tuple[_Prefix, ...]
    layers: int


def _gradients_back(prefix: _Prefix) -> None:
    """Each gradient as it was when the first optimizer began, in a new tensor object held by its
    parameter alone, and the tracker's books as they were then (the gradients counted as those)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        fresh = [alias.detach() for _, _, alias in prefix.before.grads]
    for (param, _, _), grad in zip(prefix.before.grads, fresh):
        param.grad = grad
    prefix.step.tracker.restore(prefix.before.state, {ident: grad for (_, ident, _), grad in
                                                      zip(prefix.before.grads, fresh) if ident is not None})


def _another_optimizer(prefix: _Prefix, build_optimizer: Callable[[nn.Module], Any]) -> Optional[Timeline]:
    """The step `prefix` kept, with the optimizer of `build_optimizer`: the books and gradients as
    they were when the first optimizer began, this one's phase run from there in the step's
    contexts, the step closed as the first was (the same frees). None where the phase leaves other
    storages alive than the first's did: the caller traces the step whole."""
    step, tracker = prefix.step, prefix.step.tracker
    _gradients_back(prefix)
    flop_totals: Optional[List[int]] = [] if _COUNT_FLOPS[0] else None
    step.engine.optimizer_builder = build_optimizer
    with contextlib.ExitStack() as stack:
        for context in prefix.contexts(flop_totals):
            stack.enter_context(context)
        stepped = _optimizer_phase(step, build_optimizer)
        end, alive = len(tracker.events), tracker.alive_serials()
        if tracker.tokens is not None:
            prefix.logged = tracker.tokens[:len(tracker.tokens)] + list(prefix.tail_tokens)
    if alive != prefix.before.alive:
        return None
    first = prefix.timeline
    timeline = dataclasses.replace(
        first, events=tuple(tracker.events[:end]) + prefix.tail, sizes=tracker.sizes, tags=tracker.tags,
        groups=dict(first.groups, optimizer_state=frozenset(stepped.state)), optimizer_step=stepped.peak,
        optimizer_failure=stepped.failure, first_matmul=dict(tracker.first_matmul), streams=dict(tracker.streams),
        flops=prefix.before.flops + flop_totals[0] if flop_totals else None)
    return dataclasses.replace(timeline, states=_states_of(timeline, step.engine))


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


@dataclasses.dataclass
class _Shared:
    """The traces shared inside `sharing_traces`: what changes the step -> its timeline, or the
    reason it could not be traced; and what changes the step but its optimizer -> the step kept up
    to its optimizer phase (`_Prefix`)."""

    timelines: Dict[Tuple[Any, ...], Union[Timeline, UntracedStep]] = dataclasses.field(default_factory=dict)
    prefixes: Dict[Tuple[Any, ...], "_Prefix"] = dataclasses.field(default_factory=dict)


# None outside `sharing_traces`.
_SHARED: List[Optional[_Shared]] = [None]


@contextlib.contextmanager
def sharing_traces() -> Iterator[None]:
    """Trace each distinct step once inside this block: a step traced again with what changes it
    unchanged (the model, its settings, batch, sequence, precision, optimizer, checkpointing, device
    type and the GPU's compute capability) returns the first trace's timeline, so that what the
    trace does not read (the allocator's settings, the device's memory, the reserve) is answered
    again from the same timeline without a new trace. A step that differs from one traced before
    by its optimizer alone, on one process or under DDP, runs forward and backward once: its
    optimizer steps from where the first one's began (the books and gradients as they were then),
    and its timeline is the one a trace of its own gives, to the event. Nested blocks share the
    outermost's traces."""
    if _SHARED[0] is not None:
        yield
        return
    _SHARED[0] = _Shared()
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


def _keys(meta: nn.Module, settings: StepSettings, options: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """The step's key in `sharing_traces` (what changes the step; where each setting came from
    changes nothing), and the key of its forward and backward (the same, its optimizer left out)."""
    model, rest = model_fingerprint(meta), repr((sorted(options.items()), settings.compute_capability))
    # Nor do the device's memory, the reserve, the allocator's settings and the GPU's name (its
    # compute capability, which picks the attention kernels, is among the options).
    unsourced = dataclasses.replace(settings, sources={}, device_memory=None, reserve_bytes=0, alloc_conf=None, gpu=None)
    if settings.preference is not None:
        unsourced = dataclasses.replace(unsourced, preference=settings.preference.as_traced())
    return ((model, repr(unsourced), rest),
            (model, repr(dataclasses.replace(unsourced, optimizer="")), rest))


def trace_step(meta: nn.Module, settings: StepSettings, *, args: Any, step_dtype: Optional[torch.dtype],
               keep_dtypes: bool = False, quantization: Any = None) -> Timeline:
    """`trace_step_once`, or inside `sharing_traces` the timeline of the same step traced before,
    or of the same step with another optimizer stepped from where that one's optimizer began."""
    shared = _SHARED[0]
    options = dict(args=args, step_dtype=step_dtype, keep_dtypes=keep_dtypes, quantization=quantization)
    if shared is None:
        return trace_step_once(meta, settings, **options)
    key, step_key = _keys(meta, settings, options)
    found = shared.timelines.get(key)
    if found is None or (_COUNT_FLOPS[0] and isinstance(found, Timeline) and found.flops is None):
        found = _from_kept_step(shared, step_key, settings, args, settings.device_type)
        if found is None:
            try:
                found = trace_step_once(meta, settings, **options)
            except UntracedStep as error:
                found = error
        shared.timelines[key] = found
    if isinstance(found, UntracedStep):
        raise UntracedStep(str(found))
    return found


def _shares_optimizer_phases() -> bool:
    """Whether an optimizer phase may step from a kept step: on the releases where it was checked
    equal to a trace of its own, event for event (torch 2.13 with transformers 5). On the oldest
    releases allowed (torch 2.6, transformers 4.57), the allocator replay of the two differs by two
    512-byte blocks of 21 MB, so there every step is traced whole."""
    import transformers

    def release(text: str) -> Tuple[int, ...]:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())

    return release(torch.__version__) >= (2, 13) and release(transformers.__version__) >= (5, 0)


def _from_kept_step(shared: _Shared, step_key: Tuple[Any, ...], settings: StepSettings, args: Any,
                    device_type: str) -> Optional[Timeline]:
    """The timeline of the step kept under `step_key` with the optimizer `settings` name
    (`_another_optimizer`), or None where none is kept, it lacks the FLOPs asked, or its
    optimizer's phase cannot be run from it as a trace of its own would run it."""
    prefix = shared.prefixes.get(step_key)
    kept = prefix.prefixes if isinstance(prefix, _FoldedPrefix) else (prefix,) if prefix is not None else ()
    if not kept or not _shares_optimizer_phases() or any(_COUNT_FLOPS[0] and each.before.flops is None
                                                         for each in kept):
        return None
    if isinstance(prefix, _FoldedPrefix):
        timeline = _from_folded_prefix(prefix, settings, args, device_type)
    else:
        timeline = _stepped_from(prefix, settings, args, device_type)
    if timeline is None:
        del shared.prefixes[step_key]
    return timeline


def _stepped_from(prefix: _Prefix, settings: StepSettings, args: Any, device_type: str) -> Optional[Timeline]:
    """The step `prefix` kept with the optimizer `settings` name (`_another_optimizer`), noted as
    its own trace would be; None where its optimizer's phase cannot be run from it as a trace of
    its own would run it."""
    build_optimizer, implementation = _optimizer_builder(settings.optimizer, args, device_type)
    try:
        with collecting_only_what_it_makes(), contextlib.ExitStack() as stack:
            for context in prefix.outer():
                stack.enter_context(context)
            timeline = _another_optimizer(prefix, build_optimizer)
    except Exception:  # nothing a trace of its own would not meet: it meets it there
        return None
    if timeline is None:
        return None
    return _noted(timeline, prefix.quantization_note, settings, device_type, implementation[0],
                  prefix.kernel_notes)


def _from_folded_prefix(folded: _FoldedPrefix, settings: StepSettings, args: Any,
                        device_type: str) -> Optional[Timeline]:
    """The step of `folded.layers` layers with the optimizer `settings` name: that optimizer
    stepped from each kept step of fewer layers, their logs folded; None where one cannot be
    stepped so or they do not fold."""
    from trainer_memcb.plan.step.layer_fold import Recorded, fold

    recorded = []
    for prefix in folded.prefixes:
        timeline = _stepped_from(prefix, settings, args, device_type)
        if timeline is None or prefix.logged is None:
            return None
        tracker = prefix.step.tracker
        recorded.append(Recorded(timeline, prefix.logged, dict(tracker.labels), dict(tracker.companions)))
    return fold(recorded, folded.layers)


def trace_step_once(meta: nn.Module, settings: StepSettings, *, args: Any, step_dtype: Optional[torch.dtype],
                    keep_dtypes: bool = False, quantization: Any = None) -> Timeline:
    """`_trace_step_once`; with `settings.torch_compile`, the compiled step
    (`trainer_memcb.plan.step.compiled_step`) where it can be traced, and otherwise the eager step
    with a note that says why (`Timeline.compiled` says which was traced)."""
    options = dict(args=args, step_dtype=step_dtype, keep_dtypes=keep_dtypes, quantization=quantization)
    if not settings.torch_compile:
        folded = _folded(meta, settings, **options)
        return folded if folded is not None else _trace_step_once(meta, settings, **options)
    from trainer_memcb.plan.step.compiled_step import compiled_step_refusal

    refusal = compiled_step_refusal(settings)
    if not refusal:
        try:
            return _trace_step_once(meta, settings, compiled=True, **options)
        except UntracedStep as error:  # traced again eagerly: its figures are said to be the eager step's
            refusal = f"the compiled step could not be traced ({error})"
    timeline = _trace_step_once(meta, settings, **options)
    return dataclasses.replace(timeline, notes=timeline.notes + (f"torch_compile=True: {refusal}",))


def _layerless(name: str) -> str:
    """A parameter's name with its layer numbers left out: the same for each layer's."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


# While a step is folded (`_folded`): the logs of the steps traced, else None.
_RECORDING: List[Optional[List[Any]]] = [None]
# Whether steps of identical layers are folded (`trainer_memcb.plan.step.layer_fold`).
FOLD_LAYERS = [True]


def _folds_trainer(preference: Any) -> bool:
    """Whether the step of this trainer is folded: the Trainer's own, or a TRL step that folds
    (`TrlStep.folds`: DPO's, KTO's and SFT's, each checked equal to its step traced whole)."""
    return preference is None or preference.folds


def _one_process(settings: StepSettings) -> bool:
    """Whether the step runs on one process (`engine_class`'s plain engine)."""
    return engine_class(settings) is StepEngine


def _folded(meta: nn.Module, settings: StepSettings, **options: Any) -> Optional[Timeline]:
    """The step of `meta`'s identical layers folded from its steps with `FOLDED_LAYERS` of them
    (`trainer_memcb.plan.step.layer_fold`), or None where it is not folded: a model without such
    layers, a step on several processes or of TRL's GRPO or RLOO, or logs that do not fold
    (then the step is traced whole)."""
    from trainer_memcb.plan.step.layer_fold import FOLDED_LAYERS, Recorded, fold, layer_list, with_layers

    if not FOLD_LAYERS[0] or _RECORDING[0] is not None or not _folds_trainer(settings.preference):
        return None
    if not _one_process(settings):
        # The engines of several processes (`engine_for`) are traced whole: DDP's buckets fill by
        # bytes, not by layer (a fold of its logs of 1 to 3 layers wrote 6 layers' wrongly), and the
        # logs of FSDP2's and TP's do not fold.
        return None
    found = layer_list(meta)
    if found is None or len(found[2]) <= FOLDED_LAYERS[-1]:
        return None
    recorded, prefixes = [], []
    for count in FOLDED_LAYERS:
        _RECORDING[0] = []
        try:
            timeline = _trace_step_once(with_layers(meta, count), settings, prefixes=prefixes, **options)
            logs = _RECORDING[0]
        finally:
            _RECORDING[0] = None
        if len(logs) != 1:
            return None
        recorded.append(Recorded(timeline, *logs[0]))
    folded = fold(recorded, len(found[2]))
    shared = _SHARED[0]
    if folded is not None and shared is not None and len(prefixes) == len(FOLDED_LAYERS):
        # Another optimizer steps from each of the three and folds them (`_from_kept_step`).
        step_key = _keys(meta, settings, options)[1]
        shared.prefixes[step_key] = _FoldedPrefix(tuple(prefixes), len(found[2]))  # type: ignore[assignment]
    return folded


def _trace_step_once(meta: nn.Module, settings: StepSettings, *, args: Any, step_dtype: Optional[torch.dtype],
                     keep_dtypes: bool = False, quantization: Any = None, compiled: bool = False,
                     prefixes: Optional[List[_Prefix]] = None) -> Timeline:
    """Trace one training step of `meta` (a model on the meta device, made fake here) under the
    engine `settings` name (`engine_for`): the model prepared as the Trainer prepares it (quantized first when asked), the
    Trainer's optimizer for `settings.optimizer`, in `settings.precision`, with checkpointing where
    `settings.gradient_checkpointing`, a micro-batch of the settings' shape, on their device type and
    GPU (`StepSettings.compute_capability`).
    The settings are the one source of what they hold: no keyword repeats them. Inside
    `sharing_traces`, the step is kept up to its optimizer phase where another optimizer can step
    from there. With `compiled`, the forward runs as torch_compile=True compiles it.

    Returns:
        The step's timeline: every storage it created and freed, by part, each phase's peak, the
        activations, and the trace's notes (the engine's, the quantized layers', the optimizer's
        implementation).

    Raises:
        UntracedStep: the step could not run under fake tensors (data-dependent control flow, ...).
    """
    from trainer_memcb.plan.step.fake_mode import fake_tensor_mode

    shared = _SHARED[0]
    step_key = _keys(meta, settings, dict(args=args, step_dtype=step_dtype, keep_dtypes=keep_dtypes,
                                          quantization=quantization))[1] if shared is not None else None
    seq_len, device_type, padding = settings.seq_len, settings.device_type, settings.padding
    input_options = dict(target_len=settings.target_len, image_size=settings.image_size, padding=padding)
    if settings.packing is not None:
        input_options["packing"] = settings.packing
    compute_capability = settings.compute_capability
    kept: Optional[List[_Prefix]] = [] if shared is not None else None
    engine = engine_for(settings)
    mode = fake_tensor_mode()
    quantization_note = None
    kernel_runs: List[Any] = []  # the stand-in kernels' records (flash-attn's, liger-kernel's)
    preference, ref_model = settings.preference, None
    # The trace's own garbage is collected at its end; the objects older than it are not scanned.
    with collecting_only_what_it_makes():
        try:
            if preference is not None and preference.reference == "model":
                # The frozen reference, a second copy of the model (`create_model_from_path` in
                # DPOTrainer.__init__), made before the step: its parameters enter the timeline as the
                # model-states plan's reference (`Timeline.with_resident`), not as the policy's.
                ref_model = fake_copy(copy.deepcopy(meta), mode, "cpu", None if keep_dtypes else step_dtype)
                ref_model.eval()  # accelerate prepares it in evaluation mode
            model = fake_copy(meta, mode, "cpu", None if keep_dtypes else step_dtype)
            if quantization is not None:
                quantization_note = _quantized(model, mode, quantization, device_type)
            prepare_like_trainer(model, args=args, gradient_checkpointing=settings.gradient_checkpointing,
                                 checkpointing=settings.checkpointing_kwargs)
            _trl_lm_heads(model, ref_model, preference)
            build_optimizer, implementation = _optimizer_builder(settings.optimizer, args, device_type)
            with contextlib.ExitStack() as stack:
                for context in _outer_contexts(padding, settings) + kernel_stand_ins(model, settings):
                    entered = stack.enter_context(context)
                    if isinstance(entered, KernelRuns):
                        kernel_runs.append(entered)
                timeline = _trace_step(model, mode, settings.batch_size, seq_len, settings.precision, build_optimizer,
                                       settings.gradient_checkpointing, engine, input_options,
                                       settings.gradient_accumulation_steps, device_type, compute_capability, kept,
                                       preference, ref_model, compiled)
        except Exception as error:  # a forward fake tensors cannot run (data-dependent control flow, ...)
            engine.close()
            raise UntracedStep(_untraced_reason(error, settings.sharding)) from error
    kernel_notes = tuple(note for note in (run.note() for run in kernel_runs) if note)
    for prefix in kept or ():
        prefix.quantization_note, prefix.outer = quantization_note, functools.partial(_outer_contexts, padding, settings)
        prefix.kernel_notes = kernel_notes
        if prefixes is not None:  # a step of fewer layers, folded (`_folded`): kept by the caller
            prefixes.append(prefix)
        else:
            shared.prefixes[step_key] = prefix
    return _noted(timeline, quantization_note, settings, device_type, implementation[0], kernel_notes)


def _trl_lm_heads(model: nn.Module, ref_model: Optional[nn.Module], preference: Any) -> None:
    """TRL's fused LM heads on the policy and the reference, as the TRL trainer's `__init__` patches
    them (`TrlStep.fuse_lm_heads`); nothing for the Trainer's own step (`preference` None)."""
    if preference is not None:
        preference.fuse_lm_heads(model, ref_model)


def _outer_contexts(padding: int, settings: StepSettings) -> List[Any]:
    """The contexts a fake step runs in around its own, before the GPU kernels' stand-ins
    (`kernel_stand_ins`): MoE's grouped products in any dtype, the batch read as unpadded (where
    `padding` is 0; its positions as packed with `packing`), the model's value checks passed."""
    # A packed row's positions restart: transformers' packed mask is the real run's path too.
    return [grouped_mm_any_dtype(), unpadded_batch(packed=settings.packing is not None) if not padding
            else contextlib.nullcontext(), passed_checks()]


def _noted(timeline: Timeline, quantization_note: Optional[str], settings: StepSettings, device_type: str,
           implementation: Optional[str], kernel_notes: Tuple[str, ...] = ()) -> Timeline:
    """The timeline with the trace's notes beside the engine's: the quantized layers', the
    checkpointed generator states' on CUDA, the optimizer's implementation."""
    notes = list(timeline.notes) + ([quantization_note] if quantization_note else [])
    notes += list(kernel_notes)
    if settings.gradient_checkpointing and device_type == "cuda":
        notes.append("with gradient checkpointing, torch.utils.checkpoint keeps the CPU generator's state "
                     "(torch.get_rng_state(), 5,056 bytes) per block from its forward to its recomputation: "
                     "host memory on a CUDA run, not counted")
    if implementation:
        notes.append(f"optimizer traced with its {implementation} implementation, as torch runs it on {device_type}")
    return dataclasses.replace(timeline, notes=tuple(notes), optimizer_implementation=implementation)


def _quantized(model: nn.Module, mode: Any, quantization: Any, device_type: str) -> str:
    """Quantize the model's linear layers as bitsandbytes loads them; the note that says so."""
    from trainer_memcb.plan.model.quantized import quantize_linear_layers

    quantized = quantize_linear_layers(model, mode, quantization, device_type)
    if quantization.bits == 8:
        path = ("MatMul8bitFp, as bitsandbytes trains on the CPU" if device_type == "cpu" else
                f"MatMul8bitLt with the outlier columns (llm_int8_threshold {quantization.threshold:g}) "
                f"planned as none: their number is data, each adds 2 bytes per input row")
        return (f"{quantized} linear layers loaded in 8-bit (LLM.int8): their int8 codes (parameters) and fp32 "
                f"row scales (buffers) as bitsandbytes stores them, their dequantized copies as temporaries, "
                f"traced through {path}; the model-states plan counts them so, and unquantized without a step")
    return (f"{quantized} linear layers loaded in 4-bit ({quantization.quant_type}"
            f"{', double quantization' if quantization.double_quant else ''}): their packed values (parameters) "
            f"and quantization state (buffers) as bitsandbytes stores them, their dequantized copies as "
            f"temporaries; the model-states plan counts them so, and unquantized without a step" + (
            "; on the CPU, bitsandbytes' dequantization also makes int32 codes and an fp32 lookup of the "
            "whole layer inside its kernel (backends/default/ops.py, _dequantize_4bit_compute), which the "
            "trace cannot see: up to 8 bytes per value of the largest 4-bit layer, not counted"
            if device_type == "cpu" else ""))


def _optimizer_builder(name: str, args: Any, device_type: str = "cpu") -> Tuple[Callable[[nn.Module], Any], List[Optional[str]]]:
    """The Trainer's optimizer builder, and the implementation torch runs it with on `device_type`.

    torch's `_default_to_fused_or_foreach` (torch/optim/optimizer.py) picks foreach when `foreach`
    is None and every parameter is on CUDA, the single-tensor loop on the CPU; `fused=True` (the
    Trainer's `adamw_torch_fused`) is fused on both. The trace runs on fake CPU tensors, so for
    `device_type="cuda"` the groups get `foreach=True`, which runs on (fake) CPU tensors too."""
    from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer

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


