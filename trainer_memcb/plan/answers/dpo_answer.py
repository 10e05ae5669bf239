"""What the step plan says of TRL's DPO step (`trainer_memcb.plan.step.preference`): how it was traced."""

from __future__ import annotations

from typing import Any

__all__ = ["dpo_note", "reference_words"]


def reference_words(reference: str, forwards: str = "forward") -> str:
    """Where the reference log-probs of DPO's (KTO's) step come from, in words."""
    return {"model": f"the frozen reference model's {forwards} under torch.no_grad()",
            "adapters-disabled": "the reference as the same model with its adapters disabled, under torch.no_grad() "
                                 "(no second copy)",
            "precomputed": "the reference log-probs precomputed (read from the batch)"}[reference]


def dpo_note(step: Any, settings: Any) -> str:
    """How the DPO step (a `DpoStep`) was traced for the settings' micro-batch."""
    return (f"TRL's DPO step traced: chosen and rejected rows concatenated ({2 * settings.batch_size} x "
            f"{settings.seq_len} tokens), TRL's fused LM head, loss {'+'.join(step.loss_type)}, "
            + reference_words(step.reference))
