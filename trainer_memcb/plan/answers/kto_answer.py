"""What the step plan says of TRL's KTO step (`trainer_memcb.plan.step.kto`): how it was traced."""

from __future__ import annotations

from typing import Any

from trainer_memcb.plan.answers.dpo_answer import reference_words

__all__ = ["kto_note"]


def kto_note(step: Any, settings: Any) -> str:
    """How the KTO step (a `KtoStep`) was traced for the settings' micro-batch."""
    rows, tokens = settings.batch_size, settings.seq_len
    kl = (f"the mismatched KL rows ({rows} x {tokens} tokens) through the policy under torch.no_grad(), "
          if step.calculate_kl else "no KL rows (loss_type apo_zero_unpaired), ")
    return (f"TRL's KTO step traced: {kl}the completion rows ({rows} x {tokens} tokens) through TRL's fused LM head, "
            f"loss {step.loss_type}, {reference_words(step.reference, 'forwards')}; the rows split as "
            f"{step.desirable_rows(rows)} desirable and {rows - step.desirable_rows(rows)} undesirable (the split is the data's: "
            "only metric tensors of a few bytes change with it)")
