"""A TRL trainer's config read as the step plan reads it: a `DPOConfig`'s JSON (the file
`DPOConfig(...).to_json_string()` writes, or a hand-written part of it) split into the
`TrainingArguments` it extends and the DPO step (`trainer_memcb.plan.step.preference.DpoStep`).

`DPOConfig` is a `TrainingArguments` subclass: its own fields (beta, max_length, loss_type,
precompute_ref_log_probs, ...) go through `dpo_step_from_config`, which repeats the checks TRL
makes of them; the others are checked as a `TrainingArguments` file is (`check_training_args`),
and where the file leaves out a field whose default `DPOConfig` changes (`bf16`: true unless
`fp16`; `gradient_checkpointing`: true) the plan takes `DPOConfig`'s default, as the trainer would.

The DPO fields are read onto a namespace of `DPOConfig`'s defaults rather than into a `DPOConfig`:
making one runs `TrainingArguments.__post_init__`, which sets up the device; the one check
`DPOConfig.__post_init__` makes of its own fields (one `loss_weights` per `loss_type`) is repeated
by `DpoStep`.
"""

from __future__ import annotations

import dataclasses
import difflib
from types import SimpleNamespace
from typing import Any, Dict, Mapping, Tuple

__all__ = ["dpo_settings"]


def _defaults(cls: Any) -> Dict[str, Any]:
    values = {}
    for item in dataclasses.fields(cls):
        if not item.init:
            continue
        if item.default is not dataclasses.MISSING:
            values[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            values[item.name] = item.default_factory()  # type: ignore[misc]
    return values


def _release(version: str) -> Tuple[int, ...]:
    """`"1.14.2"` -> (1, 14, 2); a pre-release's suffix (`"1.16.0rc1"`) ends its number."""
    import re

    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split(".")[:3])


def dpo_settings(values: Mapping[str, Any], where: str, *, peft: bool) -> Tuple[Dict[str, Any], Any]:
    """The `TrainingArguments` values and the `DpoStep` of a `DPOConfig`'s JSON object `values`
    (read from `where`, named in the messages), for a model trained with PEFT adapters or not.

    Raises:
        SettingsFileError: a key that is not a `DPOConfig` field, or a `TrainingArguments` value
            the Trainer refuses (`check_training_args`).
        ValueError: an installed trl older than 1.16, a file naming none of `DPOConfig`'s own fields (not a DPOConfig), or a DPO
            value TRL refuses or the step is not planned for (`dpo_step_from_config`).
    """
    import importlib.metadata

    from transformers import TrainingArguments
    from trl import DPOConfig

    installed = importlib.metadata.version("trl")
    if _release(installed) < (1, 16):
        raise ValueError(f"--trainer dpo needs trl 1.16 or newer (the step planned is its DPOTrainer's, with the fused "
                         f"LM head); installed: trl {installed}")

    from trainer_memcb.plan.settings.step_settings import SettingsFileError, check_training_args
    from trainer_memcb.plan.step.preference import dpo_step_from_config

    dpo_fields = {item.name for item in dataclasses.fields(DPOConfig) if item.init}
    trainer_fields = {item.name for item in dataclasses.fields(TrainingArguments) if item.init}
    unknown = sorted(key for key in values if key not in dpo_fields)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(dpo_fields), n=1)
        which = "is not a DPOConfig field" if len(unknown) == 1 else "are not DPOConfig fields"
        raise SettingsFileError(f"{where}: {', '.join(map(repr, unknown))} {which} (DPOConfig(**args) raises "
                                "TypeError)" + (f"; did you mean {close[0]!r}?" if close else ""))
    own = {key: value for key, value in values.items() if key not in trainer_fields}
    if not own:
        raise ValueError(f"--trainer dpo: {where} names none of DPOConfig's own fields (beta, max_length, loss_type, "
                         "precompute_ref_log_probs, ...): it is not a DPOConfig's JSON (write one with "
                         "DPOConfig(...).to_json_string())")
    trainer_values = {key: value for key, value in values.items() if key in trainer_fields}
    check_training_args(trainer_values, where)
    # The TrainingArguments defaults DPOConfig changes, where the file leaves them out.
    if "gradient_checkpointing" not in trainer_values and "activation_checkpointing" not in trainer_values:
        trainer_values["gradient_checkpointing"] = _defaults(DPOConfig)["gradient_checkpointing"]
    if trainer_values.get("bf16") is None:  # DPOConfig: "Defaults to True if fp16 is not set"
        trainer_values["bf16"] = not trainer_values.get("fp16")
    config = SimpleNamespace(**{key: value for key, value in _defaults(DPOConfig).items() if key not in trainer_fields})
    for key, value in own.items():
        setattr(config, key, value)
    try:
        step = dpo_step_from_config(config, peft=peft)
    except TypeError:  # a string where TRL compares a number
        raise ValueError(f"--trainer dpo: {where}: beta {config.beta!r}, label_smoothing {config.label_smoothing!r}: "
                         "expected numbers") from None
    except ValueError as error:
        raise ValueError(f"--trainer dpo: {where}: {error}") from None
    return trainer_values, step
