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
    from transformers import TrainingArguments
    from trl import RLOOConfig

    from trainer_memcb.cli.trl_config import config_defaults, trl_config_parts
    from trainer_memcb.plan.step.rloo import rloo_step_from_config

    trainer_values, config = trl_config_parts(values, where, RLOOConfig, "rloo",
                                              "num_generations, max_completion_length, beta, normalize_advantages")
    config.per_device_train_batch_size = trainer_values.get("per_device_train_batch_size",
                                                            config_defaults(TrainingArguments)["per_device_train_batch_size"])
    config.gradient_accumulation_steps = trainer_values.get("gradient_accumulation_steps", 1)
    try:
        step = rloo_step_from_config(config, peft=peft)
    except TypeError:  # a string where TRL compares a number
        raise ValueError(f"--trainer rloo: {where}: beta {config.beta!r}, num_generations {config.num_generations!r}: "
                         "expected numbers") from None
    except ValueError as error:
        raise ValueError(f"--trainer rloo: {where}: {error}") from None
    return trainer_values, step
