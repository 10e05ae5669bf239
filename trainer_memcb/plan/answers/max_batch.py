"""The largest per-device batch whose planned step fits, from a few traced steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from trainer_memcb.plan.answers.fit import step_verdict
from trainer_memcb.plan.answers.step_memory import StepMemoryPlan

__all__ = ["LargestBatch", "SearchedBatch", "max_batch_size", "trainer_batches", "MAX_BATCH_SEARCH_LIMIT"]


# The largest batch `max_batch_size` searches: an answer equal to it means "at least this many".
MAX_BATCH_SEARCH_LIMIT = 1 << 20


@dataclass(frozen=True)
class SearchedBatch:
    """One batch size the search for the largest planned, with its step plan's figures."""

    batch_size: int
    peak_bytes: Optional[int]
    reserved_peak_bytes: Optional[int]
    device_total_bytes: Optional[int]
    fits: Optional[bool]

    @classmethod
    def of(cls, plan: StepMemoryPlan) -> "SearchedBatch":
        """The plan's figures at its per-device batch (a padding-free SFT step's: the rows in its one row)."""
        return cls(plan.settings.per_device_batch, plan.step.peak_bytes, plan.device.reserved_peak_bytes,
                   plan.device.device_total_bytes, plan.verdict.fits)


@dataclass(frozen=True)
class LargestBatch:
    """The answer of the search for the largest batch that fits.

    Attributes:
        max_batch_size: the largest per-device batch that fits; None when none does, or when a
            step could not be traced (`problem` says why).
        is_search_limit: `max_batch_size` is the search's limit, which fits; no larger was tried.
        searched: the batches planned, in increasing order.
    """

    max_batch_size: Optional[int]
    problem: Optional[str]
    is_search_limit: bool
    searched: Tuple[SearchedBatch, ...]

    @classmethod
    def of(cls, found: Optional[int], plans: List[StepMemoryPlan], unit: int = 1) -> "LargestBatch":
        """The answer from `max_batch_size`'s: its batch and the plans it traced (`unit`: the
        search's step between batches, `trainer_batches`)."""
        problem = next((f"at batch {plan.settings.per_device_batch} {plan.step.problem}" for plan in plans
                        if plan.step.problem is not None), None)
        at_limit = found is not None and found + unit > MAX_BATCH_SEARCH_LIMIT
        return cls(found, problem, at_limit, tuple(SearchedBatch.of(plan) for plan in plans))

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "searched": [asdict(batch) for batch in self.searched]}


def trainer_batches(step: Any) -> Tuple[int, int]:
    """The smallest per-device batch the trainer takes, and the step between the batches it takes,
    for the TRL step `step` (`StepSettings.preference`, None for the Trainer's own):

    - KTO with its KL term: 2, then each (`KTOTrainer.__init__` refuses a micro-batch of 1);
    - GRPO and RLOO: the multiples of the least batch whose generation (`batch x
      steps_per_generation` completions) is whole groups of `num_generations`, which TRL requires;
    - any other step: 1, then each.
    """
    if getattr(step, "trainer", None) == "kto" and step.calculate_kl:
        return 2, 1
    if hasattr(step, "generation_rows"):
        unit = step.num_generations // math.gcd(step.num_generations, step.steps_per_generation)
        return unit, unit
    return 1, 1


def max_batch_size(plan_at: Callable[[int], StepMemoryPlan], device_memory: int,
                   limit: int = MAX_BATCH_SEARCH_LIMIT, first: int = 1,
                   unit: int = 1) -> Tuple[Optional[int], List[StepMemoryPlan]]:
    """The largest per-device batch whose planned step fits, and the plans traced. Each batch is
    decided by the verdict its step plan reports (`step_verdict`: on CUDA the allocator replay on
    the device's memory, else the peak against `device_memory`), so the answer is the one the step
    plan gives at that batch and at the one above it.

    The search only guesses from the figures: the peak grows by the same bytes per sample at a
    given sequence length (activations and temporaries are proportional to the batch), so the
    batch where the peak, with what the replay adds to it at the batch below, reaches the memory is
    tried first, then the one above it; where a guess misses, the search gallops up until a batch
    does not fit, then bisects between the largest that fits and the smallest that does not,
    taking a guess only while guesses halve that interval. None when batch 1 does not fit, or when
    a step cannot be traced: then the last plan searched has a `problem` that says why (a missing
    peak is never read as "does not fit"), and the search stops.

    Args:
        plan_at: the step plan at a batch size.
        device_memory: bytes per process the step may use (the device's memory less the CUDA context
            and the reserve): the search's guesses, and the answer for plans without their own.
        limit: the largest batch searched; an answer within `unit` of it means that batch fits,
            and larger ones were not tried.
        first, unit: the batches the trainer takes: `first`, then a step of `unit` each
            (`trainer_batches`); the search runs over their numbers 1, 2, 3, ..., on which the
            peak grows as linearly as on the batch. None when `first` does not fit.
    """
    # Keyed by the batch's number on the trainer's grid (1: `first`), which the guesses read.
    plans: Dict[int, StepMemoryPlan] = {}

    class _CannotTrace(Exception):
        pass

    def batch_of(number: int) -> int:
        return first + unit * (number - 1)

    def fits(number: int) -> bool:
        if number not in plans:
            plans[number] = plan_at(batch_of(number))
        verdict, _ = step_verdict(plans[number], device_memory)
        if verdict is None:
            raise _CannotTrace()
        return verdict

    try:
        best = _search(fits, plans, device_memory, (limit - first) // unit + 1)
    except _CannotTrace:
        best = None
    return (None if best is None else batch_of(best)), [plans[number] for number in sorted(plans)]


def _guess(plans: Dict[int, StepMemoryPlan], low: int, other: int, device_memory: int) -> int:
    """The batch where the line of forward and backward's peak through `low` and `other` (two
    batches planned) reaches the memory less what the verdict's figure adds to the step's peak at
    `low` (the replay's rounding, cache and cuBLAS workspaces). Forward and backward's peak is the
    part that grows with the batch; the optimizer step's does not."""
    def growing(batch: int) -> int:
        plan = plans[batch]
        return plan.step.forward_backward_peak_bytes or plan.step.peak_bytes or 0

    slope = (growing(other) - growing(low)) / (other - low)
    # At small batches forward and backward's peak may be a moment the batch hardly changes (the
    # gradients' accumulation); what is saved for backward grows by at least its bytes per sample.
    saved = ((plans[other].step.activations_peak_bytes or 0) - (plans[low].step.activations_peak_bytes or 0)) / (other - low)
    slope = max(slope, saved)
    held, peak = plans[low].device.reserved_peak_bytes, plans[low].step.peak_bytes or 0
    overhead = max(0, held - peak) if held is not None else 0
    if slope <= 0:
        return 2 * low
    return low + int((device_memory - overhead - growing(low)) // slope)


def _search(fits: Callable[[int], bool], plans: Dict[int, StepMemoryPlan], device_memory: int,
            limit: int) -> Optional[int]:
    """`max_batch_size`'s search, over `fits` (which plans each batch once and records it in `plans`)."""
    if not fits(1):
        return None
    if limit == 1 or not fits(2):
        return 1
    low, high, step = 2, limit + 1, 1  # low fits; high does not (limit + 1 stands for "not tried")
    # Up: the guess and the batch above it, while they fit; each guess at least 1, 2, 4, ... above
    # the last batch that fit, so that guesses that fall short still get there.
    while high == limit + 1:
        guess = min(limit, max(low + step, _guess(plans, low, 1, device_memory)))
        if not fits(guess):
            high = guess
            break
        step, low = 2 * step, guess
        if low == limit:
            return low
        if not fits(low + 1):
            return low
        low += 1
    # Down: the batch where the verdict's own figure (the reserved peak, else the peak) reaches the
    # memory on its line between low and high, and the one above it, while such guesses at least
    # halve the interval; bisection after.
    guessing = True
    while high - low > 1:
        before = high - low
        if guessing:
            candidate = min(max(_between(plans, low, high, device_memory), low + 1), high - 1)
            if fits(candidate):
                low = candidate
                if low + 1 < high and not fits(low + 1):
                    high = low + 1
                elif low + 1 < high:
                    low += 1
            else:
                high = candidate
                if high - 1 > low and fits(high - 1):
                    low = high - 1
                elif high - 1 > low:
                    high -= 1
            guessing = (high - low) * 2 <= before
        elif fits((low + high) // 2):
            low = (low + high) // 2
        else:
            high = (low + high) // 2
    return low


def _between(plans: Dict[int, StepMemoryPlan], low: int, high: int, device_memory: int) -> int:
    """The batch where the peak's line through `low` and `high` reaches the memory less what the
    verdict's figure (the replay's reserved peak) adds to the peak there, read at both ends and
    taken as their mean: the peak grows linearly with the batch, the replay's rounding and cache
    slowly."""
    def overhead(batch: int) -> int:
        plan = plans[batch]
        held = plan.device.reserved_peak_bytes
        return 0 if held is None else held - (plan.step.peak_bytes or 0)

    peak_low, peak_high = plans[low].step.peak_bytes or 0, plans[high].step.peak_bytes or 0
    slope = (peak_high - peak_low) / (high - low)
    target = device_memory - (overhead(low) + overhead(high)) / 2
    return (low + high) // 2 if slope <= 0 else low + int((target - peak_low) // slope)
