"""An `RLOOConfig`'s JSON read as the step plan reads it (`--trainer rloo`): split into the
`TrainingArguments` it extends and the RLOO step (`trainer_memcb.plan.step.rloo.RlooStep`), as
`trainer_memcb.cli.grpo_config` reads a `GRPOConfig` (the generation batch resolved from
`per_device_train_batch_size` and `gradient_accumulation_steps` as `RLOOConfig.__post_init__` does).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

__all__ = ["rloo_settings"]


def rloo_settings(values: Mapping[str, Any], where: str, *, peft: bool) -> Tuple[Dict[str, Any], Any]:
    """The `TrainingArguments` values and the `RlooStep` of an `RLOOConfig`'s JSON object `values`
    (read from `where`, named in the messages), for a model trained with PEFT adapters or not.

    Raises:
        SettingsFileError: a key that is not an `RLOOConfig` field, or a `TrainingArguments` value
            the Trainer refuses (`check_training_args`).
        ValueError: an installed trl older than 1.16, a file naming none of `RLOOConfig`'s own
            fields, or an RLOO value TRL refuses or the step is not planned for.
    """
    from trl import RLOOConfig

    from trainer_memcb.cli.trl_config import generating_settings
    from trainer_memcb.plan.step.rloo import rloo_step_from_config

    return generating_settings(values, where, RLOOConfig, "rloo",
                               "num_generations, max_completion_length, beta, normalize_advantages", rloo_step_from_config, peft)
