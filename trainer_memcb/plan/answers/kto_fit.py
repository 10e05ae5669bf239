"""Make it fit, TRL's KTO step: the rule of `search_fits`' `settle_args` for it.

`KTOTrainer.__init__` refuses a micro-batch of 1 where the loss estimates its KL term from the
batch's other rows (`KtoStep.check_batch`): the search's smaller batches (and its last resort, a
batch of 1 with more accumulation) stop at 2 there. The KTO step's other proposals are the search's
own (PEFT's adapters-disabled reference with `allow` "lora", gradient checkpointing, leaner
optimizers) and `precompute_ref_log_probs` (`trainer_proposals` of `trainer_memcb.cli.fit_table`),
each planned through the same `KTOConfig`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

__all__ = ["settle_kto_args"]


def settle_kto_args(step: Any) -> Callable[[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """The rule of `search_fits`' `settle_args` for the KTO step `step` (a `KtoStep`): a setting's
    `KTOConfig` dict as it is, or None where TRL refuses its micro-batch (1 with the KL term)."""

    def settle(args: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        batch = int(args.get("per_device_train_batch_size") or 1)
        return None if step.calculate_kl and batch <= 1 else dict(args)

    return settle
