"""Make evaluation fit: smaller eval batches and `eval_accumulation_steps`, each planned by
`plan_eval_memory`.

What `Trainer.evaluate()` holds on the device is its forward's peak, which grows with
`per_device_eval_batch_size`, and its containers (logits, labels, losses), which grow batch after
batch until `eval_accumulation_steps` batches have been gathered and they move to the host
(`Trainer.evaluation_loop`, `EvalLoopContainer.to_cpu_and_numpy` in `trainer_pt_utils.py`). Neither
changes what is evaluated. `search_eval_fits` plans:

- `eval_accumulation_steps` of 1, 2, 4 and 8 below the own (or below the number of batches, when
  the own keeps everything on the device until the end), with the own batch;
- the eval batch halved, down to 1, with the own accumulation and with `eval_accumulation_steps=1`;

in that order, up to `max_candidates`.

A proposal fits when its evaluation plan says it fits on the device (`EvalMemoryPlan.fits_device`:
on CUDA the allocator replay against the device's memory less the CUDA context and the reserve)
and its host peak is not over `host_memory` (the containers grow on the host as they leave the
device); its peak and margin are the plan's `device_figure_bytes` (the reserved peak on CUDA) and
`device_margin_bytes`, so the own row says what the evaluation plan's fits? says. Ranking: those that fit
first, the fewest forward batches first (their arithmetic is the same for the same samples; each
batch adds a fixed cost), then the fewest moves to the host; then the misses, nearest first. No
time is estimated (`relative_step_time` is None).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Dict, List

from trainer_memcb.plan.answers.eval_memory import EvalMemoryPlan, EvalSettings
from trainer_memcb.plan.answers.fit import FitCandidate, FitSearch

__all__ = ["search_eval_fits"]

# The `eval_accumulation_steps` values proposed (those below the own, or below the number of batches).
_ACCUMULATIONS = (1, 2, 4, 8)


def _training_args(settings: EvalSettings) -> Dict[str, Any]:
    """The `TrainingArguments` keys that give `settings` (`eval_settings_from_args` reads them back);
    the logits kept have none (a `preprocess_logits_for_metrics` or `compute_metrics` of the code)."""
    args: Dict[str, Any] = {"per_device_eval_batch_size": settings.batch_size}
    if settings.accumulation_steps is not None:
        args["eval_accumulation_steps"] = settings.accumulation_steps
    if not settings.concat_batches:
        args["eval_do_concat_batches"] = False
    if settings.include_inputs:
        args["include_for_metrics"] = ["inputs"]
    return args


def _candidate(plan: EvalMemoryPlan, own: EvalSettings) -> FitCandidate:
    settings = plan.settings
    changes = {key: value for key, value in _training_args(settings).items() if _training_args(own).get(key) != value}
    fits = None if plan.fits_device is None else (plan.fits_device and plan.fits_host is not False)
    return FitCandidate(changes=changes, training_args=_training_args(settings), deepspeed=None,
                        peak_bytes=plan.device_figure_bytes, fits=fits, margin_bytes=plan.device_margin_bytes,
                        relative_step_time=None,
                        effective_batch=settings.batch_size,
                        micro_batches=math.ceil(settings.samples / settings.batch_size), step_flops=None,
                        problem=plan.problem)


def _proposals(own: EvalSettings, max_candidates: int) -> List[EvalSettings]:
    batches = []
    batch = own.batch_size // 2
    while batch >= 1:
        batches.append(batch)
        batch //= 2
    below = own.accumulation_steps or math.ceil(own.samples / own.batch_size)
    # The accumulation first (no more batches), then each smaller batch, alone and moved every batch.
    proposals = [replace(own, accumulation_steps=k) for k in _ACCUMULATIONS if k < below]
    for b in batches:
        proposals += [replace(own, batch_size=b), replace(own, batch_size=b, accumulation_steps=1)]
    unique: List[EvalSettings] = []
    for settings in proposals:
        if settings not in unique:
            unique.append(settings)
    return unique[:max_candidates]


def search_eval_fits(plan_eval: Callable[[EvalSettings], EvalMemoryPlan], own: EvalSettings, *,
                     max_candidates: int = 12) -> FitSearch:
    """Plan the own evaluation settings and the proposals (see the module docstring).

    Args:
        plan_eval: `plan_eval(settings) -> EvalMemoryPlan`, `plan_eval_memory` with the run's model,
            device memory (and reserve, context), and resident bytes.
        own: the user's `EvalSettings`.
        max_candidates: the most proposals planned.

    The search's `usable_bytes` is the own plan's `usable_device_bytes`: the device's memory less
    the reserve, and less the CUDA context on CUDA.

    Raises:
        ValueError: a bad `max_candidates`; an own plan with no device memory or no figure.
    """
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
        raise ValueError(f"max_candidates={max_candidates!r}: expected a whole number of at least 1")
    planned = plan_eval(own)
    if planned.usable_device_bytes is None:
        raise ValueError("the own evaluation plan has no device memory or no figure: nothing to fit in")
    mine = _candidate(planned, own)
    proposals = [_candidate(plan_eval(settings), own) for settings in _proposals(own, max_candidates)]
    fitting = sorted((c for c in proposals if c.fits),
                     key=lambda c: (c.micro_batches, -c.training_args.get("eval_accumulation_steps", math.inf)))
    missed = sorted((c for c in proposals if not c.fits),
                    key=lambda c: -(c.margin_bytes if c.margin_bytes is not None else -math.inf))
    return FitSearch(fits_as_is=bool(mine.fits), own=mine, candidates=fitting + missed,
                     usable_bytes=planned.usable_device_bytes)
