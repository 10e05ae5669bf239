"""Which answer the options of `trainer-memcb estimate` ask for: the optimizer what-if, the
model-states plan (`plan_asked`) or the step plan (`step_asked`); whether MODEL is a bare parameter
count (`parameter_count`), and whether peft or torchao is needed (`needs_peft`, `needs_torchao`).
From the command line alone (and the settings file it names, read as JSON), before torch is imported:
each function takes the parsed options or their request (`trainer_memcb.cli.estimate_request`),
which reads the plans asked once (`EstimateQuestions`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Optional

__all__ = ["EstimateQuestions", "eval_asked", "needs_peft", "needs_torchao", "parameter_count", "plan_asked", "step_asked",
           "ENGINE_FILES"]


def needs_peft(args: Any) -> bool:
    """Whether the estimate asked for needs peft (LoRA adapters): `--lora-r`, or `--fit` allowed to
    propose them (`--allow lora` or `qlora`)."""
    allowed = getattr(args, "allow", None) or ()
    return getattr(args, "lora_r", None) is not None or (bool(getattr(args, "fit", False))
                                                          and bool({"lora", "qlora"} & set(allowed)))


# Any of these turns `estimate` into the model-states plan.
_PLAN_OPTIONS = ("world_size", "nodes", "sharding", "zero", "offload_optimizer", "offload_params", "precision",
                 "device_memory", "reference_model", "replicate", "gpu")
# So do the engines' config files, read for the plan's setup as the step plan reads them.
ENGINE_FILES = ("deepspeed", "fsdp_config")


def plan_asked(args: Any) -> bool:
    """Whether the options ask for the model-states plan rather than the optimizer what-if (an
    engine's config does: its stage, precision and offload are the plan's)."""
    return any(getattr(args, name, None) not in (None, False) for name in _PLAN_OPTIONS + ENGINE_FILES)


# The Trainer's optimizers that torchao provides (transformers' `_TORCHAO_OPTIMIZERS`, held equal
# by tests/test_startup.py).
TORCHAO_OPTIMIZERS = ("adamw_torch_4bit", "adamw_torch_8bit")


def needs_torchao(args: Any) -> bool:
    """Whether the estimate asked for may build one of torchao's optimizers: `--optimizers` names
    one, or the `--training-args` file's `optim` does (a file that cannot be read as a JSON object
    answers yes, so that the plan's own reading of it says why). `--fit` proposes none."""
    named = getattr(args, "optimizers", None) or ()
    if isinstance(named, str):
        named = named.split(",")
    if any(str(name).strip() in TORCHAO_OPTIMIZERS for name in named):
        return True
    path = getattr(args, "training_args", None)
    if not isinstance(path, (str, os.PathLike)):
        return path is not None
    value = _settings_file(os.fspath(path))
    return not isinstance(value, dict) or str(value.get("optim", "")) in TORCHAO_OPTIMIZERS


def step_asked(args: Any) -> bool:
    """Whether the options ask for the step plan (activations and the step's peak): --batch-size,
    --max-batch-size, or --training-args, unless the evaluation plan is asked and the file gives no
    per_device_train_batch_size (as the evaluation's --fit writes it): then the file gives the
    evaluation's settings alone."""
    if getattr(args, "batch_size", None) is not None or bool(getattr(args, "max_batch_size", False)):
        return True
    path = getattr(args, "training_args", None)
    if path is None:
        return False
    if getattr(args, "eval_samples", None) is not None and isinstance(path, (str, os.PathLike)):
        return _file_gives_train_batch(os.fspath(path))
    return True


def eval_asked(args: Any) -> bool:
    """Whether the options ask for the evaluation plan (--eval-samples)."""
    return getattr(args, "eval_samples", None) is not None


@dataclass(frozen=True)
class EstimateQuestions:
    """Which plans the options ask for, read once (`of`): the step plan (`step_asked`), the
    model-states plan (`plan_asked`), the evaluation plan (`eval_asked`)."""

    step: bool
    plan: bool
    evaluation: bool

    @classmethod
    def of(cls, args: Any) -> "EstimateQuestions":
        return cls(step=step_asked(args), plan=plan_asked(args), evaluation=eval_asked(args))


def _file_gives_train_batch(path: str) -> bool:
    """Whether a --training-args file names per_device_train_batch_size; a file that cannot be read
    as a JSON object answers yes, so that the step plan's reading of it says why."""
    value = _settings_file(path)
    return not isinstance(value, dict) or value.get("per_device_train_batch_size") is not None


def _settings_file(path: str) -> object:
    """A --training-args file's JSON value, or None when it cannot be read (its refusal is said by
    the plan's own reading)."""
    from trainer_memcb.utils.safe_io import read_json
    from trainer_memcb.utils.units import MiB

    try:
        return read_json(path, 16 * MiB)  # `MAX_SETTINGS_FILE_BYTES`, without importing the plan
    except Exception:  # any refusal is said by the step plan's own reading
        return None


# A parameter count given as MODEL: digits (`7500000000`, `7_500_000_000`, `7,500,000,000`) or a
# number in e-notation (`7.5e9`) that is whole.
_COUNT = re.compile(r"\d[\d_,]*|\d+\.\d+|\d+(\.\d+)?[eE]\+?\d+")


def parameter_count(text: str) -> Optional[int]:
    """The parameter count MODEL spells, or None when it names a model (an existing folder wins).

    Raises:
        ValueError: a number that is not a whole count of at least 1.

    Examples:
        >>> parameter_count("7.5e9"), parameter_count("7_500_000_000"), parameter_count("gpt2")
        (7500000000, 7500000000, None)
    """
    if os.path.exists(text) or not _COUNT.fullmatch(text):
        return None
    value = Decimal(text.replace("_", "").replace(",", ""))
    if value != value.to_integral_value() or value < 1:
        raise ValueError(f"MODEL {text!r} is not a whole parameter count of at least 1, e.g. 7.5e9 or 7500000000")
    return int(value)
