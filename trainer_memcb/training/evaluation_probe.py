"""Evaluation's memory measured in a run: what `Trainer.evaluation_loop` gathers, and its first forward.

`EvaluationProbe` is armed when an evaluation loop starts and disarmed when it ends
(`trainer_memcb.training.evaluation_hook` calls it, the loop raising or not). While armed it sees
every `EvalLoopContainer.add` and `EvalLoopContainer.to_cpu_and_numpy`
(`transformers/trainer_pt_utils.py`) through wrappers put on that class for the loop's duration
only, and the first forward of the model under `no_grad` through a wrapper on the model's
`forward`. The wrappers read shapes, dtypes and storages and call the original with the same
arguments: nothing is copied, synced or changed. Evaluation entries then carry, with their prefix
(`eval_containers_device_bytes`, ...):

| key | unit | meaning |
|---|---|---|
| `containers_device_bytes` | bytes | the most the loop's containers held at once as torch tensors (losses, logits or what `preprocess_logits_for_metrics` returns, labels, inputs with `include_for_metrics`), each storage once |
| `containers_host_bytes` | bytes | the most they held at once as numpy arrays, on the host (after `eval_accumulation_steps` batches, and at the loop's end) |
| `concat_peak_bytes` | bytes | the most the containers held during an `add`: every container's tensors, the batch being added, and the concatenation's result, each storage once (with `eval_do_concat_batches=False`, no result: the list grows) |
| `host_concat_peak_bytes` | bytes | the same on the host, during `to_cpu_and_numpy`: the arrays held, the new arrays (from the tensors' shapes: bf16 becomes fp32), and the concatenation's result |
| `forward_peak_bytes` | bytes | the most bytes alive at once, of the storages the evaluation's first forward creates (its parameters, buffers and inputs excluded), counted by `trainer_memcb.plan.step.live_storages.LiveStorages` |

What `concat_peak_bytes` leaves out: the batch's tensors not yet added (the loop's `labels` while
the logits are concatenated) belong to the forward, not to the containers. What
`forward_peak_bytes` counts is storages, each with its full size, from the moment an operation
returns it until its last tensor is gone: on the CPU, what the allocator holds for the forward's
tensors (the kernels' own scratch buffers are not tensors and are not seen); on CUDA, the caching
allocator's rounding and the kernels' workspaces are not counted either. Only the first forward of
each evaluation runs under that counter (a dispatch mode, some microseconds per operation); the
others run as they are. The legacy `prediction_loop` (`use_legacy_prediction_loop=True`) has no
containers and is not measured.

A compiled model's forward is not measured (`forward_peak_bytes` is left out, with one warning):
with the Trainer's `torch_compile`, a `torch.compile(model)`, `model.compile()`, or a compiled
module inside the model. The counter is a dispatch mode, and dynamo skips a frame it meets under
one, for good: the model would run uncompiled for the rest of the run
(`trainer_memcb.utils.compiled`). The counter also declares that it ignores compile internals
(`TorchDispatchMode.ignore_compile_internals`), so that a compiled function that no module shows
(called from inside the forward) is compiled and run as without it; what that function allocates
is then not seen. A torch that cannot declare it (torch 2.6) would still skip such a function:
there, once dynamo has compiled anything in the process, the forward is not measured either (one
warning); a compiled function first called inside an evaluation is not known to it, and runs
uncompiled after that evaluation. The containers are measured as for any model: their wrappers are
on the containers' class, outside the forward.

Nested loops (a `compute_metrics`, or a callback, that evaluates another model inside this loop):
the container calls belong to the innermost loop running, and each loop's figures are its own.

Nothing is measured outside an evaluation loop. A failure warns once (through the caller's
`warn_once`) and its keys are left out; the loop itself is never affected.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from trainer_memcb.plan.step.live_storages import LiveStorages
from trainer_memcb.state.eval_containers import device_blocks, host_blocks, numpified_bytes
from trainer_memcb.state.saved_tensors import storages_of
from trainer_memcb.training.instance_forward import NO_INSTANCE_FORWARD, instance_forward, put_back_forward
from trainer_memcb.utils.compiled import dispatch_modes_stop_compiling, has_compiled_part
from trainer_memcb.training.figures import (
    CONCAT_PEAK_BYTES,
    CONTAINERS_DEVICE_BYTES,
    CONTAINERS_HOST_BYTES,
    EVALUATION_KEYS,
    FORWARD_PEAK_BYTES,
    HOST_CONCAT_PEAK_BYTES,
)

__all__ = [
    "CONTAINERS_DEVICE_BYTES",
    "CONTAINERS_HOST_BYTES",
    "CONCAT_PEAK_BYTES",
    "HOST_CONCAT_PEAK_BYTES",
    "FORWARD_PEAK_BYTES",
    "EVALUATION_KEYS",
    "EvaluationProbe",
    "COMPILED_FORWARD_MESSAGE",
]

COMPILING_FORWARD_MESSAGE = (f"this torch ({torch.__version__}) cannot measure the evaluation's forward without "
                             "keeping the torch.compile'd code it may call from compiling (newer torch can); "
                             "forward_peak_bytes is left out")
COMPILED_FORWARD_MESSAGE = ("the evaluation's forward peak of a compiled model (torch.compile) is not measured; "
                            "forward_peak_bytes is left out")


Blocks = Dict[Tuple[str, int], int]
# The probes armed now, in the order their loops started. Loops nest (an evaluation run from inside
# another's `compute_metrics`): the innermost loop running, the last armed, is the one whose
# containers are being filled, so only it is told.
_ARMED: List["EvaluationProbe"] = []
# What the container wrappers replaced, while any probe is armed.
_REPLACED: Dict[str, Any] = {}


class _Held:
    """Blocks held by the containers, each once however many containers hold it, and their sum."""

    def __init__(self) -> None:
        self.count: Dict[Tuple[str, int], int] = {}
        self.sizes: Dict[Tuple[str, int], int] = {}
        self.total = 0

    def add(self, blocks: Blocks) -> None:
        for key, nbytes in blocks.items():
            count = self.count.get(key, 0)
            if not count:
                self.sizes[key] = nbytes
                self.total += nbytes
            self.count[key] = count + 1

    def remove(self, blocks: Blocks) -> None:
        for key in blocks:
            count = self.count.get(key, 0) - 1
            if count > 0:
                self.count[key] = count
            elif count == 0:
                del self.count[key]
                self.total -= self.sizes.pop(key)

    def extra(self, blocks: Blocks, also: Optional[Blocks] = None) -> int:
        """Bytes of `blocks` neither held nor in `also`."""
        return sum(nbytes for key, nbytes in blocks.items() if key not in self.count and (also is None or key not in also))


class _Container:
    """What the probe knows of one container: its blocks on the device and on the host."""

    __slots__ = ("container", "device", "host")

    def __init__(self, container: Any) -> None:
        self.container = container  # held for the loop's duration only, so that its id is not reused
        self.device: Blocks = {}
        self.host: Blocks = {}


def _install() -> None:
    from transformers.trainer_pt_utils import EvalLoopContainer

    add, flush = EvalLoopContainer.add, EvalLoopContainer.to_cpu_and_numpy

    @functools.wraps(add)
    def measured_add(self: Any, tensors: Any) -> None:
        probe = _ARMED[-1] if _ARMED else None
        if probe is None:
            return add(self, tensors)
        pending = probe._before_add(self, tensors)
        add(self, tensors)
        probe._after_add(self, pending)

    @functools.wraps(flush)
    def measured_flush(self: Any) -> None:
        probe = _ARMED[-1] if _ARMED else None
        if probe is None:
            return flush(self)
        pending = probe._before_flush(self)
        flush(self)
        probe._after_flush(self, pending)

    _REPLACED.update(add=add, to_cpu_and_numpy=flush, cls=EvalLoopContainer)
    EvalLoopContainer.add, EvalLoopContainer.to_cpu_and_numpy = measured_add, measured_flush


def _remove() -> None:
    cls = _REPLACED.pop("cls", None)
    if cls is not None:
        cls.add, cls.to_cpu_and_numpy = _REPLACED.pop("add"), _REPLACED.pop("to_cpu_and_numpy")


def _nothing() -> None:
    return None


class _ForwardStorages(LiveStorages):
    """The counter of a real forward: it lets dynamo compile what it meets (see the module docstring)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class EvaluationProbe:
    """Measures the evaluation loops it is armed for (see the module's docstring).

    Args:
        warn_once: `warn_once(kind, message)`, the caller's warning that is given once per kind.
        forward: also measure each evaluation's first forward (`forward_peak_bytes`).

    Examples:
        >>> import torch
        >>> from transformers.trainer_pt_utils import EvalLoopContainer
        >>> probe = EvaluationProbe()
        >>> probe.arm(None, "eval")
        >>> preds = EvalLoopContainer()
        >>> preds.add(torch.zeros(2, 3)); preds.add(torch.zeros(2, 3))  # 24 bytes each, then 48 together
        >>> _ = preds.get_arrays()
        >>> probe.disarm(failed=False)
        >>> probe.take("eval")
        {'containers_device_bytes': 48, 'containers_host_bytes': 48, 'concat_peak_bytes': 96, 'host_concat_peak_bytes': 48}
    """

    def __init__(self, warn_once: Optional[Callable[[str, str], None]] = None, forward: bool = True) -> None:
        self._warn_once = warn_once or (lambda kind, message: None)
        self.forward = forward
        self._prefix: Optional[str] = None
        self._containers: Dict[int, _Container] = {}
        self._device, self._host = _Held(), _Held()
        self._peaks: Dict[str, int] = {}
        self._failed = False
        # The model whose forward is wrapped (weakly held through the wrapper's closure only while armed).
        self._model: Any = None
        self._wrapper: Any = None
        self._replaced: Any = NO_INSTANCE_FORWARD
        self._forward_peak: Optional[int] = None
        # The figures of the last finished loop, by its prefix, until an entry takes them.
        self._figures: Dict[str, Dict[str, int]] = {}

    @property
    def armed(self) -> bool:
        return self in _ARMED

    # -- the loop's life -----------------------------------------------------------------------

    def arm(self, model: Any, prefix: str, compiled: bool = False) -> None:
        """Measure the loop about to run, whose metrics take `prefix` (`metric_key_prefix`).

        `compiled`: the caller knows that the model runs compiled (the Trainer's `torch_compile`,
        which compiles a wrapper the probe is not handed): its forward is not measured."""
        self.disarm(failed=True)
        self._prefix = prefix
        self._containers, self._device, self._host = {}, _Held(), _Held()
        self._peaks = {CONTAINERS_DEVICE_BYTES: 0, CONTAINERS_HOST_BYTES: 0, CONCAT_PEAK_BYTES: 0,
                       HOST_CONCAT_PEAK_BYTES: 0}
        self._failed, self._forward_peak = False, None
        try:
            if not _ARMED:
                _install()
            _ARMED.append(self)
        except Exception as error:  # never break an evaluation over a figure
            self._fail(error)
            return
        if self.forward and isinstance(model, torch.nn.Module):
            try:
                if compiled or has_compiled_part(model):
                    self._warn_once("evaluation-compiled", COMPILED_FORWARD_MESSAGE)
                    return
                if dispatch_modes_stop_compiling():
                    self._warn_once("evaluation-compiling", COMPILING_FORWARD_MESSAGE)
                    return
                self._wrap_forward(model)
            except Exception as error:  # never break an evaluation over a figure
                self._unwrap_forward()
                self._warn_once("evaluation-forward", f"measuring the evaluation's forward failed ({error!r}); "
                                "it is left out")

    def disarm(self, failed: bool) -> None:
        """The loop is over: keep its figures (unless it, or measuring, failed); remove every wrapper."""
        self._unwrap_forward()
        if self in _ARMED:
            _ARMED.remove(self)
            if not _ARMED:
                try:
                    _remove()
                except Exception as error:  # nothing more can be done; say so once
                    self._warn_once("evaluation-unwrap", f"removing the evaluation wrappers failed ({error!r})")
            if not failed and self._prefix is not None:
                # A failed walk leaves the container figures out; the forward is measured apart.
                figures = {} if self._failed else dict(self._peaks)
                if self._forward_peak is not None:
                    figures[FORWARD_PEAK_BYTES] = self._forward_peak
                self._figures = {self._prefix: figures}
        self._containers, self._device, self._host = {}, _Held(), _Held()

    def take(self, prefix: str) -> Dict[str, int]:
        """The figures of the last loop with metrics prefix `prefix`, once; `{}` if none."""
        return self._figures.pop(prefix, {})

    def _fail(self, error: BaseException) -> None:
        self._failed = True
        self._warn_once("evaluation", f"measuring the evaluation's containers failed ({error!r}); their figures "
                        "are left out")

    # -- the containers (called by the wrappers; each step fail-soft) ---------------------------

    def _entry(self, container: Any) -> _Container:
        entry = self._containers.get(id(container))
        if entry is None:
            entry = self._containers[id(container)] = _Container(container)
        return entry

    def _before_add(self, container: Any, tensors: Any) -> Optional[Blocks]:
        if self._failed:
            return None
        try:
            return device_blocks(tensors)
        except Exception as error:
            self._fail(error)
            return None

    def _after_add(self, container: Any, pending: Optional[Blocks]) -> None:
        if self._failed or pending is None:
            return
        try:
            entry = self._entry(container)
            if container.do_nested_concat:
                result = device_blocks(container.tensors)
                moment = self._device.total + self._device.extra(pending) + self._device.extra(result, pending)
                self._device.remove(entry.device)
                entry.device = result
                self._device.add(result)
            else:  # the list grows by the batch: no result
                moment = self._device.total + self._device.extra(pending)
                appended = {key: size for key, size in pending.items() if key not in entry.device}
                entry.device.update(appended)
                self._device.add(appended)
            self._peaks[CONCAT_PEAK_BYTES] = max(self._peaks[CONCAT_PEAK_BYTES], moment)
            self._peaks[CONTAINERS_DEVICE_BYTES] = max(self._peaks[CONTAINERS_DEVICE_BYTES], self._device.total)
        except Exception as error:
            self._fail(error)

    def _before_flush(self, container: Any) -> Optional[Tuple[Blocks, bool]]:
        if self._failed or getattr(container, "tensors", None) is None:
            return None
        try:
            concatenates = container.do_nested_concat and container.arrays is not None
            return (numpified_bytes(container.tensors) if concatenates else {}), True
        except Exception as error:
            self._fail(error)
            return None

    def _after_flush(self, container: Any, pending: Optional[Tuple[Blocks, bool]]) -> None:
        if self._failed or pending is None:
            return
        try:
            new_arrays, _ = pending
            entry = self._entry(container)
            result = host_blocks(container.arrays)
            moment = self._host.total + self._host.extra(result) + sum(new_arrays.values())
            self._host.remove(entry.host)
            entry.host = result
            self._host.add(result)
            self._device.remove(entry.device)  # `to_cpu_and_numpy` lets go of the tensors
            entry.device = {}
            self._peaks[HOST_CONCAT_PEAK_BYTES] = max(self._peaks[HOST_CONCAT_PEAK_BYTES], moment)
            self._peaks[CONTAINERS_HOST_BYTES] = max(self._peaks[CONTAINERS_HOST_BYTES], self._host.total)
        except Exception as error:
            self._fail(error)

    # -- the first forward -----------------------------------------------------------------------

    def _wrap_forward(self, model: torch.nn.Module) -> None:
        forward = model.forward

        @functools.wraps(forward)
        def measured_forward(*args: Any, **kwargs: Any) -> Any:
            if self._wrapper is not measured_forward or torch.is_grad_enabled():
                return forward(*args, **kwargs)  # measured already, or not an evaluation forward
            self._unwrap_forward()  # the first one only: later batches run as they are
            try:
                # The model's storages as this forward uses them, read now: `evaluation_loop` may
                # have cast the model since it was wrapped (`bf16_full_eval`), freeing the storages
                # there were then, whose keys (their addresses) the forward's own can take again.
                held = list(model.parameters()) + list(model.buffers()) + [list(args), dict(kwargs)]
                tracker = _ForwardStorages(exclude={key for key, _, _ in storages_of(held)})
            except Exception as error:  # never break an evaluation over a figure
                self._warn_once("evaluation-forward", f"measuring the evaluation's forward failed ({error!r}); "
                                "it is left out")
                return forward(*args, **kwargs)
            with tracker:
                output = forward(*args, **kwargs)
            self._forward_peak = int(tracker.peak_bytes)
            return output

        self._model, self._replaced = model, instance_forward(model)
        self._wrapper = measured_forward
        model.forward = measured_forward

    def _unwrap_forward(self) -> None:
        model, wrapper, replaced = self._model, self._wrapper, self._replaced
        self._model, self._wrapper, self._replaced = None, None, NO_INSTANCE_FORWARD
        if model is None or wrapper is None:
            return
        try:
            put_back_forward(model, wrapper, replaced)
        except Exception as error:  # never break an evaluation over a figure
            self._warn_once("evaluation-unwrap", f"removing the evaluation forward wrapper failed ({error!r})")
