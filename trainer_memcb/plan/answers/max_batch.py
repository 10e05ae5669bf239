"""The largest per-device batch whose planned step fits, from a few traced steps.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from trainer_memcb.plan.answers.step_memory import StepMemoryPlan

__all__ = ["max_batch_size", "MAX_BATCH_SEARCH_LIMIT"]


# The largest batch `max_batch_size` searches: an answer equal to it means "at least this many".
MAX_BATCH_SEARCH_LIMIT = 1 << 20


def max_batch_size(plan_at: Callable[[int], StepMemoryPlan], device_memory: int,
                   limit: int = MAX_BATCH_SEARCH_LIMIT) -> Tuple[Optional[int], List[StepMemoryPlan]]:
    """The largest per-device batch whose planned step fits, and the plans traced: a plan's own
    `fits` where it has one (on CUDA, the allocator replay on the device's memory), else its peak
    against `device_memory`.

    The peak is the larger of forward/backward's, which grows by the same bytes per sample at a
    given sequence length (activations and temporaries are proportional to the batch), and the
    optimizer step's, which does not depend on the batch. Two traces (batches 1 and 2) therefore
    predict the answer; fake steps at the predicted batch and one above check it, and doubling
    and bisection take over wherever the prediction misses. None when batch 1 does not fit, or
    when a step cannot be traced: then the last plan searched has a `problem` that says why (a
    missing peak is never read as "does not fit"), and the search stops.

    Args:
        plan_at: the step plan at a batch size.
        device_memory: bytes per process the step may use (the device's memory less the CUDA context
            and the reserve): the search's guesses, and the answer for plans without their own.
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
        # The plan's own answer where it has one (on CUDA: the allocator replay runs out or not).
        fits_there = plans[batch].fits
        return fits_there if fits_there is not None else peak <= device_memory

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
