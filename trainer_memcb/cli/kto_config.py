"""A `KTOConfig`'s JSON read as the step plan reads it (`--trainer kto`): split into the
`TrainingArguments` it extends and the KTO step (`trainer_memcb.plan.step.kto.KtoStep`).

As for DPO (`trainer_memcb.cli.dpo_config`), the own fields are read onto a namespace of
`KTOConfig`'s defaults (`trainer_memcb.cli.trl_config`), and `kto_step_from_config` repeats the
checks `KTOTrainer.__init__` makes of them. `train_sampling_strategy` is a `TrainingArguments` field
whose default `KTOConfig` changes ("sequential"); the KL term's check reads it from the file or that
default.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

__all__ = ["kto_settings"]


def kto_settings(values: Mapping[str, Any], where: str, *, peft: bool) -> Tuple[Dict[str, Any], Any]:
    """The `TrainingArguments` values and the `KtoStep` of a `KTOConfig`'s JSON object `values`
    (read from `where`, named in the messages), for a model trained with PEFT adapters or not.

    Raises:
        SettingsFileError: a key that is not a `KTOConfig` field, or a `TrainingArguments` value
            the Trainer refuses (`check_training_args`).
        ValueError: an installed trl older than 1.16, a file naming none of `KTOConfig`'s own
            fields, or a KTO value TRL refuses or the step is not planned for (`kto_step_from_config`).
    """
    from trl import KTOConfig

    from trainer_memcb.cli.trl_config import config_defaults, trl_config_parts
    from trainer_memcb.plan.step.kto import kto_step_from_config

    trainer_values, config = trl_config_parts(values, where, KTOConfig, "kto",
                                              "beta, max_length, loss_type, desirable_weight")
    config.train_sampling_strategy = trainer_values.setdefault(
        "train_sampling_strategy", config_defaults(KTOConfig)["train_sampling_strategy"])
    try:
        step = kto_step_from_config(config, peft=peft)
    except ValueError as error:
        raise ValueError(f"--trainer kto: {where}: {error}") from None
    return trainer_values, step
