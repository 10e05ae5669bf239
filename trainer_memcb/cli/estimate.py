"""`trainer-memcb estimate MODEL`: the what-if before training, as a table.

The figures come from `trainer_memcb.plan.optimizers.whatif.what_if`; this module declares the command's options,
builds the meta model they describe (LoRA adapters and trainable names included), and formats
the result.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Dict, List, Optional

# Only modules that import no torch: the options are parsed and checked (`check_options`) before
# the plan's modules are imported, inside the functions that use them.
from trainer_memcb.cli.choices import (DEFAULT_OPTIMIZERS, DEVICE_TYPES, DTYPES, PRECISIONS, QUANT_TYPES, SHARDINGS,
                                      non_negative_int, positive_int)
from trainer_memcb.cli.collector import freeze_what_was_imported
from trainer_memcb.cli.eval_estimate import EVAL_NEEDS_SEQ_LEN, add_eval_arguments
from trainer_memcb.cli.fit_options import add_fit_arguments
from trainer_memcb.cli.device_options import (
    DEFAULT_DEVICE_TYPE,
    alloc_conf_of,
    apply_gpu,
    cuda_context_bytes,
    reserve_bytes,
)
from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell
from trainer_memcb.cli.progress import say_progress
from trainer_memcb.plan.settings.optim_options import parse_optim_args, parse_optim_target_modules
from trainer_memcb.utils.units import format_bytes, parse_size

if TYPE_CHECKING:
    from trainer_memcb.plan.answers.model_states import ModelStatesPlan
    from trainer_memcb.plan.model.quantized import Quantization
    from trainer_memcb.plan.answers.step_memory import StepMemoryPlan
    from trainer_memcb.plan.optimizers.whatif import WhatIf

__all__ = [
    "add_estimate_arguments",
    "alloc_conf_of",
    "apply_gpu",
    "cuda_context_bytes",
    "check_options",
    "reserve_bytes",
    "usable_memory",
    "estimate_model",
    "estimate_plan",
    "estimate_tables",
    "estimate_what_if",
    "needs_peft",
    "parameter_count",
    "plan_asked",
    "resolve_optimizers",
    "step_asked",
    "estimate_step",
]


def _checked(parse):
    """An argparse type from a parser that raises ValueError naming the bad value."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = parse.__name__
    return convert


def _size(text: str) -> int:
    return parse_size(text, "size")


def _memory(text: str) -> int:
    """--device-memory: a size above 0 (no process trains in none)."""
    size = parse_size(text, "size")
    if size == 0:
        raise ValueError(f"{text!r} is no memory: give the accelerator's memory per process, e.g. 80GiB")
    return size


def usable_memory(args: argparse.Namespace) -> Optional[int]:
    """--device-memory less the CUDA context and the reserve: what the model states' fits? is
    answered against and the largest batch searched in (None without --device-memory).

    Raises:
        ValueError: a reserve as large as the memory.
    """
    reserve = reserve_bytes(args)
    if reserve is None:
        return None
    reserve += cuda_context_bytes(args)
    if reserve >= args.device_memory:
        given = (f"--reserve {format_bytes(args.reserve)} with the CUDA context" if args.reserve is not None else
                 f"the CUDA context of {format_bytes(reserve)}")
        raise ValueError(f"{given} leaves nothing of --device-memory {format_bytes(args.device_memory)}: "
                         "give a smaller --reserve (0B for none)")
    return args.device_memory - reserve


def _alloc_conf(text: str) -> Any:
    from trainer_memcb.plan.device.alloc_conf import parse_alloc_conf

    return parse_alloc_conf(text)


class _GpuAction(argparse.Action):
    """--gpu NAME: the preset's name, checked as parsed; `--gpu list` prints the presets and exits 0."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option_string: Optional[str] = None) -> None:
        from trainer_memcb.plan.device.gpus import gpu_preset, gpu_presets

        if str(value).strip().lower() == "list":
            rows = [[p.name, p.torch_name, bytes_cell(p.total_bytes), f"{p.compute_capability[0]}.{p.compute_capability[1]}",
                     p.architecture, bytes_cell(p.cuda_context_bytes)] for p in gpu_presets()]
            table = TextTable("GPU presets (--gpu NAME, any case)",
                              ["name", "torch.cuda.get_device_name()", "memory (mem_get_info total)",
                               "compute capability", "architecture", "CUDA context"], rows, text_columns=(0, 1, 4))
            from trainer_memcb.cli.output import print_tables
            import sys

            print_tables([table], sys.stdout)
            parser.exit(0)
        try:
            setattr(namespace, self.dest, gpu_preset(value).name)
        except ValueError as error:
            raise argparse.ArgumentError(self, str(error)) from None


def _optimizer_list(text: str) -> List[str]:
    """The names as given; they are checked against the Trainer's after parsing (`resolve_optimizers`),
    since the list of names comes from transformers, which parsing does not import."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give one or more of the Trainer's optim names, e.g. adamw,adafactor")
    return names


def resolve_optimizers(args: argparse.Namespace) -> None:
    """Check `--optimizers` against the Trainer's names, aliases resolved, in place.

    Raises:
        ValueError: `argument --optimizers: optimizer 'x' is not one of: ...`.
    """
    from trainer_memcb.plan.optimizers.whatif import resolve_optimizer_names

    try:
        args.optimizers = resolve_optimizer_names(args.optimizers)
    except ValueError as error:
        raise ValueError(f"argument --optimizers: {error}") from None


def needs_peft(args: argparse.Namespace) -> bool:
    """Whether the estimate asked for needs peft (LoRA adapters)."""
    return getattr(args, "lora_r", None) is not None


def add_estimate_arguments(estimate: argparse.ArgumentParser) -> None:
    """The options of `trainer-memcb estimate`."""
    estimate.add_argument("model", metavar="MODEL",
                          help="a folder holding config.json, a hub name when online, or for the model-states plan a "
                               "parameter count (7.5e9, 7500000000), taken as one flat tensor")
    estimate.add_argument(
        "--optimizers", type=_optimizer_list, default=DEFAULT_OPTIMIZERS,
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
    estimate.add_argument("--dtype", choices=list(DTYPES),
                          help="the parameters' dtype (default: float32); for the plan, also the precision when "
                               "--precision is not given (bfloat16: bf16, float16: fp16)")
    estimate.add_argument(
        "--lora-r", metavar="R", type=positive_int,
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
    plan = estimate.add_argument_group(
        "model-states plan", "with any of these, the parameters, gradients, optimizer state and master weights "
        "each process holds")
    plan.add_argument("--world-size", type=positive_int, metavar="W", help="processes in the job (default 1)")
    plan.add_argument("--rank", type=non_negative_int, metavar="R",
                      help="the process the step plan is for, 0 to W - 1: under DeepSpeed ZeRO-1/2 each rank's "
                           "partition keeps other gradients (default: the fuller of ranks 0 and W - 1); DDP and ZeRO-3 "
                           "hold the same on every rank (default 0)")
    plan.add_argument("--nodes", type=positive_int, metavar="N",
                      help="machines; CPU figures are per node (default 1)")
    shard = plan.add_mutually_exclusive_group()
    shard.add_argument("--sharding", choices=SHARDINGS, help="how the states are split (default none)")
    shard.add_argument("--zero", type=int, choices=(1, 2, 3), metavar="{1,2,3}", help="DeepSpeed ZeRO stage: --sharding zeroN")
    plan.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer state and master weights on the CPU")
    plan.add_argument("--offload-params", action="store_true", help="ZeRO-3 / FSDP: parameters on the CPU too")
    plan.add_argument("--precision", choices=list(PRECISIONS), help="fp32 (default, or --dtype's), autocast-bf16/fp16 "
                      "(Trainer bf16=True/fp16=True), bf16/fp16 (model loaded in bf16/fp16), deepspeed-bf16/fp16 "
                      "(fp32 master weights)")
    plan.add_argument("--device-memory", metavar="SIZE", type=_checked(_memory),
                      help="accelerator memory per process, with a unit, e.g. 80GiB or 40GB, as "
                           "torch.cuda.mem_get_info reports it: says whether it fits (overrides --gpu's)")
    plan.add_argument("--gpu", metavar="NAME", action=_GpuAction,
                      help="the GPU: its memory, CUDA context and architecture, e.g. h100, a100-80gb, rtx-4090, t4 "
                           "(any case); '--gpu list' prints them")
    plan.add_argument("--alloc-conf", metavar="CONF", type=_checked(_alloc_conf),
                      help="PYTORCH_CUDA_ALLOC_CONF for the allocator replay, e.g. expandable_segments:True "
                           "(default: the environment's PYTORCH_CUDA_ALLOC_CONF, else torch's defaults)")
    plan.add_argument("--reserve", metavar="SIZE", type=_checked(_size),
                      help="your own margin beyond what the plan models (NCCL's buffers with several processes, "
                           "cuDNN attention's workspaces, another program on the GPU), taken from --device-memory "
                           "with the CUDA context before fits? is answered (default 0B: the allocator's cache, the "
                           "cuBLAS workspaces and the CUDA context are modelled)"),
    plan.add_argument("--reference-model", action="store_true",
                      help="DPO-style training (TRL's DPO, KTO, RLOO, GRPO with beta > 0): add a frozen copy of the "
                           "model's parameters, same dtype, no gradients or optimizer state; 0 with --lora-r, where "
                           "the reference is the base model with its adapters disabled")
    step = estimate.add_argument_group(
        "step plan", "with --batch-size, one training step is run under fake tensors (nothing allocated): the "
        "activations and the step's peak per process, and --device-memory answers from that peak")
    step.add_argument("--batch-size", type=positive_int, metavar="B", help="per-device micro-batch")
    step.add_argument("--seq-len", type=positive_int, metavar="S", help="sequence length (needed with --batch-size)")
    step.add_argument("--gradient-accumulation-steps", type=positive_int, metavar="N",
                      help="micro-batches per optimizer step (default: --training-args' or the DeepSpeed config's, else 1); "
                           "each after the first runs with the gradients alive")
    step.add_argument("--gradient-checkpointing", action="store_true",
                      help="the Trainer's gradient_checkpointing=True, with --training-args' "
                           "gradient_checkpointing_kwargs, else as the installed transformers checkpoints "
                           "(non-reentrant from 5 on, reentrant in 4.x)")
    step.add_argument("--attn-implementation", metavar="NAME",
                      help="the attention path to trace: eager, sdpa, ... (default: the config's)")
    step.add_argument("--device-type", choices=list(DEVICE_TYPES),
                      help="the device the run will use (default cuda); the trace itself runs on fake CPU tensors")
    step.add_argument("--max-batch-size", action="store_true",
                      help="the largest per-device batch whose step fits in --device-memory at --seq-len")
    # The batch of other task heads (trainer_memcb.plan.model.step_inputs): each refused, in one line, for
    # a model that has no use for it.
    step.add_argument("--target-len", type=positive_int, metavar="T",
                      help="a sequence-to-sequence model's labels length (default --seq-len; Whisper: needed)")
    step.add_argument("--image-size", type=positive_int, metavar="PIXELS",
                      help="an image model's height and width (default: the config's image_size)")
    step.add_argument("--padding", type=non_negative_int, metavar="P", default=0,
                      help="padded positions per row of the token batch (default 0: the attention mask all ones)")
    # QLoRA: the base model loaded by bitsandbytes (transformers' BitsAndBytesConfig).
    step.add_argument("--load-in-4bit", action="store_true",
                      help="the base model's linear layers loaded in 4-bit by bitsandbytes (QLoRA), in the step plan")
    step.add_argument("--load-in-8bit", action="store_true",
                      help="the base model's linear layers loaded in 8-bit by bitsandbytes (LLM.int8), in the step plan")
    step.add_argument("--llm-int8-threshold", type=float, metavar="T",
                      help="llm_int8_threshold of --load-in-8bit (default 6.0, as transformers')")
    step.add_argument("--bnb-4bit-quant-type", choices=list(QUANT_TYPES), default="nf4",
                      help="bnb_4bit_quant_type (default nf4)")
    step.add_argument("--bnb-4bit-use-double-quant", action="store_true", help="bnb_4bit_use_double_quant")
    step.add_argument("--bnb-4bit-compute-dtype", choices=list(DTYPES), default="float32",
                      help="bnb_4bit_compute_dtype (default float32, as transformers')")
    own = estimate.add_argument_group(
        "your own settings", "the Trainer's arguments and the engine's config as you train with them; the flags "
        "above, given explicitly, override them, and the step plan lists every setting and where it came from")
    own.add_argument("--training-args", metavar="FILE",
                     help="TrainingArguments as JSON (TrainingArguments.to_json_string(), a run's training_args.json "
                          "dump); never a pickle such as training_args.bin")
    own.add_argument("--deepspeed", metavar="FILE", help="the DeepSpeed config (ds_config.json), \"auto\" values filled as the "
                     "Trainer fills them; without --batch-size, the model-states plan's stage, precision and offload")
    own.add_argument("--fsdp-config", metavar="FILE", help="the Trainer's fsdp_config JSON (FSDP2: reshard_after_forward, "
                     "cpu_offload); without --batch-size, the model-states plan's sharding")
    own.add_argument("--bucket-cap-mb", type=float, metavar="MB", help="DDP's bucket_cap_mb (default 25)")
    own.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's gradient_as_bucket_view=True")
    own.add_argument("--replicate", type=positive_int, metavar="R",
                     help="FSDP2 HSDP: replicate R times over a mesh of R x (world size / R)")
    add_eval_arguments(estimate)
    add_fit_arguments(estimate)
    estimate.add_argument("--verbose", action="store_true",
                          help="let other libraries' messages through (import warnings of bitsandbytes, torchao, ...)")


# Any of these turns `estimate` into the model-states plan.
_PLAN_OPTIONS = ("world_size", "nodes", "sharding", "zero", "offload_optimizer", "offload_params", "precision",
                 "device_memory", "reference_model", "replicate", "gpu")
# So do the engines' config files, read for the plan's setup as the step plan reads them.
_ENGINE_FILES = ("deepspeed", "fsdp_config")


# Options of the step plan: without --batch-size or --max-batch-size they would change nothing.
_STEP_OPTIONS = (("seq_len", "--seq-len"), ("rank", "--rank"), ("gradient_checkpointing", "--gradient-checkpointing"),
                 ("gradient_accumulation_steps", "--gradient-accumulation-steps"),
                 ("attn_implementation", "--attn-implementation"), ("device_type", "--device-type"),
                 ("target_len", "--target-len"), ("image_size", "--image-size"), ("padding", "--padding"),
                 ("load_in_4bit", "--load-in-4bit"), ("load_in_8bit", "--load-in-8bit"),
                 ("bnb_4bit_use_double_quant", "--bnb-4bit-use-double-quant"),
                 ("llm_int8_threshold", "--llm-int8-threshold"), ("bucket_cap_mb", "--bucket-cap-mb"),
                 ("gradient_as_bucket_view", "--gradient-as-bucket-view"))
_EVAL_OPTIONS = ("seq_len", "attn_implementation", "device_type")
_EVAL_FLAGS = ("--seq-len", "--attn-implementation", "--device-type")


def check_options(args: argparse.Namespace) -> None:
    """Refuse options that would have no effect on what the command answers, and a step plan of
    a bare parameter count, which has no model to trace.

    Raises:
        ValueError: one line naming the option and what it needs.
    """
    if not step_asked(args):
        # --seq-len and --attn-implementation are the evaluation plan's too (its forward's batches).
        evaluation = getattr(args, "eval_samples", None) is not None
        given = [option for name, option in _STEP_OPTIONS
                 if getattr(args, name, None) not in (None, False) and not (evaluation and name in _EVAL_OPTIONS)]
        if given:
            needs = "--batch-size, --max-batch-size (the step plan) or --eval-samples" if given[0] in _EVAL_FLAGS \
                else "--batch-size or --max-batch-size (the step plan)"
            raise ValueError(f"{given[0]} has no effect without {needs}")
    if getattr(args, "reserve", None) is not None and args.device_memory is None:
        raise ValueError("--reserve has no effect without --device-memory (the reserve is taken from it)")
    usable_memory(args)  # a reserve as large as the memory, before anything is planned
    from trainer_memcb.cli.eval_estimate import check_eval_options

    check_eval_options(args)
    count = parameter_count(args.model)
    if step_asked(args):
        if count is not None:
            raise ValueError(f"a parameter count ({count:,}) cannot be traced: the step plan (--batch-size, "
                             "--max-batch-size) runs the model's forward and backward, so it needs a model config, "
                             "a folder holding config.json")
        _check_search_options(args)
        if args.seq_len is None and _a_text_model(args):
            raise ValueError(_NEEDS_SEQ_LEN)
    if count is not None:
        _check_count_options(args)
        if not (step_asked(args) or plan_asked(args) or getattr(args, "eval_samples", None) is not None):
            _refuse_what_if_of_a_count(count)
    _check_lora_options(args)
    _quantization_asked(args)
    _refuse_fp16_gradients(args)
    if step_asked(args) or (plan_asked(args) and getattr(args, "eval_samples", None) is None):
        usable_memory(args)  # a reserve as large as the memory, where the plan takes it from the memory
    if getattr(args, "eval_samples", None) is not None and args.seq_len is None:
        raise ValueError(EVAL_NEEDS_SEQ_LEN)
    _check_settings_files(args)


# The keys of a config.json that name an input other than token ids (an image's pixels, speech's
# features, a vision tower): the model's batch may then need no --seq-len (`head_kind`).
_NOT_TEXT_KEYS = ("image_size", "num_channels", "vision_config", "num_mel_bins", "audio_config")


def _a_text_model(args: argparse.Namespace) -> bool:
    """Whether MODEL is a folder whose config.json is surely a text model's (token ids in, so its
    step needs --seq-len), read before transformers is imported; False when in doubt (a hub name,
    a config with an image, speech or vision key, --architecture), and the built model decides."""
    from trainer_memcb.plan.settings import MAX_SETTINGS_FILE_BYTES
    from trainer_memcb.utils.safe_io import UnsafeFileError, read_json

    if args.architecture is not None or not os.path.isdir(args.model):
        return False
    try:
        config = read_json(os.path.join(args.model, "config.json"), MAX_SETTINGS_FILE_BYTES)
    except UnsafeFileError:  # answered once the model is built, as the folder's own problem
        return False
    return isinstance(config, dict) and "vocab_size" in config and not any(key in config for key in _NOT_TEXT_KEYS)


# The settings files the command reads, by option.
_SETTINGS_FILES = (("training_args", "--training-args"), ("deepspeed", "--deepspeed"), ("fsdp_config", "--fsdp-config"))


def _check_settings_files(args: argparse.Namespace) -> None:
    """Read each settings file named once, before torch is imported: a named pipe, a device or an
    oversized file, a pickle, or a file that is not a JSON object is refused at once."""
    from trainer_memcb.plan.settings import read_json_file

    for name, option in _SETTINGS_FILES:
        path = getattr(args, name, None)
        if path is not None:
            read_json_file(path, option)


# A model width for the DeepSpeed config's "auto" bucket sizes while the files are checked before the
# model is built (`check_settings_values`); the plan fills them from the model's own hidden_size.
_STAND_IN_HIDDEN_SIZE = 1024


def check_settings_values(args: argparse.Namespace) -> None:
    """The values of `--training-args`, `--deepspeed` and `--fsdp-config`, checked as the plan will
    resolve them but before the model is built or anything is traced (seconds for a large config).

    Raises:
        SettingsFileError: a value the Trainer or the engine would refuse or misread (exit 1).
        ValueError: a flag that contradicts a file (exit 2).
    """
    if not any(getattr(args, name, None) is not None for name, _ in _SETTINGS_FILES):
        return
    from types import SimpleNamespace

    step_settings(args, SimpleNamespace(config=SimpleNamespace(hidden_size=_STAND_IN_HIDDEN_SIZE)))
    if getattr(args, "eval_samples", None) is not None:
        from trainer_memcb.cli.eval_estimate import training_arguments_from_file

        training_arguments_from_file(getattr(args, "training_args", None))


def step_asked(args: argparse.Namespace) -> bool:
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


def _file_gives_train_batch(path: str) -> bool:
    """Whether a --training-args file names per_device_train_batch_size; a file that cannot be read
    as a JSON object answers yes, so that the step plan's reading of it says why."""
    from trainer_memcb.utils.safe_io import read_json
    from trainer_memcb.utils.units import MiB

    try:
        value = read_json(path, 16 * MiB)  # `MAX_SETTINGS_FILE_BYTES`, without importing the plan
    except Exception:  # any refusal is said by the step plan's own reading
        return True
    return not isinstance(value, dict) or value.get("per_device_train_batch_size") is not None


def step_settings(args: argparse.Namespace, model: Any) -> Any:
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
        flags["precision"] = _plan_precision(args)
    if args.gradient_checkpointing:
        flags["gradient_checkpointing"] = True
    if getattr(args, "gradient_as_bucket_view", False):
        flags["gradient_as_bucket_view"] = True
    if args.offload_params and (flags.get("sharding") or "").startswith("fsdp"):
        flags["fsdp_cpu_offload"] = True
    if list(args.optimizers) != list(DEFAULT_OPTIMIZERS) or not args.training_args:
        flags["optimizer"] = list(args.optimizers)[0]
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) if config is not None else None
    settings = resolve_settings(args.training_args, deepspeed=getattr(args, "deepspeed", None),
                                fsdp_config=getattr(args, "fsdp_config", None), hidden_size=hidden, **flags)
    if args.offload_optimizer and settings.zero_stage:
        zero = dict(settings.zero, offload_optimizer={"device": "cpu"})
        sources = dict(settings.sources, **{"zero.offload_optimizer": "flag"})
        import dataclasses

        settings = dataclasses.replace(settings, zero=zero, sources=sources)
    return settings


def estimate_step(args: argparse.Namespace) -> Dict[str, Any]:
    """The step plan (and the model-states plan) for the options: a dict of plans and the search.

    Raises:
        ValueError: --seq-len or --device-memory missing where needed, a bad setup.
        ModelConfigError: no model config, or no parameter left to train.
    """
    from trainer_memcb.plan.step.trace import counting_flops, sharing_traces

    # Each distinct step traced once: the search, the own step and --fit's, which reads the FLOPs.
    with sharing_traces(), counting_flops() if getattr(args, "fit", False) else contextlib.nullcontext():
        return _estimate_step(args)


def _estimate_step(args: argparse.Namespace) -> Dict[str, Any]:
    _check_search_options(args)
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.model.step_inputs import head_kind
    from trainer_memcb.plan.answers.max_batch import MAX_BATCH_SEARCH_LIMIT, max_batch_size
    from trainer_memcb.plan.answers.step_memory import plan_step_memory, states_during_step
    from trainer_memcb.plan.settings.setup import setup_of
    from trainer_memcb.plan.optimizers.whatif import resolve_dtype

    memory = usable_memory(args)
    device_type = args.device_type or DEFAULT_DEVICE_TYPE
    alloc_conf = alloc_conf_of(args) if device_type == "cuda" else None
    quantization = _quantization(args)
    model = estimate_model(args)  # checks the options once, and plans the model states
    if args.seq_len is None and head_kind(model) not in ("image", "speech_seq2seq"):
        raise ValueError(_NEEDS_SEQ_LEN)
    settings = step_settings(args, model)
    if settings.batch_size is None and not args.max_batch_size:
        raise ValueError("--batch-size is needed (or per_device_train_batch_size in --training-args)")
    setup = setup_of(settings)
    # Without --precision each parameter keeps the dtype the model was built in (PEFT's float32
    # adapters over a bfloat16 base), as `estimate_plan` and the what-if count them.
    explicit_dtype = args.precision or settings.sources.get("precision", "default") != "flag"
    keep_dtypes = not explicit_dtype or _autocast_keeps_dtype(args, settings.precision, settings.sharding)
    explicit_dtype = explicit_dtype and not keep_dtypes
    say_progress("planning the model states")
    states = plan_model_states(model, settings.optimizer, setup, device_memory=memory, model_name=args.model,
                               reference_model=args.reference_model, keep_dtypes=keep_dtypes)
    build_model = _first_then_new(model, lambda: estimate_model(args))
    del model

    def plan_at(batch: int) -> StepMemoryPlan:
        import dataclasses

        at = dataclasses.replace(settings, batch_size=batch, sources=dict(settings.sources, batch_size=settings.sources.get("batch_size", "flag")))
        return plan_ranks(at)

    def plan_ranks(at: Any, **more: Any) -> StepMemoryPlan:
        import dataclasses

        ranks = ranks_to_plan(at)
        if len(ranks) == 1:
            return plan_for(at, **more)
        source = f"default: the fuller of ranks {ranks[0]} and {ranks[-1]}"
        return fullest_process([plan_for(dataclasses.replace(at, rank=rank, sources=dict(at.sources, rank=source)), **more)
                                for rank in ranks], ranks)

    def plan_for(at: Any, build: Any = None, states_plan: Any = None, **more: Any) -> StepMemoryPlan:
        several = ranks_to_plan(at) != [at.rank] or at.sources.get("rank") == "flag"
        say_progress(f"tracing the step at batch {at.batch_size}" + (f", rank {at.rank}" if several else "")
                     + (" (searching the largest batch)" if args.max_batch_size else ""))
        options = dict(seq_len=args.seq_len, quantization=quantization, alloc_conf=alloc_conf,
                       gpu=getattr(args, "gpu", None))
        options.update(more)  # --fit's proposals: expandable segments among them
        return plan_step_memory(build or build_model, settings=at, **options,
                                attn_implementation=args.attn_implementation, device_type=device_type,
                                device_memory=args.device_memory, reserve_bytes=reserve_bytes(args) or 0, model_name=args.model,
                                states_plan=states_plan or states,
                                dtype=None if explicit_dtype else resolve_dtype(args.dtype or "float32"),
                                target_len=getattr(args, "target_len", None), image_size=getattr(args, "image_size", None),
                                padding=getattr(args, "padding", 0) or 0, keep_dtypes=keep_dtypes)[0]

    freeze_what_was_imported()  # the modules the step needs are in: no full collection walks them again
    found: Optional[int] = None
    searched: List[StepMemoryPlan] = []
    problem: Optional[str] = None
    if args.max_batch_size:
        found, searched = max_batch_size(plan_at, memory)
        problem = next((f"at batch {plan.batch_size} {plan.problem}" for plan in searched if plan.problem is not None),
                       None)
    step = plan_at(settings.batch_size) if settings.batch_size is not None else None
    # The model-states table from the same trace: each state's most during the engine's step (the
    # states do not depend on the batch, so the search's plan at the answer serves without one).
    traced = step if step is not None else next((plan for plan in searched if plan.batch_size == found), None)
    if traced is not None:
        states = states_during_step(states, traced)
    fit = None
    if getattr(args, "fit", False) and step is not None:
        from trainer_memcb.cli.fit_table import estimate_fit

        fit = estimate_fit(args, settings, memory, plan_ranks, plan_for_states=lambda at: plan_model_states(
            estimate_model(args), at.optimizer, setup_of(at), model_name=args.model,
            reference_model=args.reference_model, keep_dtypes=keep_dtypes), estimate_model=estimate_model,
            step_settings=step_settings)
    return {"step": step, "model_states": states, "max_batch_size": found, "searched": searched,
            "search": args.max_batch_size, "max_batch_size_problem": problem,
            "max_batch_size_is_search_limit": found == MAX_BATCH_SEARCH_LIMIT, "fit": fit}


def _check_search_options(args: argparse.Namespace) -> None:
    if args.max_batch_size and args.device_memory is None:
        raise ValueError("--max-batch-size needs --device-memory (the accelerator's memory per process, e.g. 80GiB)")


_NEEDS_SEQ_LEN = "--batch-size and --max-batch-size need --seq-len (the sequence length)"


def ranks_to_plan(settings: Any) -> List[int]:
    """The processes the command plans: the one `--rank` names, else, where processes differ
    (DeepSpeed ZeRO-1/2 on several: each rank's partition keeps other gradients), the first and the
    last, whose partitions hold the embedding and the head; one process otherwise."""
    if settings.sources.get("rank") == "flag" or settings.zero_stage not in (1, 2) or settings.world_size == 1:
        return [settings.rank]
    return [0, settings.world_size - 1]


def fullest_process(plans: List[StepMemoryPlan], ranks: List[int]) -> StepMemoryPlan:
    """The plan of the process that holds the most on the device at its peak (the first if equal),
    with a note of the other's peak."""
    import dataclasses

    index = max(range(len(plans)), key=lambda i: (plans[i].peak_bytes or 0, -i))
    others = ", ".join(f"rank {rank} {format_bytes(plan.peak_bytes or 0)} ({plan.peak_bytes or 0:,})"
                       for rank, plan in zip(ranks, plans) if rank != ranks[index])
    note = f"rank {ranks[index]} holds the most of ranks {' and '.join(map(str, ranks))} at its peak ({others})"
    return dataclasses.replace(plans[index], notes=list(plans[index].notes) + [note])


def _first_then_new(model: Any, build: Any) -> Any:
    """A model builder for the traces: `model` the first time, `build()` each time after.

    A trace makes the model it is given fake in place, so no two traces may share one; the model
    the options were checked and the model states planned on is still untouched then (the
    states plan works on a stand-in), and building it again costs 0.1-0.25 s for a 70B config."""
    unused = [model]

    def first_then_new() -> Any:
        return unused.pop() if unused else build()

    return first_then_new


def _quantization(args: argparse.Namespace) -> Optional[Quantization]:
    """The base model's loading (QLoRA), or None.

    Raises:
        ValueError: both --load-in-4bit and --load-in-8bit, or an option of the other one, or
            either without --lora-r.
    """
    if not _quantization_asked(args):
        return None
    from trainer_memcb.plan.model.quantized import Quantization
    from trainer_memcb.plan.optimizers.whatif import resolve_dtype

    if getattr(args, "load_in_8bit", False):
        threshold = getattr(args, "llm_int8_threshold", None)
        return Quantization(bits=8, threshold=6.0 if threshold is None else threshold)
    return Quantization(quant_type=args.bnb_4bit_quant_type, double_quant=args.bnb_4bit_use_double_quant,
                        compute_dtype=resolve_dtype(args.bnb_4bit_compute_dtype))


def _quantization_asked(args: argparse.Namespace) -> bool:
    """Whether the options load the base model quantized, once its options are checked (from the
    command line alone, before torch is imported).

    Raises:
        ValueError: both --load-in-4bit and --load-in-8bit, or an option of the other one, or
            either without --lora-r.
    """
    threshold = getattr(args, "llm_int8_threshold", None)
    if getattr(args, "load_in_8bit", False):
        if getattr(args, "load_in_4bit", False):
            raise ValueError("--load-in-8bit and --load-in-4bit: give one (BitsAndBytesConfig loads in one of them)")
        four_bit = [flag for flag, given in (("--bnb-4bit-use-double-quant", args.bnb_4bit_use_double_quant),
                                             ("--bnb-4bit-quant-type", args.bnb_4bit_quant_type != "nf4"),
                                             ("--bnb-4bit-compute-dtype", args.bnb_4bit_compute_dtype != "float32"))
                    if given]
        if four_bit:
            raise ValueError(f"{four_bit[0]} is an option of --load-in-4bit, not of --load-in-8bit")
        if threshold is not None and not threshold >= 0:  # NaN too: no outlier column would ever be found
            raise ValueError(f"--llm-int8-threshold {threshold!r}: expected a number of at least 0 (default 6.0)")
        _needs_adapters(args, "--load-in-8bit")
        return True
    if threshold is not None:
        raise ValueError("--llm-int8-threshold is an option of --load-in-8bit")
    if not getattr(args, "load_in_4bit", False):
        return False
    _needs_adapters(args, "--load-in-4bit")
    return True


def _needs_adapters(args: argparse.Namespace, flag: str) -> None:
    """transformers' trainer_utils.validate_quantization_for_training, called by Trainer.__init__:
    a quantized base model trains only with adapters."""
    if getattr(args, "lora_r", None) is None:
        raise ValueError(f"{flag} needs --lora-r: the Trainer refuses to train a purely quantized model "
                         "(\"You cannot perform fine-tuning on purely quantized models\"); QLoRA trains adapters on it")


def plan_asked(args: argparse.Namespace) -> bool:
    """Whether the options ask for the model-states plan rather than the optimizer what-if (an
    engine's config does: its stage, precision and offload are the plan's)."""
    return any(getattr(args, name, None) not in (None, False) for name in _PLAN_OPTIONS + _ENGINE_FILES)


# A parameter count given as MODEL: digits (`7500000000`, `7_500_000_000`, `7,500,000,000`) or a
# number in e-notation (`7.5e9`) that is whole.
_COUNT = re.compile(r"\d[\d_,]*|\d+\.\d+|\d+(\.\d+)?[eE]\+?\d+")
# Options that need a model's modules and names, which a bare count has not.
_NEEDS_A_MODEL = (("lora_r", "--lora-r"), ("lora_target_modules", "--lora-target-modules"),
                  ("lora_modules_to_save", "--lora-modules-to-save"), ("trainable", "--trainable"),
                  ("architecture", "--architecture"), ("optim_target_modules", "--optim-target-modules"))
# --dtype's precision for the plan, when --precision is not given.
_DTYPE_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


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


def _check_count_options(args: argparse.Namespace) -> None:
    """Refuse, for a parameter count, the options that need a model's modules and names."""
    given = [option for name, option in _NEEDS_A_MODEL if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"{given[0]} needs a model's modules and names: give a folder holding config.json, "
                         f"not a parameter count")


def _refuse_what_if_of_a_count(count: int) -> None:
    raise ValueError(f"a parameter count ({count:,}) answers the model-states plan only: add --world-size, "
                     "--zero, --sharding or --precision (e.g. --zero 1 --world-size 64); the optimizer what-if "
                     "needs a model config, a folder holding config.json")


def _autocast_keeps_dtype(args: argparse.Namespace, precision: str, sharding: str) -> bool:
    """Whether the parameters keep --dtype under the Trainer's autocast (bf16=True / fp16=True).

    accelerate's `prepare_model` wraps the forward in autocast and casts no parameter, so a model
    loaded in 16 bits (`--dtype float16 --precision autocast-bf16`) trains its 16-bit parameters;
    only FSDP upcasts them to float32 (`fsdp2_prepare_model`: "FSDP upcast of low precision
    parameters"), and a quantized base is laid out by its own rules."""
    return (args.dtype in ("bfloat16", "float16") and precision in ("autocast-bf16", "autocast-fp16")
            and not str(sharding).startswith("fsdp") and not _quantization_asked(args))


def _refuse_fp16_gradients(args: argparse.Namespace) -> None:
    """fp16 autocast over a float16 model: the Trainer's GradScaler refuses the float16 gradients
    at the first step (torch/amp/grad_scaler.py `_unscale_grads_`), unless only float32 adapters
    train (`--lora-r`: PEFT keeps them float32)."""
    if (args.dtype == "float16" and args.precision == "autocast-fp16" and getattr(args, "lora_r", None) is None
            and not str(args.sharding or "").startswith("fsdp")):
        raise ValueError("--dtype float16 with --precision autocast-fp16: the Trainer's GradScaler refuses float16 "
                         "gradients (\"Attempting to unscale FP16 gradients.\"); give --dtype float32 or bfloat16, "
                         "--precision autocast-bf16, or --precision fp16 (trained in float16 without autocast)")


def _plan_precision(args: argparse.Namespace) -> str:
    return args.precision or _DTYPE_PRECISION[args.dtype or "float32"]


def estimate_plan(args: argparse.Namespace) -> ModelStatesPlan:
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
        _check_count_options(args)
    model = count if count is not None else estimate_model(args)
    if any(getattr(args, name, None) is not None for name in _ENGINE_FILES) or (getattr(args, "replicate", None) or 1) > 1:
        # The engine's config, then the flags given, as the step plan resolves them (`step_settings`).
        from trainer_memcb.plan.settings.setup import setup_of

        settings = step_settings(args, model if count is None else None)
        setup = setup_of(settings)
        keep_dtypes = (settings.sources.get("precision") == "flag" and args.precision is None) or \
            _autocast_keeps_dtype(args, settings.precision, settings.sharding)
    else:
        setup = Setup(world_size=args.world_size or 1, nodes=args.nodes or 1,
                      sharding=f"zero{args.zero}" if args.zero else (args.sharding or "none"),
                      precision=_plan_precision(args), offload_optimizer=args.offload_optimizer,
                      offload_params=args.offload_params)
        keep_dtypes = args.precision is None or _autocast_keeps_dtype(args, setup.precision, setup.sharding)
    say_progress("planning the model states")
    return plan_model_states(model, args.optimizers, setup, device_memory=memory,
                             model_name=args.model if count is None else None,
                             optim_args=args.optim_args, optim_target_modules=args.optim_target_modules,
                             keep_dtypes=keep_dtypes, reference_model=args.reference_model)


def estimate_what_if(args: argparse.Namespace) -> WhatIf:
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
        _refuse_what_if_of_a_count(count)
    model = estimate_model(args)
    say_progress("estimating each optimizer's state")
    return what_if(model, args.optimizers, model_name=args.model,
                   optim_args=args.optim_args, optim_target_modules=args.optim_target_modules)


def estimate_model(args: argparse.Namespace) -> Any:
    """The model the options describe, on the meta device: LoRA adapters and trainable names applied.

    Raises:
        ValueError: an unknown architecture, a bad regular expression, LoRA options without
            --lora-r, LoRA modules PEFT cannot find.
        ModelConfigError: no model config, or no parameter left to train.
    """
    from trainer_memcb.plan.model.lora import add_lora_adapters
    from trainer_memcb.plan.optimizers.whatif import ModelConfigError, build_meta_model, resolve_dtype, select_trainable

    _check_lora_options(args)
    say_progress(f"building {args.model} on the meta device")
    model = build_meta_model(args.model, resolve_dtype(args.dtype or "float32"), args.architecture)
    if args.lora_r is not None:
        model = add_lora_adapters(model, args.lora_r, args.lora_target_modules, args.lora_modules_to_save)
    if args.trainable is not None:
        if select_trainable(model, args.trainable, narrow=args.lora_r is not None) == 0:
            names = [name for name, _ in model.named_parameters()][:3]
            raise ModelConfigError(f"no parameter name of {args.model} matches --trainable {args.trainable!r}; "
                                   f"names look like: {', '.join(names)}")
    return model


def _check_lora_options(args: argparse.Namespace) -> None:
    if args.lora_r is None and (args.lora_target_modules is not None or args.lora_modules_to_save is not None):
        raise ValueError("--lora-target-modules and --lora-modules-to-save need --lora-r (the adapters' rank)")


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
