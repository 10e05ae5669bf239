"""What `trainer-memcb estimate` answers, typed: the step plan, the model-states plan from the
same trace, the search for the largest batch, `--fit`'s proposals and the evaluation; the tables,
the JSON document (`to_document`) and the exit code are each read from it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from trainer_memcb.plan.answers.eval_memory import EvalMemoryPlan
    from trainer_memcb.plan.answers.fit_candidates import FitSearch
    from trainer_memcb.plan.answers.max_batch import LargestBatch
    from trainer_memcb.plan.answers.model_states import ModelStatesPlan
    from trainer_memcb.plan.answers.step_memory import StepMemoryPlan

__all__ = ["StepAnswer", "answers_document"]


@dataclass(frozen=True)
class StepAnswer:
    """The step plan's answers.

    Attributes:
        model_states: the model-states plan, each state as the step held it where a step was
            traced (`states_during_step`).
        step: the step at the asked batch, or None (only a search asked).
        largest_batch: --max-batch-size's answer, or None unasked.
        fit: --fit's search, or None.
        largest_step: without `step`, the step plan at the largest batch the search found (what
            --write-snapshot and --write-html write), or None; not in the document.
    """

    model_states: "ModelStatesPlan"
    step: "Optional[StepMemoryPlan]" = None
    largest_batch: "Optional[LargestBatch]" = None
    fit: "Optional[FitSearch]" = None
    largest_step: "Optional[StepMemoryPlan]" = None

    def to_document(self, evaluation: "Optional[EvalMemoryPlan]" = None,
                    evaluation_fit: "Optional[FitSearch]" = None,
                    model_states: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The `--json` document without its `schema`: the step's `settings`, the `model_states`
        (`model_states`: their JSON form where the command adds to it), the `step`, the `device`
        and the `answers` (fits? and its margin, --fit's search, the largest batch, the evaluation
        and its search), each key only where asked."""
        document: Dict[str, Any] = {}
        if self.step is not None:
            document["settings"] = self.step.settings.to_dict()
        document["model_states"] = model_states if model_states is not None else self.model_states.to_dict()
        answers: Dict[str, Any] = {}
        if self.step is not None:
            document["step"] = self.step.to_dict()["step"]
            document["device"] = asdict(self.step.device)
            answers.update(asdict(self.step.verdict))
        if self.fit is not None:
            answers["fit"] = self.fit.to_dict()
        if self.largest_batch is not None:
            answers["largest_batch"] = self.largest_batch.to_dict()
        document["answers"] = {**answers, **answers_document(evaluation, evaluation_fit)}
        return document


def answers_document(evaluation: "Optional[EvalMemoryPlan]", evaluation_fit: "Optional[FitSearch]") -> Dict[str, Any]:
    """The evaluation's answers: its plan and --fit's search for it, each where asked."""
    answers: Dict[str, Any] = {}
    if evaluation is not None:
        answers["evaluation"] = evaluation.to_dict()
    if evaluation_fit is not None:
        answers["evaluation_fit"] = evaluation_fit.to_dict()
    return answers
