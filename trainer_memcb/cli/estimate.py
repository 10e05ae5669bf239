"""`trainer-memcb estimate MODEL`: the what-if before training, as a table.

The figures come from `trainer_memcb.whatif.what_if`; this module declares the command's options,
builds the meta model they describe (LoRA adapters and trainable names included), and formats
the result.
"""

from __future__ import annotations

import argparse
from typing import Any, List

from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell
from trainer_memcb.lora import add_lora_adapters
from trainer_memcb.optim_options import parse_optim_args, parse_optim_target_modules
from trainer_memcb.whatif import (
    DEFAULT_OPTIMIZERS,
    DTYPES,
    ModelConfigError,
    WhatIf,
    build_meta_model,
    resolve_dtype,
    resolve_optimizer_names,
    select_trainable,
    what_if,
)

__all__ = ["add_estimate_arguments", "estimate_what_if", "estimate_tables"]


def _checked(parse):
    """An argparse type from a parser that raises ValueError naming the bad value."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = parse.__name__
    return convert


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive integer, e.g. 8")
    return value


def add_estimate_arguments(estimate: argparse.ArgumentParser) -> None:
    """The options of `trainer-memcb estimate`."""
    estimate.add_argument("model", metavar="MODEL", help="a folder holding config.json, or a hub name when online")
    estimate.add_argument(
        "--optimizers", type=_checked(resolve_optimizer_names), default=DEFAULT_OPTIMIZERS,
        help=f"the Trainer's optim names, comma-separated (default: {','.join(DEFAULT_OPTIMIZERS)}); "
             "any OptimizerNames value, e.g. adamw,adafactor,adamw_8bit,galore_adamw,lomo",
    )
    estimate.add_argument(
        "--optim-args", metavar="K=V,...", type=_checked(parse_optim_args),
        help="the Trainer's optim_args, e.g. 'rank=64,update_proj_gap=200' (GaLore, APOLLO, AdEMAMix, ...)",
    )
    estimate.add_argument(
        "--optim-target-modules", metavar="MODULES", type=_checked(parse_optim_target_modules),
        help="the Trainer's optim_target_modules (GaLore, APOLLO): one regular expression matched against "
             "whole module names, e.g. '.*(attn|mlp).*', or 'all-linear', or a comma list of name parts, e.g. attn,mlp",
    )
    estimate.add_argument(
        "--architecture", metavar="CLASS",
        help="the transformers class to build, e.g. DistilBertForSequenceClassification; default: the config's",
    )
    estimate.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the parameters' dtype (default: float32)")
    estimate.add_argument(
        "--lora-r", metavar="R", type=_checked(_positive_int),
        help="add PEFT LoRA adapters of this rank; then only the adapters (and --lora-modules-to-save) train",
    )
    estimate.add_argument(
        "--lora-target-modules", metavar="MODULES",
        help="LoraConfig.target_modules: a comma list of module-name suffixes, e.g. q_proj,v_proj, or one regular "
             "expression, or 'all-linear' (default: PEFT's for the architecture)",
    )
    estimate.add_argument(
        "--lora-modules-to-save", metavar="MODULES",
        help="LoraConfig.modules_to_save: modules trained in full beside the adapters, e.g. lm_head or classifier",
    )
    estimate.add_argument(
        "--trainable", metavar="REGEX",
        help="train only the parameters whose name matches (re.search), e.g. 'q_proj|v_proj'; with --lora-r, only "
             "those of PEFT's choice whose name matches (base_model.model....lora_A.default.weight); default: all, "
             "or PEFT's choice",
    )
    estimate.add_argument("--json", action="store_true", help="print JSON with the exact figures instead of tables")


def estimate_what_if(args: argparse.Namespace) -> WhatIf:
    """Build the model the options describe on the meta device, and its what-if.

    Raises:
        ValueError: options that do not fit the model (an unknown architecture, a bad regular
            expression, LoRA options without --lora-r, LoRA modules PEFT cannot find).
        ModelConfigError: no model config, or no parameter left to train.
    """
    if args.lora_r is None and (args.lora_target_modules is not None or args.lora_modules_to_save is not None):
        raise ValueError("--lora-target-modules and --lora-modules-to-save need --lora-r (the adapters' rank)")
    model = build_meta_model(args.model, resolve_dtype(args.dtype), args.architecture)
    if args.lora_r is not None:
        model = add_lora_adapters(model, args.lora_r, args.lora_target_modules, args.lora_modules_to_save)
    if args.trainable is not None:
        if select_trainable(model, args.trainable, narrow=args.lora_r is not None) == 0:
            names = [name for name, _ in model.named_parameters()][:3]
            raise ModelConfigError(f"no parameter name of {args.model} matches --trainable {args.trainable!r}; "
                                   f"names look like: {', '.join(names)}")
    return what_if(model, args.optimizers, model_name=args.model,
                   optim_args=args.optim_args, optim_target_modules=args.optim_target_modules)


def _per_param(num_bytes: int, params: int) -> str:
    return f"{num_bytes / params:.3f}" if params else "-"


def estimate_tables(result: WhatIf) -> List[TextTable]:
    """The model's parameters, then one row per optimizer, the smallest state first."""
    model = TextTable(f"Model {result.model} (meta device: no weights read)", ["", "value"], [
        ["parameters", count_cell(result.total_params)],
        ["trainable parameters", count_cell(result.trainable_params)],
        ["trainable tensors", count_cell(result.trainable_tensors)],
        ["trainable dtype", ", ".join(result.trainable_dtypes)],
        ["trainable weights", bytes_cell(result.trainable_bytes)],
    ])
    known = sorted((e for e in result.optimizers if e.estimate is not None), key=lambda e: e.estimate.num_bytes)
    rows = [[e.name, bytes_cell(e.estimate.num_bytes), _per_param(e.estimate.num_bytes, result.trainable_params),
             e.optimizer_class or "-"] for e in known]
    rows += [[e.name, "-", "-", e.problem or "-"] for e in result.optimizers if e.estimate is None]
    optimizers = TextTable(
        "Optimizer state once every trainable parameter has had a gradient",
        ["optimizer (Trainer optim)", "state estimate", "bytes / trainable param", "class / problem"],
        rows,
        text_columns=(0, 3),
    )
    return [model, optimizers]
