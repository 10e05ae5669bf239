"""What the step plan of `trainer-memcb estimate` answers, typed: the step, the model-states plan
from the same trace, the search for the largest batch and `--fit`'s proposals; the tables, the
JSON and the exit code are each read from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

__all__ = ["StepAnswer"]


@dataclass(frozen=True)
class StepAnswer:
    """The step plan's answers.

    Attributes:
        model_states: the model-states plan (`ModelStatesPlan`), each state as the step held it
            where a step was traced (`states_during_step`).
        step: the step at the asked batch (`StepMemoryPlan`), or None (only a search asked).
        search: whether --max-batch-size was asked; `max_batch_size`: its answer (None: no batch
            fits); `searched`: the plans it made, in order; `max_batch_size_problem`: why a batch
            could not be traced, or None; `max_batch_size_is_search_limit`: the answer is the
            search's limit, no larger batch tried.
        fit: --fit's search (`FitSearch`), or None.
    """

    model_states: Any
    step: Any = None
    search: bool = False
    max_batch_size: Optional[int] = None
    searched: Tuple[Any, ...] = ()
    max_batch_size_problem: Optional[str] = None
    max_batch_size_is_search_limit: bool = False
    fit: Any = None
