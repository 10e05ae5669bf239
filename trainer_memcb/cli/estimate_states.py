"""The model-states plan (`estimate_plan`) and the optimizer what-if (`estimate_what_if`) for the
options of `trainer-memcb estimate`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_memcb.cli.device_options import usable_memory
from trainer_memcb.cli.estimate_asked import ENGINE_FILES, parameter_count
from trainer_memcb.cli.estimate_checks import check_count_options, refuse_what_if_of_a_count
from trainer_memcb.cli.estimate_model import estimate_model
from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.cli.estimate_settings import autocast_keeps_dtype, plan_precision, precision_from_dtype, step_settings
from trainer_memcb.cli.progress import say_progress

if TYPE_CHECKING:
    from trainer_memcb.plan.answers.model_states import ModelStatesPlan
    from trainer_memcb.plan.optimizers.whatif import WhatIf

__all__ = ["estimate_plan", "estimate_what_if"]


def estimate_plan(args: EstimateRequest) -> ModelStatesPlan:
    """The model-states plan for the model (or parameter count) and setup the options describe.

    The optimizers get `--optim-args` and `--optim-target-modules` as in the what-if. Without
    `--precision` the precision follows `--dtype`, and each parameter keeps the dtype the model
    was built in (PEFT's float32 adapters over a bfloat16 base), as the what-if counts them.
    `--deepspeed` and `--fsdp-config` give the setup (ZeRO stage, precision, offload, resharding,
    the world size `train_batch_size` implies) as the step plan reads them, the flags given
    overriding them; `--replicate` shards FSDP's states within each replica.

    Raises:
        ValueError: options that do not fit (see `estimate_model`), a bad setup or memory size.
        ModelConfigError: no model config, or no parameter left to train.
    """
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.settings.setup import Setup

    memory = usable_memory(args)
    count = parameter_count(args.model)
    if count is not None:
        check_count_options(args)
    model = count if count is not None else estimate_model(args)
    if any(getattr(args, name, None) is not None for name in ENGINE_FILES) or (getattr(args, "replicate", None) or 1) > 1:
        # The engine's config, then the flags given, as the step plan resolves them (`step_settings`).
        from trainer_memcb.plan.settings.setup import setup_of

        settings = step_settings(args, model if count is None else None)
        setup = setup_of(settings)
        keep_dtypes = (precision_from_dtype(settings.sources) and args.precision is None) or \
            autocast_keeps_dtype(args, settings.precision, settings.sharding)
    else:
        setup = Setup(world_size=args.world_size or 1, nodes=args.nodes or 1,
                      sharding=f"zero{args.zero}" if args.zero else (args.sharding or "none"),
                      precision=plan_precision(args), offload_optimizer=args.offload_optimizer,
                      offload_params=args.offload_params)
        keep_dtypes = args.precision is None or autocast_keeps_dtype(args, setup.precision, setup.sharding)
    say_progress("planning the model states")
    return plan_model_states(model, args.optimizers, setup, device_memory=memory,
                             model_name=args.model if count is None else None,
                             optim_args=args.optim_args, optim_target_modules=args.optim_target_modules,
                             keep_dtypes=keep_dtypes, reference_model=args.reference_model)


def estimate_what_if(args: EstimateRequest) -> WhatIf:
    """Build the model the options describe on the meta device, and its what-if.

    Raises:
        ValueError: options that do not fit the model (an unknown architecture, a bad regular
            expression, LoRA options without --lora-r, LoRA modules PEFT cannot find), or a
            parameter count, which answers the plan only.
        ModelConfigError: no model config, or no parameter left to train.
    """
    from trainer_memcb.plan.optimizers.whatif import what_if

    count = parameter_count(args.model)
    if count is not None:
        refuse_what_if_of_a_count(count)
    model = estimate_model(args)
    say_progress("estimating each optimizer's state")
    return what_if(model, args.optimizers, model_name=args.model,
                   optim_args=args.optim_args, optim_target_modules=args.optim_target_modules)
