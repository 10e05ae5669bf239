"""What the step plan says of TRL's SFT step (`trainer_memcb.plan.step.sft`): how it was traced."""

from __future__ import annotations

from typing import Any

__all__ = ["sft_note"]


def sft_note(step: Any, settings: Any) -> str:
    """How the SFT step (an `SftStep`) was traced for the settings' micro-batch."""
    if step.padding_free:
        rows = (f"one padding-free row of {settings.packing} tokens (the micro-batch's sequences of "
                f"{settings.seq_len} tokens flattened, as packing with the bfd strategy makes it)")
    else:
        rows = f"{settings.batch_size} rows of {settings.seq_len} tokens"
    weighted = ", each token's loss weighted by its probability" if step.loss_type == "dft" else ""
    return (f"TRL's SFT step traced: {rows} through TRL's fused LM head (no full logits), loss "
            f"{step.loss_type}{weighted}, and the entropy and token accuracy metrics; every position scored as "
            "labelled (completion_only_loss and assistant_only_loss mask labels, which changes no tensor's size "
            "off Triton; on CUDA TRL's kernel scores the labelled positions only, at most this)")
