"""Will evaluation fit? Its forward's peak and what its containers gather, planned before launch.

`plan_eval_memory` answers per process what `Trainer.evaluate()` holds (transformers 4.57 to 5.x,
`Trainer.evaluation_loop` and `EvalLoopContainer` in `trainer_pt_utils.py`):

- the forward's peak: one evaluation forward (`model.eval()`, `torch.no_grad()`, the batch with its
  labels, as `prediction_step` passes it) runs under `FakeTensorMode`, nothing allocated, and
  `LiveStorages` counts the storages it creates (`trainer_memcb.plan.step.eval_forward`; the
  parameters, buffers and batch excluded): the figure a run logs as `eval_forward_peak_bytes`;
- the containers: every batch adds its loss (repeated to the eval batch size, as the loop does, and
  cut to the last batch's samples by accelerate's `gather_for_metrics`),
  its logits (every tensor the model returns but the loss and the config's
  `keys_to_ignore_at_inference`), or `argmax(-1)` of the first one with a
  `preprocess_logits_for_metrics` that takes it (int64), its labels and, with
  `include_for_metrics=["inputs"]`, its `input_ids`. On the device they are concatenated batch
  after batch (or kept in a list with `eval_do_concat_batches=False`) until
  `eval_accumulation_steps` batches have been gathered, or the loop ends; then they become numpy
  arrays on the host (bf16 as fp32), concatenated to what the host holds. The sizes come from the
  traced forward's outputs; the loop is then followed batch by batch with the same rules the run's
  probe applies (`trainer_memcb.training.evaluation_probe`), so the figures are those a run logs:
  `containers_device_bytes`, `containers_host_bytes`, `concat_peak_bytes`,
  `host_concat_peak_bytes`. Every sequence is taken `seq_len` long: a run whose batches are padded
  to different lengths holds, on top, the padding `nested_concat` adds to reach the longest.
- the device's peak during evaluation: parameters and buffers, plus what stays alive from training
  when evaluation runs inside `train()` (`resident_bytes`: the optimizer state), plus the forward's
  peak, plus the containers' concatenation peak. An upper bound: the forward's peak and a
  concatenation do not happen at the same moment (they differ by less than one batch's outputs).
  The host's peak is the containers' host concatenation peak.

Without `compute_metrics`, `evaluate()` passes `prediction_loss_only=True`: only the losses are kept
(`logits="none"` plans that).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainer_memcb.plan.model.step_inputs import step_inputs
from trainer_memcb.plan.step.eval_forward import SIXTEEN_BIT_DTYPES, EvalForward, trace_eval_forward
from trainer_memcb.utils.units import format_bytes
from trainer_memcb.utils.collector_scope import collecting_only_what_it_makes

__all__ = ["EVAL_LOGITS", "EvalSettings", "EvalMemoryPlan", "eval_settings_from_args", "plan_eval_memory",
           "containers_figures"]

# What the containers keep of the logits: as the model returns them, `argmax(-1)` (a
# `preprocess_logits_for_metrics` such as `lambda logits, labels: logits.argmax(-1)`), or nothing
# (`prediction_loss_only`, or no `compute_metrics`).
EVAL_LOGITS = ("full", "argmax", "none")
# The Trainer's mixed precision around the evaluation forward: none, bf16 or fp16 autocast.
EVAL_AUTOCAST = (None, "bf16", "fp16")
# The order in which `evaluation_loop` adds a batch to its containers.
_CONTAINERS = ("losses", "inputs", "preds", "labels")
# numpy has no bfloat16: `nested_numpify` converts to float32.
_INT64_BYTES = 8


@dataclass(frozen=True)
class EvalSettings:
    """What decides evaluation's memory, as `TrainingArguments` and the dataset give it.

    Attributes:
        batch_size: `per_device_eval_batch_size`.
        samples: evaluation samples this process sees (`len(eval_dataset)` on one process).
        seq_len: tokens per sample.
        accumulation_steps: `eval_accumulation_steps` (None: everything stays on the device until the end).
        concat_batches: `eval_do_concat_batches`.
        logits: one of `EVAL_LOGITS`.
        include_inputs: `"inputs"` in `include_for_metrics`.
        use_cache: the model config's `use_cache` during evaluation (transformers 5's Trainer sets it
            from `TrainingArguments.use_cache`, False by default: a cache holds every layer's keys
            and values through the forward); None keeps the config's (transformers 4).
        autocast: "bf16" or "fp16": the Trainer's mixed precision (`bf16=True`, `fp16=True`), which
            accelerate's `prepare_model` puts around the model's forward for evaluation too, with
            the outputs converted to float32 (`convert_outputs_to_fp32`); None: no autocast.
        model_dtype: "bf16" or "fp16": the dtype `evaluation_loop` casts the model to for an
            evaluation outside `train()` (`bf16_full_eval`, `fp16_full_eval`); None keeps the model's.
    """

    batch_size: int
    samples: int
    seq_len: int
    accumulation_steps: Optional[int] = None
    concat_batches: bool = True
    logits: str = "full"
    include_inputs: bool = False
    use_cache: Optional[bool] = None
    autocast: Optional[str] = None
    model_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "samples", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")
        steps = self.accumulation_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"accumulation_steps={steps!r}: expected a whole number of at least 1, or None")
        if self.logits not in EVAL_LOGITS:
            raise ValueError(f"logits={self.logits!r} is not one of: {', '.join(EVAL_LOGITS)}")
        for name in ("autocast", "model_dtype"):
            if getattr(self, name) not in EVAL_AUTOCAST:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of: {', '.join(map(repr, EVAL_AUTOCAST))}")


def eval_settings_from_args(args: Any, samples: int, seq_len: int, logits: Optional[str] = None,
                            in_train: bool = False) -> EvalSettings:
    """The evaluation settings a `TrainingArguments` (or any object with its names) gives.

    Args:
        args: `per_device_eval_batch_size`, `eval_accumulation_steps`, `eval_do_concat_batches`,
            `prediction_loss_only`, `include_for_metrics`, `bf16` and `fp16` are read (with a
            DeepSpeed config, no autocast: the engine runs the model in its 16-bit dtype); a missing
            one takes the Trainer's default. `bf16_full_eval` and `fp16_full_eval` cast the model for
            an evaluation outside `train()` only.
        samples, seq_len: the evaluation set's size and sequence length.
        logits: `EVAL_LOGITS`; None: `"none"` with `prediction_loss_only`, else `"full"`.
        in_train: the evaluation runs inside `train()` (the model keeps its training dtype).

    Examples:
        >>> from types import SimpleNamespace
        >>> eval_settings_from_args(SimpleNamespace(per_device_eval_batch_size=4, eval_accumulation_steps=2),
        ...                         samples=10, seq_len=16)
        EvalSettings(batch_size=4, samples=10, seq_len=16, accumulation_steps=2, concat_batches=True, logits='full', include_inputs=False, use_cache=None, autocast=None, model_dtype=None)
    """
    include = getattr(args, "include_for_metrics", None) or []
    if logits is None:
        logits = "none" if getattr(args, "prediction_loss_only", False) else "full"
    return EvalSettings(batch_size=int(getattr(args, "per_device_eval_batch_size", 8)), samples=samples,
                        seq_len=seq_len, accumulation_steps=getattr(args, "eval_accumulation_steps", None),
                        concat_batches=bool(getattr(args, "eval_do_concat_batches", True)), logits=logits,
                        include_inputs="inputs" in include, use_cache=getattr(args, "use_cache", None),
                        autocast=_autocast_of(args), model_dtype=None if in_train else _full_eval_of(args))


def _full_eval_of(args: Any) -> Optional[str]:
    # evaluation_loop: `if args.fp16_full_eval: ... elif args.bf16_full_eval: ...`
    if getattr(args, "fp16_full_eval", False):
        return "fp16"
    return "bf16" if getattr(args, "bf16_full_eval", False) else None


def _autocast_of(args: Any) -> Optional[str]:
    if getattr(args, "deepspeed", None):
        return None
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp16" if getattr(args, "fp16", False) else None


@dataclass(frozen=True)
class EvalMemoryPlan:
    """Evaluation's memory on one process (the module's docstring says what each figure is).

    Attributes:
        settings: what was planned.
        forward_peak_bytes: the forward's own peak (`eval_forward_peak_bytes`).
        containers_device_bytes, containers_host_bytes, concat_peak_bytes, host_concat_peak_bytes:
            as a run logs them.
        per_sample_bytes: per container, the bytes one sample adds (`losses`: per batch row).
        model_bytes: parameters and buffers; resident_bytes: what else stays alive (optimizer state).
        device_peak_bytes, host_peak_bytes: the peaks compared with the memories given.
        fits_device, fits_host: against `device_memory_bytes` less `reserve_bytes`, and
            `host_memory_bytes` (None: not given). With `cuda_context_bytes` (a CUDA device),
            fits_device is the allocator replay's answer: the model, the resident bytes, the batch,
            the containers at their concatenation peak and the forward's storages replayed through the
            caching allocator with the device's memory less the context and the reserve; it does not
            fit when the replay runs out.
        reserve_bytes: the user's own margin of the device's memory, beyond what is modelled.
        reserved_peak_bytes, cuda_context_bytes, device_total_bytes: that replay's reserved peak,
            the context, and their sum (what nvidia-smi shows); None without a CUDA context.
        advice: when something does not fit, one line: why, and what would make it fit.
        problem: why the forward could not be traced (then no figure), or None.

    Properties (in `to_dict` too): `usable_device_bytes`, what fits on the device is answered
    against (the device's memory less the reserve, and less the CUDA context on CUDA);
    `device_figure_bytes`, the figure compared with it (the reserved peak on CUDA, else the device
    peak); `device_margin_bytes`, the first less the second (negative: short). The table's fits?,
    its Why: line and `--fit`'s own row all say these.
    """

    model: str
    settings: EvalSettings
    forward_peak_bytes: Optional[int] = None
    containers_device_bytes: Optional[int] = None
    containers_host_bytes: Optional[int] = None
    concat_peak_bytes: Optional[int] = None
    host_concat_peak_bytes: Optional[int] = None
    per_sample_bytes: Dict[str, int] = field(default_factory=dict)
    model_bytes: Optional[int] = None
    resident_bytes: int = 0
    device_peak_bytes: Optional[int] = None
    host_peak_bytes: Optional[int] = None
    device_memory_bytes: Optional[int] = None
    host_memory_bytes: Optional[int] = None
    fits_device: Optional[bool] = None
    fits_host: Optional[bool] = None
    reserve_bytes: Optional[int] = None
    advice: List[str] = field(default_factory=list)
    problem: Optional[str] = None
    reserved_peak_bytes: Optional[int] = None
    cuda_context_bytes: Optional[int] = None
    device_total_bytes: Optional[int] = None

    @property
    def usable_device_bytes(self) -> Optional[int]:
        """The device's memory less the reserve and (on CUDA) the context; None without a memory."""
        if self.device_memory_bytes is None or self.device_peak_bytes is None:
            return None
        return self.device_memory_bytes - (self.reserve_bytes or 0) - (self.cuda_context_bytes or 0)

    @property
    def device_figure_bytes(self) -> Optional[int]:
        """What is compared with `usable_device_bytes`: the reserved peak on CUDA, else the device peak."""
        return self.reserved_peak_bytes if self.reserved_peak_bytes is not None else self.device_peak_bytes

    @property
    def device_margin_bytes(self) -> Optional[int]:
        """`usable_device_bytes - device_figure_bytes` (negative: that much short); None without a memory."""
        usable, figure = self.usable_device_bytes, self.device_figure_bytes
        return None if usable is None or figure is None else usable - figure

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "usable_device_bytes": self.usable_device_bytes,
                "device_figure_bytes": self.device_figure_bytes, "device_margin_bytes": self.device_margin_bytes}


# The names the output gives the usable bytes, on CUDA and on the CPU (the table's row, the Why:
# line and --fit's title say the same).
USABLE_LABELS = {True: "usable (device memory less CUDA context and reserve)",
                 False: "usable (device memory less reserve)"}


# -- the containers, batch by batch ----------------------------------------------------------------


class _ContainersLoop:
    """The containers of `evaluation_loop`, filled batch by batch and moved to the host every
    `eval_accumulation_steps` batches, with the peaks a run's probe logs. Its state is shared by
    the batches taken one by one and the stretches `containers_figures` adds at once, so it lives
    in one object rather than in closures over loose dicts."""

    def __init__(self, settings: EvalSettings, per_sample: Dict[str, int], loss_bytes: int,
                 bf16: Tuple[str, ...]) -> None:
        self.settings, self.per_sample, self.loss_bytes, self.bf16 = settings, per_sample, loss_bytes, bf16
        self.batches = math.ceil(settings.samples / settings.batch_size)
        self.last = settings.samples - (self.batches - 1) * settings.batch_size
        # Per container: the bytes of the storages its tensors hold, and of the values in them (they differ
        # by the last batch's losses, a view of the eval batch size's repeat); and the arrays' bytes.
        self.device = {name: 0 for name in _CONTAINERS}
        self.values = {name: 0 for name in _CONTAINERS}
        self.host = {name: 0 for name in _CONTAINERS}
        self.peaks = dict(containers_device_bytes=0, containers_host_bytes=0, concat_peak_bytes=0,
                          host_concat_peak_bytes=0)

    def host_bytes(self, name: str, values: int) -> int:
        """The bytes of `values` bytes of device tensors once numpy arrays (bfloat16 becomes float32)."""
        return values * (2 if name in self.bf16 else 1)

    def flush(self) -> None:
        """Move every container to the host, concatenated to what it holds there."""
        device, values, host, peaks = self.device, self.values, self.host, self.peaks
        for name in _CONTAINERS:
            if not device[name]:
                continue  # `tensors is None`: nothing to move
            new = self.host_bytes(name, values[name])
            concatenates = self.settings.concat_batches and host[name] > 0
            moment = sum(host.values()) + new + (host[name] + new if concatenates else 0)
            host[name] += new
            device[name] = values[name] = 0
            peaks["host_concat_peak_bytes"] = max(peaks["host_concat_peak_bytes"], moment)
            peaks["containers_host_bytes"] = max(peaks["containers_host_bytes"], sum(host.values()))

    def take(self, step: int) -> None:
        """Add batch `step`'s outputs to the containers, then flush them at the end of a cycle."""
        settings, device, values, peaks = self.settings, self.device, self.values, self.peaks
        rows = self.last if step == self.batches - 1 else settings.batch_size
        for name in _CONTAINERS:
            if name == "losses":
                if not self.loss_bytes:
                    continue
                # `losses.repeat(eval batch size)`, which accelerate's `gather_for_metrics` cuts to
                # the last batch's own samples: a view, whose storage keeps them all.
                stored, new = self.loss_bytes * settings.batch_size, self.loss_bytes * rows
            elif name in self.per_sample:
                stored = new = self.per_sample[name] * rows
            else:
                continue
            if settings.concat_batches and device[name] > 0:  # old, new and the result together
                moment = sum(device.values()) + stored + values[name] + new
                device[name] = values[name] = values[name] + new
            else:  # the first batch is kept as it is; without concatenation, the list grows
                moment = sum(device.values()) + stored
                device[name] += stored
                values[name] += new
            peaks["concat_peak_bytes"] = max(peaks["concat_peak_bytes"], moment)
            peaks["containers_device_bytes"] = max(peaks["containers_device_bytes"], sum(device.values()))
        if settings.accumulation_steps is not None and (step + 1) % settings.accumulation_steps == 0:
            self.flush()


def containers_figures(settings: EvalSettings, per_sample: Dict[str, int], loss_bytes: int,
                       bf16: Tuple[str, ...] = ()) -> Dict[str, int]:
    """The four container figures for `settings`, from the bytes a sample adds to each container.

    Args:
        settings: the evaluation.
        per_sample: `inputs`, `preds`, `labels` -> bytes per sample (a container left out keeps nothing).
        loss_bytes: bytes of one loss value (the loop keeps one per sample of each batch);
            0 when no loss is computed.
        bf16: the containers whose tensors are bfloat16 (twice the bytes on the host).

    Examples:
        >>> containers_figures(EvalSettings(batch_size=2, samples=3, seq_len=4), {"preds": 16}, 0)
        {'containers_device_bytes': 48, 'containers_host_bytes': 48, 'concat_peak_bytes': 96, 'host_concat_peak_bytes': 48}
    """
    loop = _ContainersLoop(settings, per_sample, loss_bytes, bf16)
    batches = loop.batches
    # Batches are taken one by one only near where a peak can be: every full batch adds the same
    # bytes to each container (`grows`), so each figure only grows from one full batch to the next
    # within a cycle of `eval_accumulation_steps` (or the whole evaluation), and on the host from
    # one full cycle to the next. The full batches and cycles in between are added at once, so the
    # time does not grow with the sample count (99,999,999,999,999,999,999 samples as fast as 8).
    grows = {name: (loss_bytes if name == "losses" else per_sample.get(name, 0)) * settings.batch_size
             for name in _CONTAINERS}
    full = batches if loop.last == settings.batch_size else batches - 1  # batches 0 to full - 1 are full
    cycle = settings.accumulation_steps or batches
    step = 0
    while step < batches:
        within = step % cycle
        if within == 0 and settings.accumulation_steps is not None:
            skipped = (full - step) // cycle - 2  # whole full cycles, the last two of them taken
            if skipped > 0:
                for name in _CONTAINERS:  # what a full cycle moves to the host
                    loop.host[name] += loop.host_bytes(name, skipped * cycle * grows[name])
                step += skipped * cycle
                continue
        skipped = min(full, step - within + cycle) - step - 2  # full batches of this cycle, the last two taken
        if within >= 1 and skipped > 0:  # after the cycle's first batch, which starts its containers
            for name in _CONTAINERS:
                loop.device[name] += skipped * grows[name]
                loop.values[name] += skipped * grows[name]
            step += skipped
            continue
        loop.take(step)
        step += 1
    loop.flush()
    return loop.peaks


def _per_sample(forward: EvalForward, settings: EvalSettings) -> Tuple[Dict[str, int], Tuple[str, ...]]:
    per_sample: Dict[str, int] = {}
    bf16: List[str] = []
    rows = settings.batch_size
    if settings.logits != "none" and forward.outputs:
        if settings.logits == "argmax":
            shape, _ = forward.outputs[0]
            per_sample["preds"] = math.prod(shape[:-1]) // rows * _INT64_BYTES
        else:
            per_sample["preds"] = sum(math.prod(shape) // rows * torch.empty((), dtype=dtype).element_size()
                                      for shape, dtype in forward.outputs)
            if any(dtype == torch.bfloat16 for _, dtype in forward.outputs):
                bf16.append("preds")
        if forward.labels is not None:
            shape, dtype = forward.labels
            per_sample["labels"] = math.prod(shape) // rows * torch.empty((), dtype=dtype).element_size()
    if settings.include_inputs:
        per_sample["inputs"] = settings.seq_len * _INT64_BYTES
    return per_sample, tuple(bf16)


# -- the plan ------------------------------------------------------------------------------------------


def plan_eval_memory(build_model: Callable[[], nn.Module], settings: EvalSettings, *,
                     device_memory: Optional[int] = None, host_memory: Optional[int] = None,
                     resident_bytes: int = 0, model_name: Optional[str] = None,
                     reserve_bytes: int = 0, cuda_context_bytes: Optional[int] = None,
                     alloc_conf: Any = None, compute_capability: Optional[Tuple[int, int]] = None,
                     gpu: Optional[str] = None) -> EvalMemoryPlan:
    """Plan evaluation's memory on one process.

    Args:
        build_model: makes the model on the meta device, in the dtype it evaluates in
            (`trainer_memcb.plan.optimizers.whatif.build_meta_model`); its parameters become fake ones.
        settings: `EvalSettings` (`eval_settings_from_args` reads them from `TrainingArguments`).
        device_memory, host_memory: bytes per process, for "fits?" and the advice.
        resident_bytes: device bytes alive beside the model while evaluating (the optimizer state,
            when evaluation runs inside `train()`).
        model_name: for the plan's title.
        reserve_bytes: the user's own margin of `device_memory`, beyond what is modelled: "fits?"
            is answered against `device_memory - reserve_bytes` (less the context on CUDA), as the
            step plan's.

        cuda_context_bytes: on a CUDA device, the context the process holds outside the allocator:
            fits_device then comes from the allocator replay (see `EvalMemoryPlan`); None: the
            device peak against `device_memory`.
        alloc_conf: `PYTORCH_CUDA_ALLOC_CONF` for that replay (None: torch's defaults).
        compute_capability: with `cuda_context_bytes`, the GPU's, for the attention backend it
            picks (None: `trainer_memcb.plan.device.gpus.DEFAULT_COMPUTE_CAPABILITY`). A CUDA plan
            also casts by CUDA autocast's op lists under `settings.autocast`.
        gpu: with `cuda_context_bytes`, the GPU preset's name, whose SM count flash-attn 2's
            split-KV heuristic reads (`--attn-implementation flash_attention_2`); None: an A100's.

    Raises:
        ValueError: a reserve that is not a whole number of bytes, or as large as `device_memory`.

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> def build():
        ...     with torch.device("meta"):
        ...         return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                                             num_attention_heads=2, vocab_size=100))
        >>> plan = plan_eval_memory(build, EvalSettings(batch_size=2, samples=4, seq_len=8))
        >>> plan.per_sample_bytes["preds"]  # 8 tokens x 100 logits x 4 bytes
        3200
        >>> plan.containers_device_bytes  # 4 samples of logits and int64 labels, 2 batches of 2 fp32 losses
        13072
    """
    reserve, usable = _reserved_and_usable(reserve_bytes, device_memory)
    meta = build_model()
    if settings.model_dtype is not None:  # `model.to(dtype)` in evaluation_loop, outside train()
        meta.to(dtype=SIXTEEN_BIT_DTYPES[settings.model_dtype])
    name = model_name or type(meta).__name__
    forward, problem = _trace_forward(meta, settings, cuda_context_bytes is not None, compute_capability, gpu)
    if forward is None:
        return EvalMemoryPlan(model=name, settings=settings, device_memory_bytes=device_memory,
                              host_memory_bytes=host_memory, reserve_bytes=reserve, problem=problem)
    per_sample, _ = _per_sample(forward, settings)
    same_forward = _SameForward(forward, resident_bytes, alloc_conf)
    figures = same_forward.containers(settings)
    peak = same_forward.device_peak(settings)
    host_peak = figures["host_concat_peak_bytes"]
    fits_device, allocator = _device_fit(same_forward, figures["concat_peak_bytes"], peak, usable, cuda_context_bytes)
    fits_host = None if host_memory is None else host_peak <= host_memory
    plan = EvalMemoryPlan(model=name, settings=settings, forward_peak_bytes=forward.peak_bytes,
                          per_sample_bytes={**per_sample, **({"losses": forward.loss_bytes} if forward.loss_bytes else {})},
                          model_bytes=forward.model_bytes, resident_bytes=resident_bytes, device_peak_bytes=peak,
                          host_peak_bytes=host_peak, device_memory_bytes=device_memory, host_memory_bytes=host_memory,
                          fits_device=fits_device, fits_host=fits_host, reserve_bytes=reserve, **allocator, **figures)
    advice = []
    if fits_device is False:
        advice.append(_device_advice_of(plan, same_forward, usable, cuda_context_bytes))
    if fits_host is False:
        advice.append(_host_advice(plan, same_forward.containers, host_memory))
    return replace(plan, advice=advice)


def _reserved_and_usable(reserve_bytes: int, device_memory: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """(the reserve the plan records, the device bytes "fits?" is answered against), both None
    without a device memory; a reserve that is not a whole number of bytes, or that leaves nothing,
    is refused before anything is traced."""
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise ValueError(f"reserve_bytes={reserve_bytes!r}: expected a whole number of bytes, at least 0")
    if device_memory is not None and reserve_bytes >= device_memory:
        raise ValueError(f"reserve_bytes={reserve_bytes:,} leaves nothing of device_memory={device_memory:,}")
    reserve = reserve_bytes if device_memory is not None else None
    usable = device_memory - reserve_bytes if device_memory is not None else None
    return reserve, usable


def _trace_forward(meta: nn.Module, settings: EvalSettings, cuda: bool,
                   compute_capability: Optional[Tuple[int, int]],
                   gpu: Optional[str] = None) -> Tuple[Optional[EvalForward], Optional[str]]:
    """(the evaluation forward traced under fake tensors, None) or (None, why it cannot be). What
    the model refuses outright (a length past its positions) raises before tracing; a forward fake
    tensors cannot run (data-dependent control flow, ...) becomes the plan's problem instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        step_inputs(meta, 1, settings.seq_len)
    try:
        with collecting_only_what_it_makes():  # the forward's garbage, not the whole heap
            forward = trace_eval_forward(meta, settings.batch_size, settings.seq_len, settings.use_cache,
                                         autocast=settings.autocast, device_type="cuda" if cuda else "cpu",
                                         compute_capability=compute_capability, gpu=gpu)
    except Exception as error:
        text = " ".join(str(error).split())[:300]
        return None, f"the evaluation forward cannot run under fake tensors ({type(error).__name__}: {text})"
    return forward, None


@dataclass(frozen=True)
class _SameForward:
    """The figures of any settings that run the traced forward again unchanged (another
    accumulation, other logits kept, no concatenation): the plan and its advice ask them of
    several candidates, none of which needs another trace."""

    forward: EvalForward
    resident_bytes: int
    alloc_conf: Any

    def containers(self, candidate: EvalSettings) -> Dict[str, int]:
        """`containers_figures` of `candidate`."""
        sample, halved = _per_sample(self.forward, candidate)
        return containers_figures(candidate, sample, self.forward.loss_bytes, halved)

    def device_peak(self, candidate: EvalSettings, forward_peak: Optional[int] = None) -> int:
        """The device's peak under `candidate`; `forward_peak` stands in for the traced forward's
        when the advice guesses another batch size's."""
        forward_peak = self.forward.peak_bytes if forward_peak is None else forward_peak
        return self.forward.model_bytes + self.resident_bytes + forward_peak + self.containers(candidate)["concat_peak_bytes"]

    def replay(self, concat_peak_bytes: int, limit: Optional[int]) -> Any:
        """`_replay` of this forward with the containers at `concat_peak_bytes`."""
        return _replay(self.forward, self.resident_bytes, concat_peak_bytes, self.alloc_conf, limit)


def _device_fit(same_forward: _SameForward, concat_peak_bytes: int, peak: int, usable: Optional[int],
                cuda_context_bytes: Optional[int]) -> Tuple[Optional[bool], Dict[str, Any]]:
    """(whether evaluation fits on the device, None without a memory; the allocator replay's
    figures for the plan, empty off CUDA). On a CUDA device the replay answers, under the usable
    memory less the context: the device peak alone misses what the caching allocator reserves
    beyond it."""
    fits = None if usable is None else peak <= usable
    if cuda_context_bytes is None:
        return fits, {}
    limit = None if usable is None else max(0, usable - cuda_context_bytes)
    replayed = same_forward.replay(concat_peak_bytes, limit)
    figures = dict(reserved_peak_bytes=replayed.reserved_peak_bytes, cuda_context_bytes=cuda_context_bytes,
                   device_total_bytes=replayed.reserved_peak_bytes + cuda_context_bytes)
    return (fits if limit is None else replayed.oom is None), figures


def _device_advice_of(plan: EvalMemoryPlan, same_forward: _SameForward, usable: int,
                      cuda_context_bytes: Optional[int]) -> str:
    """`_device_advice` for a plan that does not fit on the device, its candidates judged as the
    plan itself was judged: by the replay under the same limit on CUDA, else by the device peak."""
    room = usable
    if cuda_context_bytes is not None:
        # What the allocator leaves for the peak's bytes: the memory less the reserve, the
        # context and the replay's overhead (reserved beyond the device peak): the batch
        # option's guess only, said "about".
        room = usable - cuda_context_bytes - max(0, plan.reserved_peak_bytes - plan.device_peak_bytes)

    def fits(candidate: EvalSettings) -> bool:
        """The plan's own answer for settings that run the same forward (another accumulation,
        other logits kept): the replay under the same limit on CUDA, else the device peak."""
        if cuda_context_bytes is None:
            return same_forward.device_peak(candidate) <= usable
        concat = same_forward.containers(candidate)["concat_peak_bytes"]
        return same_forward.replay(concat, max(0, usable - cuda_context_bytes)).oom is None

    return _device_advice(plan, same_forward.containers, same_forward.device_peak, room, fits)


def _replay(forward: EvalForward, resident_bytes: int, concat_peak_bytes: int, alloc_conf: Any,
            limit: Optional[int]) -> Any:
    """The evaluation's allocations through the caching allocator: the model's storages, what stays
    alive from training (one block), the containers at their concatenation peak (one block, alive
    through the forward, as the device peak adds them), the batch, then the forward's storages in
    order. Replayed first with no limit; with `limit`, again under it when the first replay's
    reserved peak is above it (the allocator frees its cache before it fails)."""
    from trainer_memcb.plan.device.caching_allocator import replay_allocations

    calls: List[Tuple[Any, ...]] = [("alloc", ("model", index), nbytes) for index, nbytes in enumerate(forward.model_storages)]
    if resident_bytes:
        calls.append(("alloc", "resident", resident_bytes))
    if concat_peak_bytes:
        calls.append(("alloc", "containers", concat_peak_bytes))
    calls += [("alloc", ("batch", index), nbytes) for index, nbytes in enumerate(forward.batch_storages)]
    sizes = forward.sizes
    calls += [("alloc", event, sizes[event]) if event >= 0 else ("free", ~event) for event in forward.events]
    replay = replay_allocations(calls, alloc_conf=alloc_conf)
    if limit is not None and replay.reserved_peak_bytes > limit:
        limited = replay_allocations(calls, alloc_conf=alloc_conf, device_memory=limit)
        if limited.oom is not None:
            return replace(limited, reserved_peak_bytes=replay.reserved_peak_bytes)
        return limited
    return replay


def _device_advice(plan: EvalMemoryPlan, figures_for: Callable[[EvalSettings], Dict[str, int]],
                   device_peak: Callable[..., int], memory: int, fits: Callable[[EvalSettings], bool]) -> str:
    """Why evaluation does not fit, against the figures the table shows (the reserved or device
    peak, the usable bytes, named as the table names them), and what would make it fit: the
    accumulation and the logits kept only where the plan's own answer for them is "fits"; the
    batch, which needs another forward, a guess from `memory` said "about"."""
    settings = plan.settings
    figure = "reserved peak" if plan.reserved_peak_bytes is not None else "device peak"
    usable = USABLE_LABELS[plan.reserved_peak_bytes is not None]
    why = (f"evaluation's {figure} is {format_bytes(plan.device_figure_bytes)}, "
           f"{format_bytes(-plan.device_margin_bytes)} more than the {format_bytes(plan.usable_device_bytes)} {usable}: "
           f"the containers' {format_bytes(plan.concat_peak_bytes)} at their concatenation peak "
           f"(logits {plan.per_sample_bytes.get('preds', 0):,} bytes per sample) and the forward's "
           f"{format_bytes(plan.forward_peak_bytes)}")
    options = []
    batches = math.ceil(settings.samples / settings.batch_size)
    for steps in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if steps > batches:
            break
        candidate = replace(settings, accumulation_steps=steps)
        if fits(candidate):
            if settings.accumulation_steps is None or steps < settings.accumulation_steps:
                host = figures_for(candidate)["host_concat_peak_bytes"]
                options.append(f"eval_accumulation_steps={steps} (then {format_bytes(host)} on the host)")
            break
    if settings.logits == "full" and "preds" in plan.per_sample_bytes:
        argmax = replace(settings, logits="argmax")
        saved = plan.concat_peak_bytes - figures_for(argmax)["concat_peak_bytes"]
        if saved > 0 and fits(argmax):
            options.append(f"preprocess_logits_for_metrics returning logits.argmax(-1) (saves {format_bytes(saved)})")
    if settings.batch_size > 1:
        # The forward's peak grows with the batch: about proportionally, which this assumes.
        for batch in range(settings.batch_size - 1, 0, -1):
            candidate = replace(settings, batch_size=batch)
            if device_peak(candidate, plan.forward_peak_bytes * batch // settings.batch_size) <= memory:
                options.append(f"per_device_eval_batch_size={batch} (about)")
                break
    return why + (": try " + ", or ".join(options) if options else "; no eval setting alone makes it fit")


def _host_advice(plan: EvalMemoryPlan, figures_for: Callable[[EvalSettings], Dict[str, int]], memory: int) -> str:
    settings = plan.settings
    why = (f"evaluation needs {format_bytes(plan.host_peak_bytes)} on the host, "
           f"{format_bytes(plan.host_peak_bytes - memory)} more than the host memory {format_bytes(memory)}: the "
           f"containers' arrays at their concatenation peak")
    options = []
    if settings.concat_batches:
        flat = figures_for(replace(settings, concat_batches=False))["host_concat_peak_bytes"]
        if flat <= memory:
            options.append(f"eval_do_concat_batches=False (then {format_bytes(flat)}; compute_metrics gets lists)")
    if settings.logits == "full" and "preds" in plan.per_sample_bytes:
        argmax = figures_for(replace(settings, logits="argmax"))["host_concat_peak_bytes"]
        options.append(f"preprocess_logits_for_metrics returning logits.argmax(-1) (then {format_bytes(argmax)})")
    return why + (": try " + ", or ".join(options) if options else "; fewer evaluation samples per call")
