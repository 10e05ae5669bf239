"""An `SFTConfig`'s JSON read as the step plan reads it (`--trainer sft`): split into the
`TrainingArguments` it extends and the SFT step (`trainer_memcb.plan.step.sft.SftStep`), and the
micro-batch's shape the step takes from it.

As for DPO (`trainer_memcb.cli.dpo_config`), the own fields are read onto a namespace of
`SFTConfig`'s defaults (`trainer_memcb.cli.trl_config`), and `sft_step_from_config` repeats the
checks TRL makes of them. The rows are `--seq-len` tokens, at most the config's `max_length`
(`SFTTrainer` cuts every row to it). Padding-free (`padding_free`, or `packing` with the "bfd"
strategies), the collator flattens the micro-batch into one row: the plan's batch is then that row,
`--batch-size` (else the config's `per_device_train_batch_size`) x `--seq-len` tokens (the
repository's `--packing TOKENS` row, which may be given instead).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

__all__ = ["sft_settings", "sft_batch_shape"]


def sft_settings(values: Mapping[str, Any], where: str, *, peft: bool) -> Tuple[Dict[str, Any], Any]:
    """The `TrainingArguments` values and the `SftStep` of an `SFTConfig`'s JSON object `values`
    (read from `where`, named in the messages); `peft` changes nothing of the SFT step.

    Raises:
        SettingsFileError: a key that is not an `SFTConfig` field, or a `TrainingArguments` value
            the Trainer refuses (`check_training_args`).
        ValueError: an installed trl older than 1.16, a file naming none of `SFTConfig`'s own
            fields, or an SFT value TRL refuses or the step is not planned for (`sft_step_from_config`).
    """
    from trl import SFTConfig

    from trainer_memcb.cli.trl_config import trl_config_parts
    from trainer_memcb.plan.step.sft import sft_step_from_config

    del peft  # SFTTrainer's step is the same with adapters: no reference to make
    trainer_values, config = trl_config_parts(values, where, SFTConfig, "sft",
                                              "max_length, packing, padding_free, loss_type")
    try:
        step = sft_step_from_config(config)
    except ValueError as error:
        raise ValueError(f"--trainer sft: {where}: {error}") from None
    if trainer_values.get("average_tokens_across_devices") is False:
        import dataclasses

        step = dataclasses.replace(step, average_tokens_across_devices=False)
    return trainer_values, step


def sft_batch_shape(flags: Dict[str, Any], step: Any, where: str, training_values: Mapping[str, Any]) -> None:
    """Set the micro-batch's shape in `flags` (the step plan's `batch_size`, `seq_len`, `packing`)
    as `SFTTrainer`'s collator makes it for `step`: rows of `seq_len` tokens, or padding-free one
    row of `batch_size` x `seq_len` tokens (`packing`, given or made) with `batch_size` 1; the
    batch is `--batch-size`'s, else the config's `per_device_train_batch_size` (its
    `TrainingArguments` values `training_values`), which `--fit`'s proposals change.

    Raises:
        ValueError: `--seq-len` past `max_length`, or `--packing` without a padding-free config.
    """
    seq_len, packing = flags.get("seq_len"), flags.get("packing")
    if seq_len is not None and seq_len > step.max_length:
        raise ValueError(f"--seq-len {seq_len} is longer than {where}'s max_length {step.max_length}: SFTTrainer "
                         "cuts every row to max_length; give --seq-len at most it")
    if not step.padding_free:
        if packing is not None:
            raise ValueError(f"--packing {packing} with --trainer sft: {where} makes padded rows (neither padding_free "
                             "nor packing with a bfd strategy); leave --packing out or set packing true")
        return
    if packing is None and seq_len is not None:
        from transformers import TrainingArguments

        default = TrainingArguments.__dataclass_fields__["per_device_train_batch_size"].default
        flags["packing"] = flags.get("batch_size", training_values.get("per_device_train_batch_size", default)) * seq_len
    flags["batch_size"] = 1
