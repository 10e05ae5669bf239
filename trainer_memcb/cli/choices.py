"""The values the command's options take, importable without torch.

The command line is parsed and checked before torch and transformers are imported (seconds), so
that a usage error is answered in the time `--version` takes. The lists below are those of the
modules that use them, which import torch: `tests/cli/test_cli_fast_usage_errors.py` holds each
equal to its source.
"""

from __future__ import annotations

import argparse
import json
from typing import Dict

from trainer_memcb.utils.units import parse_whole_number

__all__ = ["positive_int", "TRL_TRAINERS", "non_negative_int", "liger_kernel_config", "tp_plan", "SHARDINGS", "PRECISIONS", "DTYPES", "DEVICE_TYPES", "QUANT_TYPES", "DEFAULT_OPTIMIZERS", "EVAL_LOGITS",
           "DEFAULT_METRICS", "ALLOWED_CHANGES"]

# trainer_memcb.plan.settings.setup.SHARDINGS
SHARDINGS = ("none", "ddp", "fsdp-full-shard", "fsdp-shard-grad-op", "zero1", "zero2", "zero3")
# trainer_memcb.plan.settings.setup.PRECISIONS' names (the table of bytes per value is there)
PRECISIONS = ("fp32", "autocast-bf16", "autocast-fp16", "bf16", "fp16", "deepspeed-bf16", "deepspeed-fp16")
# trainer_memcb.plan.optimizers.whatif.DTYPES' names
DTYPES = ("float32", "bfloat16", "float16")
# trainer_memcb.plan.step.trace.DEVICE_TYPES
DEVICE_TYPES = ("cuda", "cpu")
# `--trainer`: TRL's trainers whose step is planned from their config's JSON (transformers' Trainer is "trainer").
TRL_TRAINERS = ("sft", "dpo", "kto", "grpo", "rloo")
# trainer_memcb.plan.model.quantized.QUANT_TYPES
QUANT_TYPES = ("nf4", "fp4")
# trainer_memcb.plan.optimizers.whatif.DEFAULT_OPTIMIZERS
DEFAULT_OPTIMIZERS = ("adamw_torch", "adafactor", "adamw_bnb_8bit")
# trainer_memcb.plan.answers.eval_memory.EVAL_LOGITS
EVAL_LOGITS = ("full", "argmax", "none")
# The lesson's metrics, eval accuracy and F1 (`compute_metrics` returning "accuracy" and "f1"), that
# `report` and `compare` show first when the runs logged them.
DEFAULT_METRICS = ("accuracy", "f1")
# trainer_memcb.plan.answers.fit.ALLOWED_CHANGES: the changes `--allow` opens, that alter the training
ALLOWED_CHANGES = ("lora", "qlora", "seq-len")


def positive_int(text: str) -> int:
    """The argparse type of every whole-number option counted from 1 (`--batch-size`, `--seq-len`,
    `--eval-samples`, ...): 1 to `trainer_memcb.utils.units.MAX_WHOLE_NUMBER`, one line otherwise."""
    try:
        return parse_whole_number(text, least=1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def non_negative_int(text: str) -> int:
    """The argparse type of the whole-number options counted from 0 (`--rank`, `--padding`)."""
    try:
        return parse_whole_number(text, least=0, example=16)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def liger_kernel_config(text: str) -> Dict[str, bool]:
    """The argparse type of `--liger-kernel-config`: a JSON object of liger-kernel's kernels to true or
    false, checked as the settings check `liger_kernel_config`; one line otherwise."""
    from trainer_memcb.plan.settings.step_settings import check_liger_kernel_config

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: give an object such as '{{\"rope\": false}}'") from None
    try:
        check_liger_kernel_config(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return dict(value)


def tp_plan(text: str) -> Dict[str, str]:
    """The argparse type of `--tp-plan`: a JSON object of module names to transformers' style names,
    inline or in a file, checked as the settings check `tp_plan`; one line otherwise."""
    from trainer_memcb.plan.settings.step_settings import check_tp_plan, read_json_file

    try:
        value = json.loads(text) if text.lstrip().startswith("{") else read_json_file(text, "--tp-plan")
        check_tp_plan(value)
    except ValueError as error:
        if isinstance(error, json.JSONDecodeError):
            error = ValueError(f"{text!r} is not JSON: give an object such as "
                               "'{\"model.layers.*.mlp.down_proj\": \"rowwise\"}', or a file holding one")
        raise argparse.ArgumentTypeError(str(error)) from None
    return dict(value)
