"""What the step plan says of a TRL trainer's step, one entry per trainer (`TRL_ANSWERS`): the
notes that say how its step was traced, and the step as the plan reports it (`PlannedPreference`,
`planned_trl_step`). A new trainer's step is a module of notes and an entry here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from trainer_memcb.plan.answers.dpo_answer import dpo_note
from trainer_memcb.plan.answers.grpo_answer import grpo_notes, planned_generation
from trainer_memcb.plan.answers.kto_answer import kto_note
from trainer_memcb.plan.answers.sft_answer import sft_note
from trainer_memcb.plan.answers.step_plan import PlannedGeneration, PlannedPreference

__all__ = ["TrlAnswer", "TRL_ANSWERS", "trl_answer", "planned_trl_step"]


@dataclass(frozen=True)
class TrlAnswer:
    """What the plan says of one trainer's step: its notes, its generation phase (GRPO's and
    RLOO's; None for a step without one) and whether its config has a beta (SFT's has none)."""

    notes: Callable[[Any, Any], List[str]]
    generation: Optional[Callable[[Any, Any], PlannedGeneration]] = None
    has_beta: bool = True


def _one(note: Callable[[Any, Any], str]) -> Callable[[Any, Any], List[str]]:
    return lambda step, settings: [note(step, settings)]


TRL_ANSWERS: Dict[str, TrlAnswer] = {
    "dpo": TrlAnswer(_one(dpo_note)),
    "kto": TrlAnswer(_one(kto_note)),
    "sft": TrlAnswer(_one(sft_note), has_beta=False),
    "grpo": TrlAnswer(grpo_notes, generation=planned_generation),
    "rloo": TrlAnswer(grpo_notes, generation=planned_generation),  # RLOO's step is built as GRPO's
}


def _trainer(step: Any) -> str:
    # DPO's step (`DpoStep`) was the first and names no trainer.
    return getattr(step, "trainer", "dpo")


def trl_answer(step: Any) -> TrlAnswer:
    """The entry of the trainer whose step `step` is (a `TrlStep`)."""
    return TRL_ANSWERS[_trainer(step)]


def planned_trl_step(step: Any, settings: Any) -> PlannedPreference:
    """The step as the plan reports it: its trainer, reference, beta and losses, and its
    generation phase for the settings' micro-batch."""
    answer = trl_answer(step)
    losses = [step.loss_type] if isinstance(step.loss_type, str) else list(step.loss_type)
    return PlannedPreference(trainer=_trainer(step), reference=step.reference,
                             beta=step.beta if answer.has_beta else None, loss_type=losses,
                             generation=answer.generation(step, settings) if answer.generation is not None else None)
