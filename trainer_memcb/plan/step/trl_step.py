"""What the step tracer asks of a TRL trainer's step: one interface, `TrlStep`, that each trainer's
settings implement in the trainer's own module (`preference.DpoStep`, `kto.KtoStep`,
`sft.SftStep`, `grpo.GrpoStep`, `rloo.RlooStep`). The tracer runs the Trainer's own step where
`StepSettings.preference` is None and otherwise asks the step for its batch, its fused heads, its
loss and whether a generation phase runs before a micro-batch, without knowing which trainer it
runs. The generation phases themselves (GRPO's, RLOO's) import their steps' modules, so the tracer
picks one (`trainer_memcb.plan.step.trace`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ["TrlStep"]


class TrlStep:
    """A TRL trainer's step, as the tracer runs it (the subclasses are frozen dataclasses of the
    settings that change the step's memory)."""

    # Whether a generation phase runs before the training phase's micro-batches (GRPO's, RLOO's).
    generates = False
    # Whether a step of identical layers may be folded from steps of fewer layers
    # (`trainer_memcb.plan.step.layer_fold`): checked equal to the step traced whole for DPO, KTO
    # and SFT; GRPO's and RLOO's, with their generation phase, are traced whole.
    folds = True

    def fuse_lm_heads(self, model: nn.Module, ref_model: Optional[nn.Module]) -> None:
        """Patch TRL's fused LM heads onto the policy and the reference, as the trainer's `__init__` does."""
        raise NotImplementedError

    def batch(self, model: nn.Module, batch_size: int, seq_len: Optional[int], input_options: Dict[str, Any]) -> Any:
        """One micro-batch as the trainer's collator makes it (in the current mode); None where the
        generation phase makes it."""
        raise NotImplementedError

    def loss(self, model: nn.Module, inputs: Any, ref_model: Optional[nn.Module], kwargs: Dict[str, Any],
             accumulation: int, autocast: Any) -> torch.Tensor:
        """The micro-batch's loss as the trainer's `compute_loss` makes it, in `autocast` (None
        without); `kwargs` keeps what the Trainer keeps to the step's end."""
        raise NotImplementedError

    def check_batch(self, batch_size: int) -> None:
        """Refuse a micro-batch the trainer refuses (none here).

        Raises:
            ValueError: naming the batch size and what TRL allows.
        """

    def generates_before(self, number: int, accumulation: int) -> bool:
        """Whether a generation phase runs before traced micro-batch `number`."""
        return False

    def as_traced(self) -> "TrlStep":
        """The step with what does not change its trace left at one value (the key of a shared trace)."""
        return self
