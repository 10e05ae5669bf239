"""A `GRPOConfig`'s JSON read as the step plan reads it (`--trainer grpo`): split into the
`TrainingArguments` it extends and the GRPO step (`trainer_memcb.plan.step.grpo.GrpoStep`), as
`trainer_memcb.cli.dpo_config` reads a `DPOConfig`.

The GRPO fields go through `grpo_step_from_config`, which repeats the checks `GRPOConfig` and
`GRPOTrainer` make of those that change memory; the others are checked as a `TrainingArguments`
file is, and where the file leaves out a field whose default `GRPOConfig` changes (`bf16`: true
unless `fp16`; `gradient_checkpointing`: true) the plan takes `GRPOConfig`'s default.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

__all__ = ["grpo_settings"]


def grpo_settings(values: Mapping[str, Any], where: str, *, peft: bool) -> Tuple[Dict[str, Any], Any]:
    """The `TrainingArguments` values and the `GrpoStep` of a `GRPOConfig`'s JSON object `values`
    (read from `where`, named in the messages), for a model trained with PEFT adapters or not.

    Raises:
        SettingsFileError: a key that is not a `GRPOConfig` field, or a `TrainingArguments` value
            the Trainer refuses (`check_training_args`).
        ValueError: an installed trl older than 1.16, a file naming none of `GRPOConfig`'s own
            fields, or a GRPO value TRL refuses or the step is not planned for.
    """
    from trl import GRPOConfig

    from trainer_memcb.cli.trl_config import generating_settings
    from trainer_memcb.plan.step.grpo import grpo_step_from_config

    return generating_settings(values, where, GRPOConfig, "grpo",
                               "num_generations, max_completion_length, beta, loss_type", grpo_step_from_config, peft)
