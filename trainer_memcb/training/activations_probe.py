"""Activations measured in a run: what autograd saves for backward in a logged step's forward.

`ActivationsProbe` is armed at the start of an optimizer step that will be logged and disarmed
before that step's optimizer update. While armed, every forward of the model runs inside a
`trainer_memcb.state.saved_tensors.SavedTensorsCounter` that excludes the model's parameters. A
forward that begins while what an earlier forward saved is still alive (R-Drop or a contrastive
loss: two forwards with gradients, then one backward) runs in that forward's counter: they are
counted together, each storage once (the batch both read is counted once), which is what the
micro-batch's backward will need. A forward that begins when everything saved has been released
(a backward ran) starts a fresh counter, which replaces the earlier one, so with gradient
accumulation the last micro-batch before the optimizer step is the one reported. (A graph kept
past its backward, `retain_graph=True`, keeps the next micro-batch in the same count.)

| key | unit | meaning |
|---|---|---|
| `activations_bytes` | bytes | storages saved for backward by the last micro-batch's forwards, still saved at the end of its last forward, each storage once, parameters excluded |
| `activations_peak_bytes` | bytes | the most of those saved bytes alive at any moment of that micro-batch's forwards and backward |
| `device_peak_allocated_bytes` | bytes | on CUDA only: `torch.cuda.max_memory_allocated` of the model's device, read when the step is logged |
| `device_peak_reserved_bytes` | bytes | on CUDA only: `torch.cuda.max_memory_reserved` of that device, read with it |

What is counted is the counter's business (`trainer_memcb.state.saved_tensors`, watching
checkpoint's recomputation). With gradient checkpointing (non-reentrant, the Trainer's default in
transformers 5), `activations_bytes` is what is saved outside the checkpointed blocks plus each
block's saved positional inputs, alive at the end of forward, and `activations_peak_bytes` also
covers the tensors each block's recomputation holds during backward. With reentrant checkpointing
(transformers 4's default) the blocks save their inputs outside as well, and their recomputation
runs after the counter has left, so the peak is the forward's. The CUDA peak is the caching
allocator's since the process started or since its statistics were last reset; the probe resets
them (`torch.cuda.reset_peak_memory_stats`) at the start of each logged step only when asked
(`reset_device_peak=True`), since they are global and other code may be reading them.

The parameters excluded are the storages the model's parameters have when the step is armed: with
FSDP or DeepSpeed ZeRO-3 those are the shards, and a full parameter gathered for the forward and
saved for backward (a linear layer's weight) is counted as an activation.

How a forward is delimited: while armed, the model's `forward` attribute is a wrapper that enters
the counter, calls the forward it replaced, and exits the counter, in a `try` of its own, so that a
forward that raises leaves no hooks behind (the wrapper is removed there and then). Module hooks
cannot promise that: a forward hook that runs after a failed forward cannot remove itself without
corrupting the exception torch is about to raise. The wrapper is removed when the step is
disarmed, and nothing is installed on a step that is not logged. A step that raises after its
forwards (an out-of-memory error in backward, a failing optimizer step) never reaches the disarm:
the Trainer callback removes the wrapper when `Trainer.train` leaves (`trainer_train_hook.py`),
the loop logger in `close()` (or at the end of its `with` block). The wrapper is marked
(`WRAPPER_MARK`: what it replaced, and its probe, held weakly), so that a wrapper of ours left on a
model anyway is recognised as ours and taken off when any probe arms on that model
(`remove_stale_wrappers`): the forward wrapped is always the user's own, and a stale wrapper, or
one left inside someone else's, only calls through.

A Trainer nested in another's step (a `training_step` or a callback that trains another Trainer,
on the same model or not): each probe is armed with the `Trainer.train` call it measures for
(`trainer_train_hook.current_train_call`) and counts only the forwards that run while that call
is the innermost one under way, so the nested run's forwards never enter the outer step's figures.
A wrapper of a probe whose call is still under way is not stale: a nested probe arming on the same
model wraps on top of it, and puts it back when it disarms.

A compiled model is not measured: with the Trainer's `torch_compile` (the callback is handed the
model, but the Trainer runs its compiled wrapper), a `torch.compile(model)`, or `model.compile()`,
or a model holding a compiled module, the probe installs nothing and one warning says that the
keys are left out. Dynamo would have to
trace the wrapper and the counter's Python hooks: under `fullgraph` it cannot (the run would
fail), without it the graph splits around them, and every change of `model.forward` recompiles.
A forward reached while dynamo traces (a model compiled inside another after arming) calls
straight through.

It needs torch 2.8 or newer (`torch._C._autograd._top_saved_tensors_default_hooks`, to see saved-
tensor hooks of the user's own); on an older torch one warning says so and the keys are left out.
It never breaks a run: a failure warns once (through the caller's `warn_once`) and the keys are
left out. A forward that runs under saved-tensors hooks of the user's own (`save_on_cpu`) still
reaches them: the counter calls them and counts what their packed values hold.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from trainer_memcb.state.saved_tensors import SavedTensorsCounter
from trainer_memcb.utils.compiled import has_compiled_part, is_compiled
from trainer_memcb.training.instance_forward import NO_INSTANCE_FORWARD, instance_forward, put_back_forward
from trainer_memcb.training.trainer_train_hook import current_train_call, is_running
from trainer_memcb.training.figures import (
    ACTIVATIONS_BYTES,
    ACTIVATIONS_PEAK_BYTES,
    ACTIVATION_KEYS,
    DEVICE_PEAK_ALLOCATED_BYTES,
    DEVICE_PEAK_RESERVED_BYTES,
)

__all__ = [
    "ACTIVATIONS_SUPPORTED",
    "WRAPPER_MARK",
    "ActivationsProbe",
    "COMPILED_MESSAGE",
    "is_activations_wrapper",
    "remove_stale_wrappers",
    "trainer_logs_step",
    "validate_activation_options",
    "without_activation_keys",
]

# Whether this torch says which saved-tensor hooks are active (`_top_saved_tensors_default_hooks`,
# torch 2.8 and newer): the counter needs it to keep hooks of the user's own working. On an older
# torch the activations are left out, with one warning.
ACTIVATIONS_SUPPORTED = hasattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks")
COMPILED_MESSAGE = "the activations of a compiled model (torch.compile) are not measured; they are left out"
UNSUPPORTED_MESSAGE = (f"trainer_memcb: this torch ({torch.__version__}) cannot say which saved-tensor hooks are "
                       "active, which measuring the activations needs (torch 2.8 and newer can); they are left out")
logger = logging.getLogger(__name__)
# An attribute on the wrapper that the model's `forward` is while armed, so that it can be told apart
# from the user's own forward: a `_Mark` saying what it replaced and whose it is.
WRAPPER_MARK = "__trainer_memcb_activations__"
# How many wrappers of ours, one inside the other, `arm` takes off a model at most.
_MAX_STALE_WRAPPERS = 8


class _Mark:
    """Carried by the wrapper (as `WRAPPER_MARK`): the `forward` instance attribute it replaced
    (`NO_INSTANCE_FORWARD`: none, the class's forward applied) and the probe it belongs to, weakly."""

    __slots__ = ("replaced", "probe")

    def __init__(self, replaced: Any, probe: "weakref.ReferenceType[ActivationsProbe]") -> None:
        self.replaced = replaced
        self.probe = probe


def is_activations_wrapper(value: Any) -> bool:
    """Whether `value` (a model's `forward`) is a probe's wrapper: by its mark, never by its name."""
    return isinstance(getattr(value, WRAPPER_MARK, None), _Mark)


def remove_stale_wrappers(model: Any) -> None:
    """Take every wrapper of ours off `model.forward`, putting back what each replaced.

    A wrapper is left behind only where no code of ours ran after a failure (a step that raised
    in a loop that never called `close()`, a Trainer whose `train` bypasses the hook): the next
    probe must wrap the user's forward, never ours. A wrapper whose probe's `Trainer.train` call
    is still under way is not stale (a Trainer nested in that step): it and those inside it stay. Its probe, if alive, is disarmed too, so that
    its counters stop watching checkpoint's recomputation."""
    for _ in range(_MAX_STALE_WRAPPERS):
        current = instance_forward(model)
        if not is_activations_wrapper(current):
            return
        mark = getattr(current, WRAPPER_MARK)
        owner = mark.probe()
        if owner is not None and owner._wrapper is current:
            if owner._call is not None and is_running(owner._call):
                return  # the step of a Trainer still training (this one is nested in it): not stale
            owner.disarm()
        put_back_forward(model, current, mark.replaced)


def validate_activation_options(activations: Any, reset_device_peak: Any) -> None:
    """`ValueError` naming a bad value and what is allowed."""
    if not isinstance(activations, bool):
        raise ValueError(f"activations={activations!r}: expected True (measure the activations on logged "
                         "steps) or False (do not)")
    if not isinstance(reset_device_peak, bool):
        raise ValueError(f"reset_device_peak={reset_device_peak!r}: expected True (reset CUDA's peak "
                         "statistics at the start of each logged step) or False (never reset them)")


def without_activation_keys(figures: Dict[str, int]) -> Dict[str, int]:
    """The figures without the activation keys (evaluation entries do not carry them)."""
    return {key: value for key, value in figures.items() if key not in ACTIVATION_KEYS}


def _value(setting: Any) -> str:
    """An `IntervalStrategy` or its string, as its string."""
    return str(getattr(setting, "value", setting))


def trainer_logs_step(args: Any, state: Any, step: int, train_dataloader: Any = None) -> bool:
    """Whether the Trainer will log after optimizer step `step` (`state.global_step` once it is done).

    The Trainer decides in `DefaultFlowCallback.on_step_end` (transformers 4.57 to 5.x): the first
    step with `logging_first_step`; every `logging_steps`-th step with the "steps" strategy; the
    last step of each epoch, and the last step of the run, with the "epoch" strategy. A callback
    that sets `control.should_log` itself cannot be foreseen: such a step is logged without the
    activation keys.
    """
    if step == 1 and getattr(args, "logging_first_step", False):
        return True
    strategy = _value(getattr(args, "logging_strategy", "steps"))
    if strategy == "steps":
        every = getattr(state, "logging_steps", None) or getattr(args, "logging_steps", 0)
        every = int(every) if every else 0
        return every >= 1 and step % every == 0
    if strategy == "epoch":
        max_steps = getattr(state, "max_steps", 0) or 0
        if max_steps and step >= max_steps:
            return True
        per_epoch = _updates_per_epoch(args, train_dataloader)
        return per_epoch is not None and step % per_epoch == 0
    return False


def _updates_per_epoch(args: Any, train_dataloader: Any) -> Optional[int]:
    """Optimizer steps in an epoch, as the Trainer counts them (a last, shorter accumulation counts)."""
    try:
        batches = len(train_dataloader)
    except TypeError:  # None, or an iterable dataset: the run's last step is all that is known
        return None
    accumulation = max(int(getattr(args, "gradient_accumulation_steps", 1) or 1), 1)
    return max(batches // accumulation + int(batches % accumulation > 0), 1)


def _nothing() -> None:
    return None


def _close(counter: Optional[SavedTensorsCounter]) -> None:
    """Stop the counter watching checkpoint's recomputation (a class it wraps while it watches)."""
    if counter is None:
        return
    try:
        counter.close()
    except Exception:  # nothing of the run depends on it; the counter's own __del__ tries again
        pass


class ActivationsProbe:
    """Measures the activations of the optimizer steps it is armed for.

    Args:
        enabled: False makes every method a no-op.
        reset_device_peak: reset CUDA's peak statistics at the start of each logged step.
        warn_once: `warn_once(kind, message)`, the caller's warning that is given once per kind.

    Examples:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> probe = ActivationsProbe()
        >>> probe.arm(model, step=1)
        >>> model(torch.ones(2, 4)).sum().backward()  # saves the input (for the weight's gradient), relu's output
        >>> probe.before_optimizer_step()
        >>> probe.figures(1)  # two 2x4 fp32 tensors
        {'activations_bytes': 64, 'activations_peak_bytes': 64}
        >>> "forward" in model.__dict__  # disarmed: the model's own forward again
        False
    """

    def __init__(self, enabled: bool = True, reset_device_peak: bool = False,
                 warn_once: Optional[Callable[[str, str], None]] = None) -> None:
        validate_activation_options(enabled, reset_device_peak)
        self.enabled = enabled
        self.reset_device_peak = reset_device_peak
        self._warn_once = warn_once or (lambda kind, message: None)
        self._said_unsupported = False
        # While armed: the model (weakly), its forward wrapper and what it replaced, the
        # parameters to exclude, the step the figures are for, the device of a CUDA model.
        self._model: Callable[[], Any] = _nothing
        self._wrapper: Any = None
        self._replaced: Any = NO_INSTANCE_FORWARD
        self._params: List[torch.Tensor] = []
        self._step: Optional[int] = None
        self._cuda_device: Optional[torch.device] = None
        # The `Trainer.train` call the step belongs to (None: no Trainer, a custom loop).
        self._call: Optional[object] = None
        # Whether the model measured last holds a compiled module, found with its parameters.
        self._param_compiled = False
        # The counter of a forward under way, and of the last forward that finished.
        self._active: Optional[SavedTensorsCounter] = None
        self._last: Optional[SavedTensorsCounter] = None
        # The parameters of the model measured last, held weakly, so that a step does not walk the
        # model's modules again (`forget` drops them: at the start and end of a run).
        self._param_owner: Callable[[], Any] = _nothing
        self._param_refs: List[Any] = []
        # The figures of the last measured step, and that step.
        self._figures: Dict[str, int] = {}
        self._figures_step: Optional[int] = None

    @property
    def armed(self) -> bool:
        return self._wrapper is not None

    # -- the step's life -------------------------------------------------------------------------

    def arm(self, model: Any, step: int, compiled: bool = False, in_train_call: bool = False) -> None:
        """Measure the forwards of the model until `before_optimizer_step`, for step `step`.

        Args:
            model: the model whose forwards are measured.
            step: the optimizer step the figures are for.
            compiled: the caller knows the model runs compiled (the Trainer's `torch_compile`,
                which compiles a wrapper the callback never sees): nothing is measured.
            in_train_call: the step belongs to the innermost `Trainer.train` call under way (the
                callback's steps): only forwards while that call is the innermost are measured.
        """
        self.disarm()
        if not self.enabled or model is None:
            return
        try:
            self._call = current_train_call() if in_train_call else None
            self._arm(model, step, compiled)
        except Exception as error:  # never break training over a figure
            self.disarm()
            self._warn_once("activations", f"measuring the activations failed ({error!r}); they are left out")

    def _arm(self, model: torch.nn.Module, step: int, compiled: bool) -> None:
        if not ACTIVATIONS_SUPPORTED:
            # A documented limit of the installed torch, not a failure of this run: said once, at
            # INFO, so that every run on torch 2.6 or 2.7 does not raise a warning.
            if not self._said_unsupported:
                self._said_unsupported = True
                logger.info(UNSUPPORTED_MESSAGE)
            return
        remove_stale_wrappers(model)
        if compiled or is_compiled(model) or torch.compiler.is_compiling():
            # Dynamo would trace the wrapper and the counter: it cannot with fullgraph, splits the
            # graph without, and recompiles whenever `model.forward` changes. Left out, said once.
            self._warn_once("activations-compiled", COMPILED_MESSAGE)
            return
        self._params = self._parameters(model)
        if self._param_compiled:  # a compiled module inside: dynamo would trace the counter's hooks
            self._params = []
            self._warn_once("activations-compiled", COMPILED_MESSAGE)
            return
        device = self._params[0].device if self._params else torch.device("cpu")
        self._cuda_device = device if device.type == "cuda" else None
        if self._cuda_device is not None and self.reset_device_peak:
            torch.cuda.reset_peak_memory_stats(self._cuda_device)  # asked for by the user
        self._step = step
        self._model = weakref.ref(model)
        self._replaced = instance_forward(model)
        self._wrapper = self._measuring(model.forward, self._replaced)
        model.forward = self._wrapper

    def _parameters(self, model: torch.nn.Module) -> List[torch.Tensor]:
        """The model's parameters: as found at its first step since `forget`, while they all live."""
        if self._param_owner() is model:
            params = [ref() for ref in self._param_refs]
            if all(param is not None for param in params):
                return params  # type: ignore[return-value]
        params = list(model.parameters())
        self._param_owner, self._param_refs = weakref.ref(model), [weakref.ref(param) for param in params]
        self._param_compiled = has_compiled_part(model)
        return params

    def forget(self) -> None:
        """Disarm, and find the model's parameters again at the next step (a run starts or ends)."""
        self.disarm()
        self._param_owner, self._param_refs = _nothing, []

    def _measuring(self, forward: Callable[..., Any], replaced: Any) -> Callable[..., Any]:
        # The wrapper holds its probe weakly: one left behind keeps no probe (nor its counters) alive.
        owner = weakref.ref(self)

        @functools.wraps(forward)
        def measured_forward(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # compiled after arming: traced, never measured
                return forward(*args, **kwargs)
            probe = owner()
            counter = probe._start(measured_forward) if probe is not None else None
            if counter is None:
                return forward(*args, **kwargs)
            try:
                output = forward(*args, **kwargs)
            except BaseException:
                probe._stop(counter, failed=True)  # type: ignore[union-attr]
                raise
            probe._stop(counter, failed=False)  # type: ignore[union-attr]
            return output

        setattr(measured_forward, WRAPPER_MARK, _Mark(replaced, owner))
        return measured_forward

    def _start(self, wrapper: Any) -> Optional[SavedTensorsCounter]:
        if self._wrapper is not wrapper or self._active is not None or not torch.is_grad_enabled():
            return None  # disarmed (or a stale wrapper), a nested call, or a forward saving nothing
        if self._call is not None and current_train_call() is not self._call:
            return None  # a Trainer nested in this step runs the forward: not this step's
        # A forward while what an earlier one saved is still alive belongs to the same micro-batch
        # (R-Drop, a contrastive loss: backward has not run yet): counted together, in its counter.
        # After a backward everything saved is released, and the next forward starts afresh.
        counter = self._last if self._last is not None and self._last.alive_bytes > 0 else None
        try:
            if counter is None:
                counter = SavedTensorsCounter(exclude=self._params, watch_recomputation=True)
            counter.__enter__()
        except Exception as error:  # never break training over a figure
            self._warn_once("activations", f"measuring the activations failed ({error!r}); they are left out")
            return None
        self._active = counter
        return counter

    def _stop(self, counter: SavedTensorsCounter, failed: bool) -> None:
        self._active = None
        try:
            counter.__exit__(None, None, None)
        except Exception as error:  # never break training over a figure
            self._warn_once("activations", f"measuring the activations failed ({error!r}); they are left out")
            failed = True
        if failed:  # the forward raised: nothing of this step is reported, and nothing stays installed
            _close(counter)
            self.disarm()
        elif counter is not self._last:  # a later micro-batch's counter replaces an earlier one's
            earlier, self._last = self._last, counter
            _close(earlier)

    def before_optimizer_step(self) -> None:
        """The step's forwards and backwards are done: keep the last micro-batch's figures, disarm."""
        if self._wrapper is None:
            return
        counter, step = self._last, self._step
        self.disarm()
        if counter is None:
            return
        try:
            figures = {ACTIVATIONS_BYTES: int(counter.saved_bytes), ACTIVATIONS_PEAK_BYTES: int(counter.peak_bytes)}
        except Exception as error:  # never break training over a figure
            self._warn_once("activations", f"measuring the activations failed ({error!r}); they are left out")
            return
        finally:
            _close(counter)
        if getattr(counter, "counting", True):
            self._figures, self._figures_step = figures, step

    def disarm(self) -> None:
        """Put the model's own forward back and drop the step's counters; safe to call at any time."""
        model = self._model()
        wrapper, replaced = self._wrapper, self._replaced
        counters = (self._active, self._last)
        self._model, self._wrapper, self._replaced = _nothing, None, NO_INSTANCE_FORWARD
        self._params, self._active, self._last, self._call = [], None, None, None
        for counter in counters:
            _close(counter)
        if model is None or wrapper is None:
            return
        try:
            # If someone wrapped the forward again while armed, the wrapper stays inside theirs, and
            # does nothing now that the probe is disarmed.
            put_back_forward(model, wrapper, replaced)
        except Exception as error:  # never break training over a figure
            self._warn_once("activations", f"removing the activations wrapper failed ({error!r})")

    # -- the figures -----------------------------------------------------------------------------

    def figures(self, step: Optional[int]) -> Dict[str, int]:
        """The keys measured for `step`, or `{}`. On CUDA the allocator's peak is read now (host-side
        statistics, no device sync), so that it covers the optimizer update too."""
        if not self._figures or step is None or step != self._figures_step:
            return {}
        if self._cuda_device is not None and DEVICE_PEAK_ALLOCATED_BYTES not in self._figures:
            try:
                # Host-side counters of the caching allocator: what tensors held, and what its
                # segments held (what an out-of-memory error is about), both read together.
                self._figures.update({
                    DEVICE_PEAK_ALLOCATED_BYTES: int(torch.cuda.max_memory_allocated(self._cuda_device)),
                    DEVICE_PEAK_RESERVED_BYTES: int(torch.cuda.max_memory_reserved(self._cuda_device))})
            except Exception as error:  # never break training over a figure
                self._warn_once("device-peak", f"reading the CUDA peak failed ({error!r}); it is left out")
        return dict(self._figures)

    def latest(self) -> Optional[Dict[str, int]]:
        """The last measured step's figures and that `step`, for the end-of-run summary; None before any."""
        if not self._figures or self._figures_step is None:
            return None
        return {"step": self._figures_step, **self._figures}

    def relabel(self, old_step: Optional[int], new_step: Optional[int]) -> None:
        """The figures measured for `old_step` are logged at `new_step` (a loop that counts its own steps)."""
        if self._figures and old_step == self._figures_step:
            self._figures_step = new_step
