"""A TRL trainer's config read as the step plan reads it: a `DPOConfig`'s JSON (the file
`DPOConfig(...).to_json_string()` writes, or a hand-written part of it) split into the
`TrainingArguments` it extends and the DPO step (`trainer_memcb.plan.step.preference.DpoStep`).

`DPOConfig` is a `TrainingArguments` subclass: its own fields (beta, max_length, loss_type,
precompute_ref_log_probs, ...) go through `dpo_step_from_config`, which repeats the checks TRL
makes of them; the others are checked as a `TrainingArguments` file is (`check_training_args`),
and where the file leaves out a field whose default `DPOConfig` changes (`bf16`: true unless
`fp16`; `gradient_checkpointing`: true) the plan takes `DPOConfig`'s default, as the trainer would.

The DPO fields are read onto a namespace of `DPOConfig`'s defaults (`trainer_memcb.cli.trl_config`)
rather than into a `DPOConfig`; the one check `DPOConfig.__post_init__` makes of its own fields (one
`loss_weights` per `loss_type`) is repeated by `DpoStep`.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

__all__ = ["dpo_settings"]


def dpo_settings(values: Mapping[str, Any], where: str, *, peft: bool) -> Tuple[Dict[str, Any], Any]:
    """The `TrainingArguments` values and the `DpoStep` of a `DPOConfig`'s JSON object `values`
    (read from `where`, named in the messages), for a model trained with PEFT adapters or not.

    Raises:
        SettingsFileError: a key that is not a `DPOConfig` field, or a `TrainingArguments` value
            the Trainer refuses (`check_training_args`).
        ValueError: an installed trl older than 1.16, a file naming none of `DPOConfig`'s own fields (not a DPOConfig), or a DPO
            value TRL refuses or the step is not planned for (`dpo_step_from_config`).
    """
    from trl import DPOConfig

    from trainer_memcb.cli.trl_config import trl_config_parts
    from trainer_memcb.plan.step.preference import dpo_step_from_config

    trainer_values, config = trl_config_parts(values, where, DPOConfig, "dpo",
                                              "beta, max_length, loss_type, precompute_ref_log_probs")
    try:
        step = dpo_step_from_config(config, peft=peft)
    except TypeError:  # a string where TRL compares a number
        raise ValueError(f"--trainer dpo: {where}: beta {config.beta!r}, label_smoothing {config.label_smoothing!r}: "
                         "expected numbers") from None
    except ValueError as error:
        raise ValueError(f"--trainer dpo: {where}: {error}") from None
    return trainer_values, step
