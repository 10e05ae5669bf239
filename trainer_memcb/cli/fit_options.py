"""The options of `estimate --fit`, parsed and checked before torch is imported.

`trainer_memcb.cli.fit_table` runs the search and prints it; this module only knows the command
line, so that a usage error of `--fit` is answered at once (`tests/cli/test_cli_fast_usage_errors.py`).
"""

from __future__ import annotations

import argparse
import os
from typing import List

from trainer_memcb.cli.choices import ALLOWED_CHANGES, positive_int
from trainer_memcb.cli.estimate_request import EstimateRequest

__all__ = ["add_fit_arguments", "check_fit_options"]


def _allowed(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALLOWED_CHANGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{(unknown or [text])[0]!r} is not one of: {', '.join(ALLOWED_CHANGES)} "
                                         "(comma-separated)")
    return names


def add_fit_arguments(estimate: argparse.ArgumentParser) -> None:
    """The options of `--fit`."""
    group = estimate.add_argument_group(
        "make it fit", "with --fit and --device-memory, the settings that keep what is learned (the batch with the "
        "accumulation that keeps the effective batch, gradient checkpointing, leaner optimizers, ZeRO, FSDP2 and "
        "tensor parallelism with several processes), each planned by the same trace, ranked by their estimated step time")
    group.add_argument("--fit", action="store_true", help="search the settings that fit (needs --device-memory)")
    group.add_argument("--allow", type=_allowed, metavar="CHANGES", default=[],
                       help=f"also changes that alter the training: {','.join(ALLOWED_CHANGES)}")
    group.add_argument("--max-proposals", type=positive_int, default=16, metavar="N",
                       help="the most proposals planned (default 16)")
    group.add_argument("--write-training-args", metavar="FILE",
                       help="write the first proposal that fits as TrainingArguments JSON")
    group.add_argument("--write-deepspeed", metavar="FILE",
                       help="write the first proposal's DeepSpeed config (where it uses ZeRO)")
    group.add_argument("--write-accelerate-config", metavar="FILE",
                       help="write the first proposal's accelerate config (where it uses FSDP2 or tensor "
                            "parallelism; YAML, or JSON for a .json name), for accelerate launch --config_file")
    group.add_argument("--force", action="store_true", help="replace files that --write-* name")


def check_fit_options(args: EstimateRequest) -> None:
    """Refuse --fit's options where they cannot act, and a destination that cannot be written,
    before anything is planned.

    Raises:
        ValueError: one line naming the option and what it needs.
    """
    from trainer_memcb.utils.safe_io import UnsafeFileError, check_writable, refuse_unsafe_destination

    fit = getattr(args, "fit", False)
    for name, option in (("allow", "--allow"), ("write_training_args", "--write-training-args"),
                         ("write_deepspeed", "--write-deepspeed"),
                         ("write_accelerate_config", "--write-accelerate-config"), ("force", "--force")):
        if getattr(args, name, None) and not fit:
            raise ValueError(f"{option} has no effect without --fit")
    if not fit:
        return
    if not (args.questions.step or args.questions.evaluation):
        raise ValueError("--fit needs the step plan: --batch-size (or per_device_train_batch_size in --training-args), "
                         "or the evaluation plan: --eval-samples")
    if args.device_memory is None:
        raise ValueError("--fit needs --device-memory (the accelerator's memory per process, e.g. 80GiB)")
    if args.max_proposals < 1:
        raise ValueError(f"--max-proposals {args.max_proposals}: expected a whole number of at least 1")
    for path in (args.write_training_args, args.write_deepspeed, getattr(args, "write_accelerate_config", None)):
        if path is None:
            continue
        try:
            refuse_unsafe_destination(path)
        except UnsafeFileError as error:
            raise ValueError(str(error)) from None
        if os.path.lexists(path) and not args.force:
            raise ValueError(f"{path} exists; not replacing it without --force")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{path}: the folder {folder} does not exist")
        check_writable(path, folder)
