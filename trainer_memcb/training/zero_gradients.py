"""DeepSpeed ZeRO-1/2 gradients, measured when its optimizer step begins: the one moment they exist.

DeepSpeed's `DeepSpeedZeroOptimizer` (`deepspeed/runtime/zero/stage_1_and_2.py`, stages 1 and 2)
reduces the gradients at the end of backward into its own buffers and frees `param.grad`; its
`step` then walks the param groups one by one: it makes the group's fp32 gradient partition,
drops the group's 16-bit gradients, and only then lets the inner optimizer step. By the time an
inner optimizer's step pre-hook runs, or the Trainer's `on_pre_optimizer_step` (through accelerate
it comes after DeepSpeed's whole step), some or all of the 16-bit gradients are gone.

So `ZeroGradientsTap` wraps that optimizer's `step` on the instance: when the step begins, after
backward's reductions and before anything is freed, it counts the storages behind the reduced
16-bit gradients (metadata only, and only at the steps its owners want measured). `remove()`
puts the original method back; the wrapper holds its tap weakly, so a wrapper left behind (when
something else wrapped `step` after it) does nothing once the tap is gone. One tap serves every
owner of one optimizer (a Trainer callback and a loop logger on the same run, say).

What is counted (deepspeed 0.19): `averaged_gradients` (per group, the step's partition as views
of the contiguous buffer, plus zeros where a partition runs past a group's values), and whatever
still holds gradients: `grads_in_partition`, each parameter's `grad` and `grad_accum`, and
`all_grad_tensors` (gradient accumulation). Each storage once. The fp32 gradient partitions are
made inside the step, one group at a time, and are not counted here (the plan gives them apart,
as `fp32_grad_partition_bytes`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

__all__ = ["ZeroGradientsTap", "find_tap", "is_zero12_optimizer", "zero12_gradient_tensors"]

# The attribute that marks DeepSpeedZeroOptimizer (stage_1_and_2.py) among DeepSpeed's optimizers.
_ZERO12_MASTERS = "single_partition_of_fp32_groups"

# The tap of each ZeRO optimizer, held weakly on both sides.
_TAPS: "weakref.WeakKeyDictionary[Any, ZeroGradientsTap]" = weakref.WeakKeyDictionary()


def is_zero12_optimizer(zero: Any) -> bool:
    """Whether `zero` is DeepSpeed's `DeepSpeedZeroOptimizer` (ZeRO-1/2), by its attributes."""
    return isinstance(getattr(zero, _ZERO12_MASTERS, None), list) and isinstance(getattr(zero, "bit16_groups", None), list)


def _tensors_in(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
        flat = getattr(value, "flat_partition", None)  # GradPartitionBufferGroup: views of one buffer
        if isinstance(flat, torch.Tensor):
            yield flat


def zero12_gradient_tensors(zero: Any) -> List[torch.Tensor]:
    """The tensors holding `DeepSpeedZeroOptimizer`'s 16-bit gradients now (metadata walk only)."""
    tensors: List[torch.Tensor] = []
    for name in ("averaged_gradients", "all_grad_tensors"):
        groups = getattr(zero, name, None)
        values = groups.values() if isinstance(groups, dict) else groups if isinstance(groups, list) else ()
        for value in values:
            tensors.extend(_tensors_in(value))
    tensors.extend(_tensors_in(getattr(zero, "grads_in_partition", None)))
    for group in getattr(zero, "bit16_groups", []):
        for param in group:
            for name in ("grad", "grad_accum"):
                tensors.extend(_tensors_in(getattr(param, name, None)))
    return tensors


class ZeroGradientsTap:
    """Counts a `DeepSpeedZeroOptimizer`'s 16-bit gradients when its step begins.

    Use `ZeroGradientsTap.install`; read `grads_bytes` after the step.

    Attributes:
        grads_bytes: bytes of the storages behind the gradients at the last wanted step's start,
            or None (not measured yet, or measuring failed: then `error` says why).
        error: the exception the last measurement raised, or None.
    """

    def __init__(self, zero: Any, count: Callable[[Iterable[torch.Tensor]], int]) -> None:
        self._zero = weakref.ref(zero)
        self._count = count
        self._wanted: Dict[int, Callable[[], bool]] = {}
        self._next_owner = 0
        self.grads_bytes: Optional[int] = None
        self.error: Optional[BaseException] = None
        self._had_own_step = "step" in vars(zero)
        self._original = zero.step
        tap = weakref.ref(self)
        original = self._original

        def step(*args: Any, **kwargs: Any) -> Any:
            current = tap()
            if current is not None:
                current._at_step_start()
            return original(*args, **kwargs)

        self._wrapper = step
        zero.step = step

    @classmethod
    def install(cls, zero: Any, wanted: Callable[[], bool],
                count: Callable[[Iterable[torch.Tensor]], int]) -> Callable[[], None]:
        """Measure `zero`'s gradients at the start of every step for which `wanted()` is true.

        Args:
            zero: a `DeepSpeedZeroOptimizer`.
            wanted: called when a step begins; true to measure at this step.
            count: bytes of the storages behind some tensors, each storage once.

        Returns:
            A function that withdraws this request; the last one withdrawn restores `step`.
        """
        tap = _TAPS.get(zero)
        if tap is None:
            tap = _TAPS[zero] = cls(zero, count)
        owner = tap._next_owner
        tap._next_owner += 1
        tap._wanted[owner] = wanted

        def withdraw() -> None:
            tap._wanted.pop(owner, None)
            if not tap._wanted:
                tap.remove()

        return withdraw

    def _at_step_start(self) -> None:
        zero = self._zero()
        if zero is None:
            return
        try:  # never break the step over a figure
            if not any(wanted() for wanted in list(self._wanted.values())):
                return
            self.grads_bytes, self.error = self._count(zero12_gradient_tensors(zero)), None
        except Exception as error:
            self.grads_bytes, self.error = None, error

    def remove(self) -> None:
        """Put the optimizer's own `step` back (if nothing wrapped it after this tap)."""
        self._wanted.clear()
        zero = self._zero()
        if zero is None:
            return
        if _TAPS.get(zero) is self:
            del _TAPS[zero]
        if vars(zero).get("step") is self._wrapper:
            if self._had_own_step:
                zero.step = self._original
            else:
                del zero.step


def find_tap(zero: Any) -> Optional[ZeroGradientsTap]:
    """The tap installed on `zero`, or None."""
    try:
        return _TAPS.get(zero)
    except TypeError:  # a class without weak references is never tapped
        return None
