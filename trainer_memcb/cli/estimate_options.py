"""The options of `trainer-memcb estimate MODEL`: the argparse arguments and the types that parse
their values, importable without torch (the values are checked in `estimate_checks`)."""

from __future__ import annotations

import argparse
from typing import Any, List, Optional

from trainer_memcb.cli.choices import (DEFAULT_OPTIMIZERS, DEVICE_TYPES, DTYPES, PRECISIONS, QUANT_TYPES, SHARDINGS,
                                      TRL_TRAINERS, liger_kernel_config, non_negative_int, positive_int, tp_plan)
from trainer_memcb.cli.eval_estimate import add_eval_arguments
from trainer_memcb.cli.fit_options import add_fit_arguments
from trainer_memcb.cli.output import TextTable, bytes_cell
from trainer_memcb.plan.settings.optim_options import parse_optim_args, parse_optim_target_modules
from trainer_memcb.utils.units import parse_size

__all__ = ["add_estimate_arguments"]


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


def _alloc_conf(text: str) -> Any:
    from trainer_memcb.plan.device.alloc_conf import parse_alloc_conf

    return parse_alloc_conf(text)


def _parallelism(text: str) -> Any:
    from trainer_memcb.plan.settings.parallelism import parse_parallelism

    return parse_parallelism(text)


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


def add_estimate_arguments(estimate: argparse.ArgumentParser) -> None:
    """The options of `trainer-memcb estimate`, in the order `--help` lists them."""
    _add_model_arguments(estimate)
    _add_plan_arguments(estimate)
    _add_quantization_arguments(_add_step_arguments(estimate))
    _add_settings_file_arguments(estimate)
    add_eval_arguments(estimate)
    add_fit_arguments(estimate)
    estimate.add_argument("--verbose", action="store_true",
                          help="let other libraries' messages through (import warnings of bitsandbytes, torchao, ...)")


def _add_model_arguments(estimate: argparse.ArgumentParser) -> None:
    """MODEL, the optimizers and their options, how the model is built (its class, dtype, LoRA
    adapters and trainable names), and --json."""
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


def _add_plan_arguments(estimate: argparse.ArgumentParser) -> None:
    """The model-states plan's group: the processes and how the states are split, the precision,
    the device's memory and what is taken from it, the reference model."""
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
    plan.add_argument("--parallelism", metavar="SIZES", type=_checked(_parallelism),
                      help="accelerate's ParallelismConfig as tp=2[,dp_shard=N,dp_replicate=N,cp=N]: the sizes "
                           "multiply to the world size; planned so far: tp=N alone or with dp_shard=M (FSDP2), "
                           "from the model's tp_plan, and cp=N (context parallel, torch's ring attention) with "
                           "FSDP2 over dp_shard x cp (with --batch-size)")
    plan.add_argument("--tp-plan", type=tp_plan, metavar="JSON",
                      help="your tensor-parallel rules over the model's tp_plan, a JSON object (inline or a file) of "
                           "module names to transformers' styles, as DistributedConfig(tp_plan=...) takes them: e.g. "
                           "'{\"model.layers.*.self_attn.o_proj\": \"replicate\"}' (with --parallelism tp=N)")
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
                           "the workspace of cuDNN's attention engine, another program on the GPU), taken from --device-memory "
                           "with the CUDA context before fits? is answered (default 0B: the allocator's cache, the "
                           "cuBLAS workspaces and the CUDA context are modelled)")
    plan.add_argument("--reference-model", action="store_true",
                      help="DPO-style training (TRL's DPO, KTO, RLOO, GRPO with beta > 0): add a frozen copy of the "
                           "model's parameters, same dtype, no gradients or optimizer state; 0 with --lora-r, where "
                           "the reference is the base model with its adapters disabled")


def _add_step_arguments(estimate: argparse.ArgumentParser) -> Any:
    """The step plan's group (returned): the batch, the step's own settings, other heads' inputs."""
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
                      help="the attention path to trace: eager, sdpa, flash_attention_2, flash_attention_3 "
                           "(Ampere, Ada, Hopper), kernels-community/flash-attn2, ... (default: the config's)")
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
    step.add_argument("--torch-compile", action="store_true", default=None,
                      help="the Trainer's torch_compile=True (as --training-args may give it): traced compiled, what its forward "
                           "saves for backward chosen by AOTAutograd's min-cut partitioner (Inductor's fusion not "
                           "counted); the eager step, said so, where that cannot be traced")
    step.add_argument("--liger-kernel", action="store_true", default=None, dest="use_liger_kernel",
                      help="the Trainer's use_liger_kernel=True (as --training-args may give it): the model patched "
                           "as liger-kernel patches it, its Triton kernels planned (CUDA; Llama, Mistral, Qwen2, "
                           "Qwen3); no liger-kernel package needed")
    step.add_argument("--liger-kernel-config", type=liger_kernel_config, metavar="JSON",
                      help="the Trainer's liger_kernel_config, e.g. '{\"rope\": false}' (default: liger-kernel's: "
                           "rope, rms_norm, swiglu, fused_linear_cross_entropy on)")
    step.add_argument("--packing", type=positive_int, metavar="TOKENS",
                      help="a padding-free batch, as DataCollatorWithFlattening makes it: one row of TOKENS tokens, "
                           "sequences of --seq-len each (the rest one shorter), positions restarting at each; with "
                           "--batch-size 1 and sdpa, eager or flash_attention_2 (CUDA)")
    step.add_argument("--write-snapshot", metavar="FILE",
                      help="write the planned step (CUDA: the caching allocator's replay of two steps) as a "
                           "torch.cuda.memory._dump_snapshot pickle, for trainer-memcb snapshot, "
                           "python -m torch.cuda._memory_viz and pytorch.org/memory_viz")
    step.add_argument("--write-html", metavar="FILE",
                      help="write a self-contained page of the planned step: the bytes by part over two steps, the "
                           "reserved bytes, the peak, the phases (opens offline)")
    return step


def _add_quantization_arguments(step: Any) -> None:
    """QLoRA, in the step plan's group: the base model loaded by bitsandbytes (transformers'
    BitsAndBytesConfig)."""
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


def _add_settings_file_arguments(estimate: argparse.ArgumentParser) -> None:
    """Your own settings: the Trainer's arguments and the engine's config as files, and DDP's and
    HSDP's own options."""
    own = estimate.add_argument_group(
        "your own settings", "the Trainer's arguments and the engine's config as you train with them; the flags "
        "above, given explicitly, override them, and the step plan lists every setting and where it came from")
    own.add_argument("--training-args", metavar="FILE",
                     help="TrainingArguments as JSON (TrainingArguments.to_json_string(), a run's training_args.json "
                          "dump); never a pickle such as training_args.bin; with --trainer sft, dpo, kto, grpo or rloo, "
                          "an SFTConfig's, DPOConfig's, KTOConfig's, GRPOConfig's or RLOOConfig's JSON "
                          "(DPOConfig(...).to_json_string())")
    own.add_argument("--trainer", choices=("trainer",) + TRL_TRAINERS, default="trainer",
                     help="the trainer whose step is planned: transformers' Trainer (default), TRL's SFTTrainer "
                          "(its fused LM head, the rows cut to max_length, or padding-free one row of the micro-batch "
                          "with packing), DPOTrainer "
                          "(chosen and rejected rows, the reference model's forward: a frozen copy, the adapters "
                          "disabled with --lora-r, or none with precompute_ref_log_probs), KTOTrainer (the "
                          "completion rows and the mismatched KL rows, the reference as DPO's), GRPOTrainer or "
                          "RLOOTrainer (the generation phase: --seq-len prompt tokens completed to max_completion_length by "
                          "transformers' generate, and the training phase); needs the step plan and "
                          "--training-args CONFIG.json, on one process without sharding")
    own.add_argument("--deepspeed", metavar="FILE", help="the DeepSpeed config (ds_config.json), \"auto\" values filled as the "
                     "Trainer fills them; without --batch-size, the model-states plan's stage, precision and offload")
    own.add_argument("--fsdp-config", metavar="FILE", help="the Trainer's fsdp_config JSON (FSDP2: reshard_after_forward, "
                     "cpu_offload); without --batch-size, the model-states plan's sharding")
    own.add_argument("--bucket-cap-mb", type=float, metavar="MB", help="DDP's bucket_cap_mb (default 25)")
    own.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's gradient_as_bucket_view=True")
    own.add_argument("--replicate", type=positive_int, metavar="R",
                     help="FSDP2 HSDP: replicate R times over a mesh of R x (world size / R)")
