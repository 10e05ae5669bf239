"""What the step plan says of each TRL trainer's step comes from one table, `TRL_ANSWERS`: every
trainer's step has its entry, and the step is reported as each trainer's config holds it."""

from __future__ import annotations

from trainer_memcb.plan.answers.step_plan import PlannedGeneration, PlannedPreference
from trainer_memcb.plan.answers.trl_answers import TRL_ANSWERS, planned_trl_step, trl_answer
from trainer_memcb.plan.settings import StepSettings
from trainer_memcb.plan.step.grpo import GrpoStep
from trainer_memcb.plan.step.kto import KtoStep
from trainer_memcb.plan.step.preference import DpoStep
from trainer_memcb.plan.step.rloo import RlooStep
from trainer_memcb.plan.step.sft import SftStep
from trainer_memcb.plan.step.trl_step import TrlStep


def _subclasses(cls: type) -> set:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(one) for one in found)) if found else found


def test_every_trl_step_has_its_answer_and_a_generation_exactly_where_it_generates() -> None:
    steps = {DpoStep: DpoStep(), KtoStep: KtoStep(), SftStep: SftStep(max_length=32), GrpoStep: GrpoStep(),
             RlooStep: RlooStep()}
    assert _subclasses(TrlStep) == set(steps)
    assert sorted(TRL_ANSWERS) == ["dpo", "grpo", "kto", "rloo", "sft"]
    for step in steps.values():
        assert (trl_answer(step).generation is not None) == step.generates, type(step).__name__


def test_each_step_is_reported_with_its_trainer_beta_and_losses() -> None:
    settings = StepSettings(batch_size=8, seq_len=16)
    assert planned_trl_step(DpoStep(loss_type=("sigmoid", "hinge"), reference="precomputed"), settings) == \
        PlannedPreference(trainer="dpo", reference="precomputed", beta=0.1, loss_type=["sigmoid", "hinge"])
    assert planned_trl_step(SftStep(max_length=32), settings) == \
        PlannedPreference(trainer="sft", reference="none", beta=None, loss_type=["nll"])
    grpo = planned_trl_step(GrpoStep(num_generations=4, max_completion_length=8), settings)
    assert (grpo.trainer, grpo.loss_type, type(grpo.generation)) == ("grpo", ["dapo"], PlannedGeneration)
    assert (grpo.generation.generation_rows, grpo.generation.prompts) == (8, 2)


def test_the_notes_are_the_trainers_own() -> None:
    settings = StepSettings(batch_size=2, seq_len=16)
    notes = trl_answer(DpoStep()).notes(DpoStep(), settings)
    assert notes == ["TRL's DPO step traced: chosen and rejected rows concatenated (4 x 16 tokens), TRL's fused LM "
                     "head, loss sigmoid, the frozen reference model's forward under torch.no_grad()"]
    assert [note[:26] for note in trl_answer(KtoStep()).notes(KtoStep(), settings)] == ["TRL's KTO step traced: the"]
