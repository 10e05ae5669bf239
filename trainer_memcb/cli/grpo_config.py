"""A `GRPOConfig`'s JSON read as the step plan reads it (`--trainer grpo`): split into the
`TrainingArguments` it extends and the GRPO step (`trainer_memcb.plan.step.grpo.GrpoStep`), as
`trainer_memcb.cli.dpo_config` reads a `DPOConfig`.

The GRPO fields go through `grpo_step_from_config`, which repeats the checks `GRPOConfig` and
`GRPOTrainer` make of those that change memory; the others are checked as a `TrainingArguments`
file is, and where the file leaves out a field whose default `GRPOConfig` changes (`bf16`: true
unless `fp16`; `gradient_checkpointing`: true) the plan takes `GRPOConfig`'s default.
"""

from __future__ import annotations

import dataclasses
import difflib
from types import SimpleNamespace
from typing import Any, Dict, Mapping, Tuple

from trainer_memcb.cli.dpo_config import _defaults, _release

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
    import importlib.metadata

    from transformers import TrainingArguments
    from trl import GRPOConfig

    installed = importlib.metadata.version("trl")
    if _release(installed) < (1, 16):
        raise ValueError(f"--trainer grpo needs trl 1.16 or newer (the step planned is its GRPOTrainer's, with the "
                         f"fused LM head); installed: trl {installed}")

    from trainer_memcb.plan.settings.step_settings import SettingsFileError, check_training_args
    from trainer_memcb.plan.step.grpo import grpo_step_from_config

    grpo_fields = {item.name for item in dataclasses.fields(GRPOConfig) if item.init}
    trainer_fields = {item.name for item in dataclasses.fields(TrainingArguments) if item.init}
    unknown = sorted(key for key in values if key not in grpo_fields)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(grpo_fields), n=1)
        which = "is not a GRPOConfig field" if len(unknown) == 1 else "are not GRPOConfig fields"
        raise SettingsFileError(f"{where}: {', '.join(map(repr, unknown))} {which} (GRPOConfig(**args) raises "
                                "TypeError)" + (f"; did you mean {close[0]!r}?" if close else ""))
    own = {key: value for key, value in values.items() if key not in trainer_fields}
    if not own:
        raise ValueError(f"--trainer grpo: {where} names none of GRPOConfig's own fields (num_generations, "
                         "max_completion_length, beta, loss_type, ...): it is not a GRPOConfig's JSON (write one with "
                         "GRPOConfig(...).to_json_string())")
    trainer_values = {key: value for key, value in values.items() if key in trainer_fields}
    check_training_args(trainer_values, where)
    defaults = _defaults(GRPOConfig)
    if "gradient_checkpointing" not in trainer_values and "activation_checkpointing" not in trainer_values:
        trainer_values["gradient_checkpointing"] = defaults["gradient_checkpointing"]
    if trainer_values.get("bf16") is None:  # GRPOConfig: "Defaults to True if fp16 is not set"
        trainer_values["bf16"] = not trainer_values.get("fp16")
    config = SimpleNamespace(**{key: value for key, value in defaults.items() if key not in trainer_fields})
    for key, value in own.items():
        setattr(config, key, value)
    config.per_device_train_batch_size = trainer_values.get("per_device_train_batch_size",
                                                            _defaults(TrainingArguments)["per_device_train_batch_size"])
    config.gradient_accumulation_steps = trainer_values.get("gradient_accumulation_steps", 1)
    try:
        step = grpo_step_from_config(config, peft=peft)
    except TypeError:  # a string where TRL compares a number
        raise ValueError(f"--trainer grpo: {where}: beta {config.beta!r}, num_generations {config.num_generations!r}: "
                         "expected numbers") from None
    except ValueError as error:
        raise ValueError(f"--trainer grpo: {where}: {error}") from None
    return trainer_values, step
