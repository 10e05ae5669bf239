"""The per-device batch (`per_device_train_batch_size`) of a step's settings, and the settings at
another one, the micro-batch shaped as the trainer's collator shapes it.

For most steps the planned batch is the per-device batch's rows. TRL's padding-free SFT step
(`trainer_memcb.plan.step.sft.SftStep.padding_free`) flattens the micro-batch into one row: its
settings hold one row of `per_device_train_batch_size` x `seq_len` tokens (`packing`), so the
searches (`--max-batch-size`, `--fit`) resize that row's tokens where they change the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["per_device_batch", "settings_at_batch", "packs_the_batch"]


def packs_the_batch(settings: Any) -> bool:
    """Whether the step's collator flattens the per-device batch into one row (TRL's padding-free SFT
    step), so that the batch is `packing // seq_len` rows rather than `batch_size`."""
    return bool(getattr(getattr(settings, "preference", None), "padding_free", False))


def per_device_batch(settings: Any) -> Optional[int]:
    """The `per_device_train_batch_size` the settings plan: the rows flattened into a padding-free
    SFT step's one row (its `packing` tokens over `seq_len`), else `batch_size`."""
    if packs_the_batch(settings) and settings.packing is not None and settings.seq_len:
        return settings.packing // settings.seq_len
    return settings.batch_size


def settings_at_batch(settings: Any, batch: int) -> Any:
    """`settings` at the per-device batch `batch`, the rest kept: `batch` rows, or for a padding-free
    SFT step one row of `batch` x `seq_len` tokens, as `DataCollatorForLanguageModeling` flattens them."""
    if packs_the_batch(settings):
        return dataclasses.replace(settings, batch_size=1, packing=batch * settings.seq_len)
    return dataclasses.replace(settings, batch_size=batch)
