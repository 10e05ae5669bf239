"""The checks of `trainer-memcb estimate`'s options: those that would have no effect, that do not
fit together or the model, refused in one line before torch is imported (`check_options`); the
settings files' values before the model is built (`check_settings_values`); `--optimizers`
against the Trainer's names."""

from __future__ import annotations

import dataclasses
import os

from trainer_memcb.cli.choices import TRL_TRAINERS
from trainer_memcb.cli.device_options import DEFAULT_DEVICE_TYPE, alloc_conf_of, usable_memory
from trainer_memcb.cli.estimate_asked import parameter_count
from trainer_memcb.cli.estimate_model import check_lora_options, quantization_asked
from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.cli.estimate_settings import step_settings
from trainer_memcb.cli.fit_options import check_fit_options
from trainer_memcb.cli.plan_files import check_plan_files
from trainer_memcb.cli.eval_estimate import EVAL_NEEDS_SEQ_LEN

__all__ = ["check_options", "check_settings_values", "resolve_optimizers", "check_search_options", "check_count_options",
           "refuse_what_if_of_a_count", "NEEDS_SEQ_LEN"]


# Options of the step plan: without --batch-size or --max-batch-size they would change nothing.
_STEP_OPTIONS = (("seq_len", "--seq-len"), ("rank", "--rank"), ("gradient_checkpointing", "--gradient-checkpointing"),
                 ("gradient_accumulation_steps", "--gradient-accumulation-steps"),
                 ("attn_implementation", "--attn-implementation"), ("device_type", "--device-type"),
                 ("target_len", "--target-len"), ("image_size", "--image-size"), ("padding", "--padding"),
                 ("packing", "--packing"), ("torch_compile", "--torch-compile"),
                 ("use_liger_kernel", "--liger-kernel"), ("liger_kernel_config", "--liger-kernel-config"),
                 ("load_in_4bit", "--load-in-4bit"), ("load_in_8bit", "--load-in-8bit"),
                 ("bnb_4bit_use_double_quant", "--bnb-4bit-use-double-quant"),
                 ("llm_int8_threshold", "--llm-int8-threshold"), ("bucket_cap_mb", "--bucket-cap-mb"),
                 ("gradient_as_bucket_view", "--gradient-as-bucket-view"), ("parallelism", "--parallelism"),
                 ("tp_plan", "--tp-plan"))
_EVAL_OPTIONS = ("seq_len", "attn_implementation", "device_type")
_EVAL_FLAGS = ("--seq-len", "--attn-implementation", "--device-type")


def check_options(args: EstimateRequest) -> None:
    """Every check of the command line, in one place: options that would have no effect on what
    the command answers (the plans asked, `EstimateRequest.questions`), a step plan of a bare
    parameter count, which has no model to trace, --fit's and the plan files' options and
    destinations (`check_fit_options`, `check_plan_files`), and the environment's allocator
    settings where the step is replayed on CUDA.

    Raises:
        ValueError: one line naming the option and what it needs.
    """
    asked = args.questions
    if not asked.step:
        # --seq-len and --attn-implementation are the evaluation plan's too (its forward's batches).
        given = [option for name, option in _STEP_OPTIONS
                 if getattr(args, name, None) not in (None, False) and not (asked.evaluation and name in _EVAL_OPTIONS)]
        if given:
            needs = "--batch-size, --max-batch-size (the step plan) or --eval-samples" if given[0] in _EVAL_FLAGS \
                else "--batch-size or --max-batch-size (the step plan)"
            raise ValueError(f"{given[0]} has no effect without {needs}")
    if getattr(args, "reserve", None) is not None and args.device_memory is None:
        raise ValueError("--reserve has no effect without --device-memory (the reserve is taken from it)")
    usable_memory(args)  # a reserve as large as the memory, before anything is planned
    from trainer_memcb.cli.eval_estimate import check_eval_options

    check_eval_options(args, asked.evaluation)
    count = parameter_count(args.model)
    if asked.step:
        if count is not None:
            raise ValueError(f"a parameter count ({count:,}) cannot be traced: the step plan (--batch-size, "
                             "--max-batch-size) runs the model's forward and backward, so it needs a model config, "
                             "a folder holding config.json")
        check_search_options(args)
        if args.seq_len is None and _a_text_model(args):
            raise ValueError(NEEDS_SEQ_LEN)
    if count is not None:
        check_count_options(args)
        if not (asked.step or asked.plan or asked.evaluation):
            refuse_what_if_of_a_count(count)
    check_lora_options(args)
    quantization_asked(args)
    _refuse_fp16_gradients(args)
    if asked.step or (asked.plan and not asked.evaluation):
        usable_memory(args)  # a reserve as large as the memory, where the plan takes it from the memory
    if asked.evaluation and args.seq_len is None:
        raise ValueError(EVAL_NEEDS_SEQ_LEN)
    _check_trainer(args, asked.step)
    _check_layout_flags(args)
    _check_settings_files(args)
    check_fit_options(args)
    check_plan_files(args)
    if (args.device_type or DEFAULT_DEVICE_TYPE) == "cuda" and (asked.step or asked.evaluation):
        alloc_conf_of(args)  # the environment's allocator settings, which the replay reads


def _check_layout_flags(args: EstimateRequest) -> None:
    """The layout's rules where the flags alone give both values (flags win over every settings
    file), as `Setup` checks them later: at once rather than after torch and the model.

    Raises:
        ValueError: `world_size=3 is not a multiple of nodes=2`, or DeepSpeed's precision under FSDP.
    """
    from trainer_memcb.plan.settings.layout_rules import nodes_problem, precision_sharding_problem

    world_size, nodes = getattr(args, "world_size", None), getattr(args, "nodes", None)
    precision, sharding = getattr(args, "precision", None), getattr(args, "sharding", None)
    problem = ((nodes_problem(world_size, nodes) if world_size is not None and nodes is not None else None)
               or (precision_sharding_problem(precision, sharding) if precision and sharding else None))
    if problem is not None:
        raise ValueError(problem)


def _check_trainer(args: EstimateRequest, step_asked: bool) -> None:
    """`--trainer sft|dpo|kto|grpo|rloo`: TRL's step, planned from its config file on one process."""
    trainer = getattr(args, "trainer", "trainer")
    if trainer not in TRL_TRAINERS:
        return
    config = f"{trainer.upper()}Config"
    if not step_asked:
        raise ValueError(f"--trainer {trainer} has no effect without --batch-size or --max-batch-size (the step plan: "
                         f"only the {trainer.upper()} step is planned, not its model states alone)")
    if args.training_args is None:
        decides = {"grpo": "its num_generations, max_completion_length, beta and loss_type decide the step",
                   "sft": "its max_length, packing, padding_free and loss_type decide the step"}.get(
            "grpo" if trainer == "rloo" else trainer, "its beta, loss_type and precompute_ref_log_probs decide the step")
        raise ValueError(f"--trainer {trainer} needs --training-args {config.upper()}.json "
                         f"({config}(...).to_json_string()): {decides}")
    if args.zero or args.sharding not in (None, "none") or (args.world_size or 1) > 1:
        raise ValueError(f"--trainer {trainer} is planned on one process without sharding so far: leave out --zero, "
                         "--sharding and --world-size")
    if args.deepspeed is not None or getattr(args, "fsdp_config", None) is not None:
        raise ValueError(f"--trainer {trainer} is planned on one process without sharding so far: leave out "
                         "--deepspeed and --fsdp-config")
    if getattr(args, "write_deepspeed", None):
        raise ValueError(f"--write-deepspeed with --trainer {trainer}: the {trainer.upper()} step is planned on one "
                         f"process without DeepSpeed, so --fit proposes none; write the {config} with "
                         "--write-training-args")
    if args.reference_model and trainer == "sft":
        raise ValueError("--reference-model with --trainer sft: SFTTrainer makes no reference model; leave it out")
    if args.reference_model:
        raise ValueError(f"--reference-model with --trainer {trainer}: the {trainer.upper()} step plans its own "
                         "reference (a frozen copy, the adapters disabled with --lora-r, or none); leave it out")


# The keys of a config.json that name an input other than token ids (an image's pixels, speech's
# features, a vision tower): the model's batch may then need no --seq-len (`head_kind`).
_NOT_TEXT_KEYS = ("image_size", "num_channels", "vision_config", "num_mel_bins", "audio_config")


def _a_text_model(args: EstimateRequest) -> bool:
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


def _check_settings_files(args: EstimateRequest) -> None:
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


def check_settings_values(args: EstimateRequest) -> None:
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
    if args.questions.evaluation:  # the evaluation plan's TrainingArguments too
        from trainer_memcb.cli.eval_estimate import training_arguments_from_file

        training_arguments_from_file(getattr(args, "training_args", None))


def check_search_options(args: EstimateRequest) -> None:
    if args.max_batch_size and getattr(args, "packing", None) is not None:
        raise ValueError("--max-batch-size searches the rows of a batch; --packing makes one row of TOKENS tokens: "
                         "plan each TOKENS with --batch-size 1")
    if args.max_batch_size and args.device_memory is None:
        raise ValueError("--max-batch-size needs --device-memory (the accelerator's memory per process, e.g. 80GiB)")


NEEDS_SEQ_LEN = "--batch-size and --max-batch-size need --seq-len (the sequence length)"


# Options that need a model's modules and names, which a bare count has not.
_NEEDS_A_MODEL = (("lora_r", "--lora-r"), ("lora_target_modules", "--lora-target-modules"),
                  ("lora_modules_to_save", "--lora-modules-to-save"), ("trainable", "--trainable"),
                  ("architecture", "--architecture"), ("optim_target_modules", "--optim-target-modules"))


def check_count_options(args: EstimateRequest) -> None:
    """Refuse, for a parameter count, the options that need a model's modules and names."""
    given = [option for name, option in _NEEDS_A_MODEL if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"{given[0]} needs a model's modules and names: give a folder holding config.json, "
                         f"not a parameter count")


def refuse_what_if_of_a_count(count: int) -> None:
    raise ValueError(f"a parameter count ({count:,}) answers the model-states plan only: add --world-size, "
                     "--zero, --sharding or --precision (e.g. --zero 1 --world-size 64); the optimizer what-if "
                     "needs a model config, a folder holding config.json")


def _refuse_fp16_gradients(args: EstimateRequest) -> None:
    """fp16 autocast over a float16 model: the Trainer's GradScaler refuses the float16 gradients
    at the first step (torch/amp/grad_scaler.py `_unscale_grads_`), unless only float32 adapters
    train (`--lora-r`: PEFT keeps them float32)."""
    if (args.dtype == "float16" and args.precision == "autocast-fp16" and getattr(args, "lora_r", None) is None
            and not str(args.sharding or "").startswith("fsdp")):
        raise ValueError("--dtype float16 with --precision autocast-fp16: the Trainer's GradScaler refuses float16 "
                         "gradients (\"Attempting to unscale FP16 gradients.\"); give --dtype float32 or bfloat16, "
                         "--precision autocast-bf16, or --precision fp16 (trained in float16 without autocast)")


def resolve_optimizers(args: EstimateRequest) -> EstimateRequest:
    """The request with `--optimizers` checked against the Trainer's names, aliases resolved.

    Raises:
        ValueError: `argument --optimizers: optimizer 'x' is not one of: ...`.
    """
    from trainer_memcb.plan.optimizers.whatif import resolve_optimizer_names

    try:
        return dataclasses.replace(args, optimizers=resolve_optimizer_names(args.optimizers))
    except ValueError as error:
        raise ValueError(f"argument --optimizers: {error}") from None
