"""The step plan's settings from the options of `trainer-memcb estimate` (`--training-args`,
`--deepspeed`, `--fsdp-config`, then the flags), the plan's precision, and whether the parameters
keep --dtype under autocast."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from trainer_memcb.cli.choices import DEFAULT_OPTIMIZERS, TRL_TRAINERS
from trainer_memcb.cli.device_options import DEFAULT_DEVICE_TYPE, alloc_conf_of, reserve_bytes
from trainer_memcb.cli.estimate_model import quantization_asked
from trainer_memcb.cli.estimate_request import EstimateRequest

__all__ = ["step_settings", "plan_precision", "autocast_keeps_dtype", "DTYPE_SOURCE", "precision_from_dtype"]

# The source of a precision that follows --dtype where the settings files name no mixed precision.
DTYPE_SOURCE = "--dtype (no mixed precision in the training args)"


# --dtype's precision for the plan, when --precision is not given.
_DTYPE_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def plan_precision(args: EstimateRequest) -> str:
    return args.precision or _DTYPE_PRECISION[args.dtype or "float32"]


def precision_from_dtype(sources: Dict[str, str]) -> bool:
    """Whether the plan's precision was taken from --dtype (a flag, or `DTYPE_SOURCE`), so that
    each parameter keeps the dtype it was built in."""
    return sources.get("precision", "default") in ("flag", DTYPE_SOURCE)


def autocast_keeps_dtype(args: EstimateRequest, precision: str, sharding: str) -> bool:
    """Whether the parameters keep --dtype under the Trainer's autocast (bf16=True / fp16=True).

    accelerate's `prepare_model` wraps the forward in autocast and casts no parameter, so a model
    loaded in 16 bits (`--dtype float16 --precision autocast-bf16`) trains its 16-bit parameters;
    only FSDP upcasts them to float32 (`fsdp2_prepare_model`: "FSDP upcast of low precision
    parameters"), and a quantized base is laid out by its own rules."""
    return (args.dtype in ("bfloat16", "float16") and precision in ("autocast-bf16", "autocast-fp16")
            and not str(sharding).startswith("fsdp") and not quantization_asked(args))


def step_settings(args: EstimateRequest, model: Any) -> Any:
    """The step plan's settings: `--training-args`, `--deepspeed`, `--fsdp-config`, then the flags
    given explicitly (each value's source kept)."""
    from trainer_memcb.plan.settings import resolve_settings

    flags: Dict[str, Any] = {}
    given = {"world_size": args.world_size, "rank": getattr(args, "rank", None), "nodes": args.nodes, "batch_size": args.batch_size,
             "bucket_cap_mb": getattr(args, "bucket_cap_mb", None), "replicate": getattr(args, "replicate", None),
             "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None)}
    flags.update({key: value for key, value in given.items() if value is not None})
    if args.zero or args.sharding:
        flags["sharding"] = f"zero{args.zero}" if args.zero else args.sharding
    if args.precision or not (args.training_args or args.deepspeed):
        flags["precision"] = plan_precision(args)
    if args.gradient_checkpointing:
        flags["gradient_checkpointing"] = True
    if getattr(args, "gradient_as_bucket_view", False):
        flags["gradient_as_bucket_view"] = True
    if getattr(args, "tp_plan", None) is not None:
        flags["tp_plan"] = args.tp_plan
    if args.offload_params and (flags.get("sharding") or "").startswith("fsdp"):
        flags["fsdp_cpu_offload"] = True
    if list(args.optimizers) != list(DEFAULT_OPTIMIZERS) or not args.training_args:
        flags["optimizer"] = list(args.optimizers)[0]
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) if config is not None else None
    flags.update(_step_shape_and_device(args))
    training_args: Any = args.training_args
    trainer = getattr(args, "trainer", "trainer")
    if trainer in TRL_TRAINERS:  # a TRL config's JSON: its TrainingArguments, its own fields as the step's
        training_args = _trl_config(args, trainer, flags)
    settings = resolve_settings(training_args, deepspeed=getattr(args, "deepspeed", None),
                                fsdp_config=getattr(args, "fsdp_config", None), hidden_size=hidden,
                                parallelism=getattr(args, "parallelism", None), **flags)
    sources = dict(settings.sources, **_not_flags(args, settings))
    if trainer in TRL_TRAINERS:
        sources["preference"] = f"{trainer.upper()}Config (--trainer {trainer})"
    if trainer == "sft" and settings.preference.padding_free:  # the collator's one row, not the flags'
        sources.update(_padding_free_sources(args))
    if (not args.precision and not settings.zero_stage and settings.precision == "fp32"
            and sources.get("precision") != "flag" and (args.dtype or "float32") != "float32"):
        # The settings files name no mixed precision (bf16 and fp16 absent or false): the Trainer
        # then trains the model in the dtype it was loaded in, and never upcasts it (no
        # `model.to(float32)` in trainer.py; accelerate casts only under FSDP's mixed precision,
        # which needs bf16/fp16). So the plan's precision follows --dtype, as without a file.
        settings = dataclasses.replace(settings, precision=_DTYPE_PRECISION[args.dtype])
        sources["precision"] = DTYPE_SOURCE
    if args.offload_optimizer and settings.zero_stage:
        sources["zero.offload_optimizer"] = "flag"
        return dataclasses.replace(settings, zero=dict(settings.zero, offload_optimizer={"device": "cpu"}),
                                   sources=sources)
    return dataclasses.replace(settings, sources=sources)


def _trl_config(args: EstimateRequest, trainer: str, flags: Dict[str, Any]) -> Dict[str, Any]:
    """The `TrainingArguments` values of `--trainer`'s TRL config (a path, or with --fit a proposal's
    values: `trainer_memcb.cli.fit_table.estimate_fit`); its step set in `flags["preference"]`, and
    for SFT the micro-batch's shape its collator makes (`trainer_memcb.cli.sft_config.sft_batch_shape`)."""
    from trainer_memcb.plan.settings import read_json_file

    read, name = _trl_config_reader(trainer)
    proposal = isinstance(args.training_args, dict)
    values = args.training_args if proposal else read_json_file(args.training_args, "--training-args")
    where = f"a --fit proposal's {name}" if proposal else f"{name} {args.training_args!r}"
    training_args, flags["preference"] = read(values, where, peft=getattr(args, "lora_r", None) is not None)
    if trainer == "sft":  # rows of --seq-len, or padding-free one row of the micro-batch's tokens
        from trainer_memcb.cli.sft_config import sft_batch_shape

        if flags["preference"].padding_free and getattr(args, "fit", False) and args.packing is not None:
            raise ValueError(f"--packing {args.packing} with --fit and --trainer sft: --fit resizes {where}'s "
                             "padding-free row as per_device_train_batch_size x --seq-len tokens; leave --packing out")
        sft_batch_shape(flags, flags["preference"], where, training_args)
    return training_args


def _padding_free_sources(args: EstimateRequest) -> Dict[str, str]:
    """Where a padding-free SFT step's batch comes from: the SFTConfig's collator, one row."""
    sources = {"batch_size": "SFTConfig (padding-free: one row)"}
    if getattr(args, "packing", None) is None:
        rows = "--batch-size" if args.batch_size is not None else "per_device_train_batch_size"
        sources["packing"] = f"SFTConfig (padding-free: {rows} x --seq-len)"
    return sources


def _trl_config_reader(trainer: str) -> Any:
    """The reader of `--trainer`'s TRL config (`trainer_memcb.cli.dpo_config`, ...) and the config's name."""
    from trainer_memcb.cli.dpo_config import dpo_settings
    from trainer_memcb.cli.grpo_config import grpo_settings
    from trainer_memcb.cli.kto_config import kto_settings
    from trainer_memcb.cli.rloo_config import rloo_settings
    from trainer_memcb.cli.sft_config import sft_settings

    return {"sft": (sft_settings, "SFTConfig"), "dpo": (dpo_settings, "DPOConfig"), "kto": (kto_settings, "KTOConfig"),
            "grpo": (grpo_settings, "GRPOConfig"), "rloo": (rloo_settings, "RLOOConfig")}[trainer]


def _step_shape_and_device(args: EstimateRequest) -> Dict[str, Any]:
    """The micro-batch's shape and the device as the options give them: the reserve with
    --device-memory (the command's default without --reserve), the allocator's settings on CUDA
    (--alloc-conf, else the environment's, read once here)."""
    given = {"seq_len": args.seq_len, "target_len": getattr(args, "target_len", None),
             "image_size": getattr(args, "image_size", None), "padding": getattr(args, "padding", 0) or None,
             "packing": getattr(args, "packing", None), "torch_compile": getattr(args, "torch_compile", None),
             "use_liger_kernel": getattr(args, "use_liger_kernel", None),
             "liger_kernel_config": getattr(args, "liger_kernel_config", None),
             "attn_implementation": getattr(args, "attn_implementation", None),
             "device_type": getattr(args, "device_type", None), "device_memory": args.device_memory,
             "reserve_bytes": reserve_bytes(args), "gpu": getattr(args, "gpu", None)}
    if (getattr(args, "device_type", None) or DEFAULT_DEVICE_TYPE) == "cuda":
        given["alloc_conf"] = alloc_conf_of(args).text
    return {key: value for key, value in given.items() if value is not None}


def _not_flags(args: EstimateRequest, settings: Any) -> Dict[str, str]:
    """The sources of the values the command chose itself: its reserve, the environment's allocator settings."""
    sources = {}
    if "reserve_bytes" in settings.sources and getattr(args, "reserve", None) is None:
        sources["reserve_bytes"] = "default (--reserve's)"
    if "alloc_conf" in settings.sources and getattr(args, "alloc_conf", None) is None:
        sources["alloc_conf"] = "environment (PYTORCH_CUDA_ALLOC_CONF)" if settings.alloc_conf else "default"
    return sources
