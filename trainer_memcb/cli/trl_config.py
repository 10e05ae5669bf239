"""A TRL trainer's config read as the step plan reads it: its JSON (the file
`XConfig(...).to_json_string()` writes, or a hand-written part of it) split into the
`TrainingArguments` values it extends and a namespace of the config's own fields, TRL's defaults
under the file's values. `trainer_memcb.cli.dpo_config` and `trainer_memcb.cli.grpo_config` read
their trainer's fields from that namespace into the step.

The own fields are read onto a namespace of the config's defaults rather than into the config:
making one runs `TrainingArguments.__post_init__`, which sets up the device. The
`TrainingArguments` values are checked as a `--training-args` file is (`check_training_args`),
and where the file leaves out a field whose default the TRL config changes (`bf16`: true unless
`fp16`; `gradient_checkpointing`: true) the plan takes the config's default, as the trainer would.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from types import SimpleNamespace
from typing import Any, Dict, Mapping, Tuple

__all__ = ["trl_config_parts", "config_defaults", "trl_release", "generating_settings"]


def config_defaults(cls: Any) -> Dict[str, Any]:
    """The default of each field of the dataclass `cls` that `__init__` takes."""
    values = {}
    for item in dataclasses.fields(cls):
        if not item.init:
            continue
        if item.default is not dataclasses.MISSING:
            values[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            values[item.name] = item.default_factory()  # type: ignore[misc]
    return values


def trl_release(version: str) -> Tuple[int, ...]:
    """`"1.14.2"` -> (1, 14, 2); a pre-release's suffix (`"1.16.0rc1"`) ends its number."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split(".")[:3])


def trl_config_parts(values: Mapping[str, Any], where: str, config_cls: Any, trainer: str,
                     own_fields: str) -> Tuple[Dict[str, Any], SimpleNamespace]:
    """The `TrainingArguments` values of a TRL config's JSON object `values` (read from `where`,
    named in the messages) and a namespace of the config's own fields.

    Args:
        config_cls: the TRL config class (`trl.DPOConfig`, `trl.GRPOConfig`).
        trainer: the `--trainer` name, for the messages ("dpo", "grpo").
        own_fields: a few of the config's own fields, named where a file holds none of them.

    Raises:
        SettingsFileError: a key that is not a field of `config_cls`, or a `TrainingArguments`
            value the Trainer refuses (`check_training_args`).
        ValueError: an installed trl older than 1.16, or a file naming none of the config's own fields.
    """
    import importlib.metadata

    from transformers import TrainingArguments

    from trainer_memcb.plan.settings.step_settings import SettingsFileError, check_training_args

    name = config_cls.__name__
    installed = importlib.metadata.version("trl")
    if trl_release(installed) < (1, 16):
        raise ValueError(f"--trainer {trainer} needs trl 1.16 or newer (the step planned is its "
                         f"{name.replace('Config', 'Trainer')}'s, with the fused LM head); installed: trl {installed}")
    fields = {item.name for item in dataclasses.fields(config_cls) if item.init}
    trainer_fields = {item.name for item in dataclasses.fields(TrainingArguments) if item.init}
    unknown = sorted(key for key in values if key not in fields)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(fields), n=1)
        which = f"is not a {name} field" if len(unknown) == 1 else f"are not {name} fields"
        raise SettingsFileError(f"{where}: {', '.join(map(repr, unknown))} {which} ({name}(**args) raises "
                                "TypeError)" + (f"; did you mean {close[0]!r}?" if close else ""))
    own = {key: value for key, value in values.items() if key not in trainer_fields}
    if not own:
        raise ValueError(f"--trainer {trainer}: {where} names none of {name}'s own fields ({own_fields}, ...): it is "
                         f"not a {name}'s JSON (write one with {name}(...).to_json_string())")
    trainer_values = {key: value for key, value in values.items() if key in trainer_fields}
    check_training_args(trainer_values, where)
    defaults = config_defaults(config_cls)
    # The TrainingArguments defaults the TRL config changes, where the file leaves them out.
    if "gradient_checkpointing" not in trainer_values and "activation_checkpointing" not in trainer_values:
        trainer_values["gradient_checkpointing"] = defaults["gradient_checkpointing"]
    if trainer_values.get("bf16") is None:  # "Defaults to True if fp16 is not set"
        trainer_values["bf16"] = not trainer_values.get("fp16")
    config = SimpleNamespace(**{key: value for key, value in defaults.items() if key not in trainer_fields})
    for key, value in own.items():
        setattr(config, key, value)
    return trainer_values, config


def generating_settings(values: Mapping[str, Any], where: str, config_cls: Any, trainer: str, own_fields: str,
                        step_from_config: Any, peft: bool) -> Tuple[Dict[str, Any], Any]:
    """The `TrainingArguments` values and the step of a generating trainer's config JSON (GRPO's,
    RLOO's): its own fields through `step_from_config(config, peft=...)`, which repeats TRL's checks,
    with the batch and accumulation the generation batch is resolved from (as the config's
    `__post_init__` resolves it).

    Raises:
        SettingsFileError: a key that is not a field of `config_cls`, or a `TrainingArguments` value
            the Trainer refuses.
        ValueError: an installed trl too old, a file naming none of the config's own fields, or a
            value TRL refuses or the step is not planned for, each named with `--trainer TRAINER`.
    """
    from transformers import TrainingArguments

    trainer_values, config = trl_config_parts(values, where, config_cls, trainer, own_fields)
    config.per_device_train_batch_size = trainer_values.get("per_device_train_batch_size",
                                                            config_defaults(TrainingArguments)["per_device_train_batch_size"])
    config.gradient_accumulation_steps = trainer_values.get("gradient_accumulation_steps", 1)
    try:
        step = step_from_config(config, peft=peft)
    except TypeError:  # a string where TRL compares a number
        raise ValueError(f"--trainer {trainer}: {where}: beta {config.beta!r}, num_generations "
                         f"{config.num_generations!r}: expected numbers") from None
    except ValueError as error:
        raise ValueError(f"--trainer {trainer}: {where}: {error}") from None
    return trainer_values, step
