"""The step plan's settings, resolved once: from the Trainer's arguments, the engine's config and
the flags, each value with where it came from.

A user already has `TrainingArguments` (or the JSON `TrainingArguments.to_json_string()` writes, as
a run's `training_args.json`-style dump), and a DeepSpeed config or an FSDP config. `resolve_settings`
reads them in this order, a later source winning: the library's defaults, the `TrainingArguments`,
the engine's config file, then the flags given explicitly. The DeepSpeed config's `"auto"` values
are filled as the Trainer fills them (transformers `integrations/deepspeed.py`,
`HfTrainerDeepSpeedConfig.trainer_config_process` and `trainer_config_finalize`): the micro-batch,
gradient accumulation and clipping from the arguments, `reduce_bucket_size` = hidden_size²,
`stage3_prefetch_bucket_size` = int(0.9 · hidden_size²), `stage3_param_persistence_threshold` =
10 · hidden_size. The defaults of DeepSpeed's own keys are those of its `DeepSpeedZeroConfig`
(deepspeed 0.19.8 `runtime/zero/config.py`).

A pickled `training_args.bin` is never read: only JSON.

Values are read with the rules of the code that reads them in a run, and a value that code would
refuse (or read otherwise than it looks) is refused here with `SettingsFileError`, naming the key,
the file and what is allowed: a key that is not a `TrainingArguments` field (`TrainingArguments(**d)`
raises TypeError), `bf16` and `fp16` both true (`TrainingArguments.__post_init__`; DeepSpeed's
`DeepSpeedConfig._do_error_check`), a string where `TrainingArguments` has a boolean (kept as given,
so "false" is true to the Trainer), fewer than 1 accumulation step or micro-batch (DeepSpeed's
`_batch_assertion`; the Trainer divides by them), a ZeRO size that DeepSpeedZeroConfig's fields
refuse (negative, not whole, `reduce_bucket_size` 0), and an FSDP boolean that transformers'
`str_to_bool` cannot read (`TrainingArguments._process_fsdp_args`: "yes", 1, "true" are true),
and checkpointing keywords that are not a dict (or a JSON object), a `use_reentrant` that is not a
boolean or an `every_n_layers` below 1.
The same values given as flags raise plain `ValueError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from trainer_memcb.utils.safe_io import UnsafeFileError, read_json
from trainer_memcb.utils.units import MiB

__all__ = ["StepSettings", "DEVICE_TYPES", "LIGER_KERNEL_DEFAULTS", "LIGER_MODEL_TYPES",
           "check_liger_kernel_config", "check_tp_plan", "SettingsFileError",
           "resolve_settings", "read_json_file", "check_training_args", "MAX_SETTINGS_FILE_BYTES"]

# A TrainingArguments dump, a DeepSpeed or an FSDP config is a few KiB; a larger file is not one.
MAX_SETTINGS_FILE_BYTES = 16 * MiB
# DeepSpeed 0.19.8 runtime/zero/config.py, DeepSpeedZeroConfig's field defaults.
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "contiguous_gradients": True,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
# DeepSpeedZeroConfig's lower bounds (deepspeed 0.19.8 runtime/zero/config.py: `Field(..., gt=0)` for
# reduce_bucket_size, `ge=0` for the others).
ZERO_MINIMUMS = {"reduce_bucket_size": 1}
# transformers' `str_to_bool` (training_args.py), which `_process_fsdp_args` applies to str(value).lower().
_TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")
_FALSE_WORDS = ("n", "no", "f", "false", "off", "0")
# torch DistributedDataParallel's bucket_cap_mb default (None there means 25 MiB).
DDP_BUCKET_CAP_MB = 25
_DEFAULT = "default"
# liger-kernel 0.8.5 `apply_liger_kernel_to_llama`'s keywords and defaults (mistral, qwen2, qwen3 alike).
LIGER_KERNEL_DEFAULTS: Dict[str, bool] = {"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True,
                                          "rms_norm": True, "swiglu": True}
# The model types whose Liger patching is planned: model_type -> transformers' modeling module whose
# `apply_rotary_pos_emb` liger-kernel replaces (monkey_patch.py, apply_liger_kernel_to_<model_type>).
LIGER_MODEL_TYPES: Dict[str, str] = {"llama": "transformers.models.llama.modeling_llama",
                                     "mistral": "transformers.models.mistral.modeling_mistral",
                                     "qwen2": "transformers.models.qwen2.modeling_qwen2",
                                     "qwen3": "transformers.models.qwen3.modeling_qwen3"}
# The devices a step is planned for.
DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True)
class StepSettings:
    """Everything the step plan reads, resolved once, each value's source in `sources`.

    Attributes:
        batch_size, seq_len: the per-process micro-batch.
        gradient_accumulation_steps: micro-batches per optimizer step (the peak is one micro-batch's).
        precision, optimizer, gradient_checkpointing, max_grad_norm: as the Trainer trains.
        checkpointing_kwargs: the Trainer's `activation_checkpointing_kwargs` (or
            `gradient_checkpointing_kwargs`) as given, None when not given: `use_reentrant` and
            torch's other `checkpoint` keywords, transformers 5's `every_n_layers` and `offload`.
        world_size, nodes, sharding: the job (sharding one of `setup.SHARDINGS`).
        rank: the process the plan is for, 0 to world_size - 1. Under DeepSpeed ZeRO-1/2 each rank's
            flat partition holds other parameters' values, so the gradients it keeps, and when it
            makes its gradient partition, differ by rank; DDP, FSDP2 (even, padded shards) and
            ZeRO-3 (`ceil(numel / world_size)` of every parameter) hold the same on every rank.
        bucket_cap_mb, gradient_as_bucket_view, find_unused_parameters: DDP's reducer
            (`find_unused_parameters` from the Trainer's arguments as the Trainer sets it).
        reshard_after_forward, fsdp_cpu_offload, replicate: FSDP2 (`replicate` > 1: HSDP, a 2-D mesh
            of `replicate` x `world_size // replicate`).
        tp_size: tensor parallelism's degree (accelerate's `ParallelismConfig.tp_size`,
            `trainer_memcb.plan.settings.parallelism`): the model's linear layers split over `tp_size`
            processes by its `tp_plan`; planned so far alone (`world_size == tp_size`) or with FSDP2
            (`world_size // tp_size` shards of each TP shard).
        tp_plan: the user's tensor-parallel rules, module name (`*` for a layer number) -> transformers'
            style name, over the model's own plan as transformers 5's `DistributedConfig(tp_plan=dict)`
            merges them (`trainer_memcb.plan.model.tp_plan.model_tp_plan`); None: the model's plan.
        cp_size, cp_comm_strategy: context parallelism's degree and how its ring rotates the keys and
            values ("allgather", accelerate's default, or "alltoall"; accelerate's
            `TorchContextParallelConfig.cp_comm_strategy`): each rank holds `seq_len / cp_size` of the
            sequence, attention is torch's ring over `cp_size` ranks, beside FSDP2 over the
            `world_size // replicate` ranks of `dp_shard x cp` (`trainer_memcb.plan.settings.parallelism`
            lists the rules).
        torch_empty_cache_steps: the Trainer's `torch_empty_cache_steps`: `torch.cuda.empty_cache()`
            after the forward of each step whose `global_step` it divides (the allocator replay).
        target_len, image_size, padding: the rest of the micro-batch's shape: a seq2seq model's
            labels length, an image model's height and width, the padded positions of the batch.
        packing: padding-free batches (`DataCollatorWithFlattening`): the micro-batch is one row of
            `packing` tokens, sequences of `seq_len` each and the rest one shorter, positions
            restarting at each (`trainer_memcb.plan.model.step_inputs`); None: rows of `seq_len`.
        torch_compile: the Trainer's `torch_compile=True` (True, or None where not asked): the step
            is still traced eagerly, and the plan says its figures are the eager step's.
        attn_implementation: the attention path to trace ("eager", "sdpa", ...); None keeps the
            model config's.
        use_liger_kernel: the Trainer's `use_liger_kernel=True` (True, or None where not asked): the
            model patched as liger-kernel patches it, its kernels planned (`plan.step.liger_kernels`).
        liger_kernel_config: the Trainer's `liger_kernel_config`, the kernels turned on or off
            (`LIGER_KERNEL_DEFAULTS`' keys); None: liger-kernel's defaults.
        device_type: the device the run uses ("cuda" or "cpu", `DEVICE_TYPES`).
        device_memory, reserve_bytes: the device's memory per process (None: not asked, or the GPU
            preset's), and the part of it left out for what the plan does not count.
        alloc_conf: `PYTORCH_CUDA_ALLOC_CONF` for the allocator replay ("" for torch's defaults;
            None reads the environment when the plan is made, as torch does).
        gpu: a GPU preset's name (`trainer_memcb.plan.device.gpus`): its memory, CUDA context and
            compute capability.
        zero: DeepSpeed's `zero_optimization` section, "auto" values filled and defaults added.
        sources: setting name -> where its value came from ("default", "training args", "deepspeed
            config", "fsdp config", "flag").
        preference: TRL's DPO step (`trainer_memcb.plan.step.preference.DpoStep`: the loss, beta and
            where the reference log-probs come from), None for the plain Trainer's step; with it,
            `seq_len` is DPO's `max_length` and `batch_size` counts pairs (the forward's batch doubled).
            Or TRL's GRPO step (`trainer_memcb.plan.step.grpo.GrpoStep`): then `seq_len` is the
            prompts' length and `batch_size` counts completions (`per_device_train_batch_size`).
            TRL's steps are planned on one process, or, SFT's on padded rows, under context
            parallelism beside FSDP2 (`check_context_parallel_step` names why the others are not).
    """

    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    gradient_accumulation_steps: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw_torch"
    gradient_checkpointing: bool = False
    checkpointing_kwargs: Optional[Dict[str, Any]] = None
    max_grad_norm: Optional[float] = 1.0
    world_size: int = 1
    rank: int = 0
    nodes: int = 1
    sharding: str = "none"
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    replicate: int = 1
    tp_size: int = 1
    tp_plan: Optional[Dict[str, str]] = None
    cp_size: int = 1
    cp_comm_strategy: Optional[str] = None
    torch_empty_cache_steps: Optional[int] = None
    target_len: Optional[int] = None
    image_size: Optional[int] = None
    padding: int = 0
    packing: Optional[int] = None
    torch_compile: Optional[bool] = None
    attn_implementation: Optional[str] = None
    use_liger_kernel: Optional[bool] = None
    liger_kernel_config: Optional[Dict[str, bool]] = None
    device_type: str = "cuda"
    device_memory: Optional[int] = None
    reserve_bytes: int = 0
    alloc_conf: Optional[str] = None
    gpu: Optional[str] = None
    zero: Dict[str, Any] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)
    preference: Optional[Any] = None

    def __post_init__(self) -> None:
        _check_step_shape(self)
        check_liger_kernel_config(self.liger_kernel_config)
        if self.use_liger_kernel and self.preference is not None and \
                (self.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
            # trl 1.16 DPOTrainer.__init__ (SFTTrainer's, ...) refuses it, and turns the fused loss off otherwise.
            trainer = getattr(self.preference, "trainer", "dpo").upper()
            raise ValueError(f"liger_kernel_config={{\"fused_linear_cross_entropy\": true}} with TRL's {trainer} step: TRL "
                             "refuses it (\"it replaces the model's forward, which this trainer patches with a fused "
                             "LM head\"); leave it out, TRL applies the layer kernels alone")
        _check_tensor_parallel(self)
        from trainer_memcb.plan.settings.parallelism import check_context_parallel

        check_context_parallel(self)  # before the next: its refusals of TRL's steps name the trainer's own rule
        if self.preference is not None and self.sharding != "none" and self.cp_size == 1:
            # Beside processes TRL's steps are planned under context parallelism only (SFT's padded rows).
            raise ValueError(f"sharding {self.sharding!r} with TRL's DPO step: it is planned on one process only "
                             "(sharding none) so far")
        if self.sharding.startswith("zero") or self.precision.startswith("deepspeed-"):
            zero = dict(ZERO_DEFAULTS)
            zero.update(self.zero)
            zero["stage"] = self.zero_stage
            object.__setattr__(self, "zero", zero)

    @property
    def zero_stage(self) -> int:
        return int(self.sharding[4:]) if self.sharding.startswith("zero") else 0

    @property
    def overlap_comm(self) -> bool:
        # DeepSpeedZeroConfig.overlap_comm_valid: None means True for stage 3, False otherwise.
        value = self.zero.get("overlap_comm")
        return self.zero_stage == 3 if value is None else bool(value)

    @property
    def offload_optimizer(self) -> bool:
        return _offloaded(self.zero.get("offload_optimizer"))

    @property
    def offload_params(self) -> bool:
        return _offloaded(self.zero.get("offload_param")) or self.fsdp_cpu_offload

    # The device as the settings give it, each read from the GPU preset in one place (`gpu`'s, else
    # the defaults of `trainer_memcb.plan.device.gpus`): the plan's stages ask these, not the preset table.

    @property
    def gpu_preset(self) -> Any:
        """The `GpuPreset` that `gpu` names, or None."""
        from trainer_memcb.plan.device.gpus import gpu_preset

        return gpu_preset(self.gpu) if self.gpu is not None else None

    @property
    def device_memory_bytes(self) -> Optional[int]:
        """The device's memory: `device_memory`, else the GPU preset's total; None when neither is given."""
        preset = self.gpu_preset
        return self.device_memory if self.device_memory is not None or preset is None else preset.total_bytes

    @property
    def compute_capability(self) -> Tuple[int, int]:
        """The GPU's (major, minor): the preset's, else an sm80 GPU's (`DEFAULT_COMPUTE_CAPABILITY`)."""
        from trainer_memcb.plan.device.gpus import DEFAULT_COMPUTE_CAPABILITY

        preset = self.gpu_preset
        return preset.compute_capability if preset is not None else DEFAULT_COMPUTE_CAPABILITY

    @property
    def cuda_context_bytes(self) -> int:
        """What the CUDA context holds outside the allocator: the preset's, else `DEFAULT_CUDA_CONTEXT_BYTES`."""
        from trainer_memcb.plan.device.gpus import DEFAULT_CUDA_CONTEXT_BYTES

        preset = self.gpu_preset
        return preset.cuda_context_bytes if preset is not None else DEFAULT_CUDA_CONTEXT_BYTES

    def used(self) -> Tuple[Tuple[str, Any, str], ...]:
        """(name, value, source) for every setting, in field order; ZeRO's keys as `zero.KEY`; the
        DPO step (`preference`) is the plan's own entry (`PlannedSettings.preference`), not a row, and
        `tp_size` is a row only where some source gave it."""
        rows = []
        for item in dataclasses.fields(self):
            if item.name in ("zero", "sources", "preference") or getattr(self, item.name) is None:
                continue
            if item.name in ("tp_size", "cp_size") and getattr(self, item.name) == 1 and item.name not in self.sources:
                continue  # no tensor parallelism: no row, as before it was planned
            rows.append((item.name, getattr(self, item.name), self.sources.get(item.name, _DEFAULT)))
        for key in sorted(self.zero):
            # The stage is the sharding's (`__post_init__`), wherever the config file put another.
            source = self.sources.get("sharding", _DEFAULT) if key == "stage" else self.sources.get(f"zero.{key}", _DEFAULT)
            rows.append((f"zero.{key}", self.zero[key], source))
        return tuple(rows)


def _whole(value: Any, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def _check_step_shape(settings: "StepSettings") -> None:
    """The micro-batch's shape and the device within what a step can be planned for; a preset or
    parsed allocator settings given as objects are kept by name and text.

    Raises:
        ValueError: naming the setting, its value and what is allowed.
    """
    from trainer_memcb.plan.device.alloc_conf import AllocConf, as_alloc_conf
    from trainer_memcb.plan.device.gpus import GpuPreset, gpu_preset

    for name in ("batch_size", "seq_len", "target_len", "image_size"):
        value = getattr(settings, name)
        if value is not None and not _whole(value, 1):
            raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")
    for name, least in (("padding", 0), ("reserve_bytes", 0), ("device_memory", 1)):
        value = getattr(settings, name)
        if value is not None and not _whole(value, least):
            what = "a whole number of bytes" if name != "padding" else "a whole number"
            raise ValueError(f"{name}={value!r}: expected {what}, at least {least}")
    _check_packing(settings)
    if settings.device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type={settings.device_type!r} is not one of: {', '.join(DEVICE_TYPES)}")
    if isinstance(settings.gpu, GpuPreset):
        object.__setattr__(settings, "gpu", settings.gpu.name)
    elif settings.gpu is not None:
        object.__setattr__(settings, "gpu", gpu_preset(settings.gpu).name)
    if isinstance(settings.alloc_conf, AllocConf):
        object.__setattr__(settings, "alloc_conf", settings.alloc_conf.text)
    elif settings.alloc_conf is not None:
        as_alloc_conf(settings.alloc_conf)


def _check_tensor_parallel(settings: "StepSettings") -> None:
    """Tensor parallelism within what the plan traces so far: alone on its processes or with FSDP2
    on the rest of the world (HSDP's replicas and CPU offload among its options), without DeepSpeed
    or TRL's steps."""
    tp = settings.tp_size
    if not _whole(tp, 1):
        raise ValueError(f"tp_size={tp!r}: expected a whole number of at least 1")
    _check_tp_plan(settings.tp_plan, tp)
    if tp == 1:
        return
    world, sharding = settings.world_size, settings.sharding
    alone, with_fsdp2 = world == tp and sharding == "none", world > tp and sharding.startswith("fsdp-")
    if world % tp or not (alone or with_fsdp2):
        raise ValueError(f"parallelism tp={tp} on world_size={world} with sharding {settings.sharding!r}: tensor "
                         "parallelism is planned alone (world_size = tp) or with FSDP2 (dp_shard, world_size = "
                         "dp_replicate x dp_shard x tp) so far")
    if settings.precision.startswith("deepspeed-"):
        raise ValueError(f"parallelism tp={tp} with precision {settings.precision!r}: tensor parallelism is planned "
                         "alone or with FSDP2 so far, without DeepSpeed")
    if settings.replicate > 1 and ((world // tp) % settings.replicate or world // tp == settings.replicate):
        raise ValueError(f"parallelism tp={tp} with replicate={settings.replicate} on world_size={world}: the world is "
                         "dp_replicate x dp_shard x tp processes, with dp_shard > 1 (accelerate does not compose "
                         "DDP with TP)")
    if settings.preference is not None:
        trainer = getattr(settings.preference, "trainer", "dpo").upper()
        raise ValueError(f"parallelism tp={tp} with TRL's {trainer} step: TRL's steps are planned without tensor "
                         "parallelism so far")


def _check_tp_plan(plan: Any, tp: int) -> None:
    """The user's tensor-parallel rules (`check_tp_plan`), given with tensor parallelism."""
    if plan is None:
        return
    check_tp_plan(plan)
    if tp == 1:
        raise ValueError("tp_plan without tensor parallelism: give --parallelism tp=N (N > 1) beside it")


def check_tp_plan(plan: Any) -> None:
    """The user's tensor-parallel rules: a non-empty mapping of module names to style names
    (`trainer_memcb.plan.settings.parallelism.TP_STYLES`).

    Raises:
        ValueError: one line naming the bad entry and what is allowed.
    """
    from trainer_memcb.plan.settings.parallelism import TP_STYLES

    if not isinstance(plan, dict) or not plan or not all(isinstance(key, str) for key in plan):
        raise ValueError(f"tp_plan={plan!r}: expected a JSON object of module names to style names, at least one")
    for name, style in plan.items():
        if style == "sequence_parallel":
            # transformers 5.25's own style, in a real 2-process run of the tiny Llama's norms here:
            # "aten.mul.Tensor got mixed torch.Tensor and DTensor" in LlamaRMSNorm's forward.
            raise ValueError(f"tp_plan {name!r}: style 'sequence_parallel' is not planned: transformers' "
                             "SequenceParallel fails in the norm's forward (its weight a plain tensor beside the "
                             "DTensor input), and no model's own plan uses it")
        if style not in TP_STYLES:
            raise ValueError(f"tp_plan {name!r}: style {style!r} is not planned (planned: {', '.join(TP_STYLES)})")


def _check_packing(settings: "StepSettings") -> None:
    """A packed micro-batch is one row of at least one sequence, without padding."""
    packing = settings.packing
    if packing is None:
        return
    if not _whole(packing, 1):
        raise ValueError(f"packing={packing!r}: expected a whole number of tokens, at least 1")
    if settings.batch_size not in (None, 1):
        raise ValueError(f"packing={packing} makes the micro-batch one row (DataCollatorWithFlattening concatenates "
                         f"the batch's sequences): batch_size={settings.batch_size} has no meaning with it; give "
                         f"batch size 1 and the row's tokens as packing")
    if settings.padding:
        raise ValueError(f"packing={packing} is a padding-free batch: padding={settings.padding} has no meaning with it")
    if settings.seq_len is not None and packing < settings.seq_len:
        raise ValueError(f"packing={packing} is fewer tokens than one sequence (seq_len={settings.seq_len}): give "
                         f"at least {settings.seq_len}")


def check_liger_kernel_config(config: Optional[Mapping[str, Any]]) -> Dict[str, bool]:
    """The kernels `apply_liger_kernel_to_<model>(**config)` turns on (None: liger-kernel's defaults).

    Raises:
        ValueError: a key the apply functions do not take (liger-kernel drops it silently), a value
            that is not a boolean, or `cross_entropy` with `fused_linear_cross_entropy` (its assert).
    """
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"liger_kernel_config={config!r}: expected a dict of kernels to true or false, such as "
                         "{\"rope\": false}")
    config = dict(config or {})
    unknown = sorted(set(config) - set(LIGER_KERNEL_DEFAULTS))
    if unknown:
        raise ValueError(f"liger_kernel_config: {unknown[0]!r} is not a keyword of liger-kernel's apply functions "
                         f"(it would be dropped silently): give some of {', '.join(LIGER_KERNEL_DEFAULTS)}")
    for key, value in config.items():
        if not isinstance(value, bool):
            raise ValueError(f"liger_kernel_config: {key}={value!r}: expected true or false")
    kernels = dict(LIGER_KERNEL_DEFAULTS, **config)
    if kernels["cross_entropy"] and kernels["fused_linear_cross_entropy"]:
        raise ValueError("liger_kernel_config: cross_entropy and fused_linear_cross_entropy cannot both be true "
                         "(liger-kernel asserts it): set fused_linear_cross_entropy to false")
    return kernels


class SettingsFileError(ValueError):
    """A value of the Trainer's arguments or an engine's config that the Trainer (or the engine)
    would refuse or read otherwise than it looks; the message names the key and what is allowed."""


def _str_to_bool(value: Any, what: str) -> bool:
    """`value` read as transformers' `str_to_bool(str(value).lower())` reads it."""
    word = str(value).lower()
    if word in _TRUE_WORDS or word in _FALSE_WORDS:
        return word in _TRUE_WORDS
    raise SettingsFileError(f"{what}={value!r}: the Trainer reads it with str_to_bool, which takes "
                            f"{'/'.join(_TRUE_WORDS)} (true) or {'/'.join(_FALSE_WORDS)} (false)")


def check_training_args(values: Mapping[str, Any], where: str = "training args") -> None:
    """Refuse what `TrainingArguments(**values)` and the Trainer would refuse or misread: a key that
    is not a field, `bf16` and `fp16` both true, a string where a boolean is expected, fewer than 1
    accumulation step.

    Raises:
        SettingsFileError: naming the key and what is allowed.
    """
    from transformers import TrainingArguments

    fields = {item.name: item for item in dataclasses.fields(TrainingArguments) if item.init}
    unknown = sorted(key for key in values if key not in fields)
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(fields), n=1)
        which = "is not a TrainingArguments field" if len(unknown) == 1 else "are not TrainingArguments fields"
        raise SettingsFileError(f"{where}: {', '.join(map(repr, unknown))} {which} (TrainingArguments(**args) raises "
                                f"TypeError)" + (f"; did you mean {close[0]!r}?" if close else ""))
    for key, value in values.items():
        annotation = str(fields[key].type)  # "bool", "bool | None": a boolean that takes no string
        if isinstance(value, str) and "bool" in annotation and "str" not in annotation:
            raise SettingsFileError(f"{where}: {key}={value!r} is a string: TrainingArguments keeps it as given and the "
                                    f"Trainer takes any non-empty string as true; write true or false")
    if values.get("bf16") and values.get("fp16"):
        raise SettingsFileError(f"{where}: bf16 and fp16 are both true: TrainingArguments refuses it "
                                "(\"At most one of fp16 and bf16 can be True\"); keep one")
    steps = values.get("gradient_accumulation_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise SettingsFileError(f"{where}: gradient_accumulation_steps={steps!r}: expected a whole number of at least 1 "
                                "(the Trainer divides the batches of an epoch by it)")
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "eval_accumulation_steps"):
        value = values.get(key)  # eval_accumulation_steps: None (the default) keeps all on the device
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SettingsFileError(f"{where}: {key}={value!r}: expected a whole number of at least 1")
    if values.get("use_liger_kernel") and values.get("liger_kernel_config") is not None:
        try:  # read only with use_liger_kernel, as the Trainer reads it
            _liger_kernel_config(values["liger_kernel_config"])
        except ValueError as error:
            raise SettingsFileError(f"{where}: {error}") from None


# The name each setting has where it came from, for the messages.
_KEYS = {
    "flag": {"batch_size": "--batch-size", "bucket_cap_mb": "--bucket-cap-mb"},
    "training args": {"batch_size": "per_device_train_batch_size", "bucket_cap_mb": "ddp_bucket_cap_mb"},
    "deepspeed config": {"batch_size": "train_micro_batch_size_per_gpu"},
}


def _check_values(values: Mapping[str, Any], zero: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """The resolved values each within what the Trainer and the engines accept; a flag's bad value
    raises ValueError, a file's SettingsFileError."""
    def refuse(name: str, value: Any, allowed: str) -> None:
        source = sources.get(name, _DEFAULT)
        kind = "deepspeed config" if "deepspeed" in source else ("flag" if source == "flag" else "training args")
        key = _KEYS[kind].get(name, name.replace("zero.", "zero_optimization.", 1))
        if source == "flag":
            raise ValueError(f"{key} {value!r}: expected {allowed}")
        raise SettingsFileError(f"{source}: {key}={value!r}: expected {allowed}")

    for name in ("batch_size", "gradient_accumulation_steps"):
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            refuse(name, value, "a whole number of at least 1")
    cap = values.get("bucket_cap_mb")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0):
        refuse("bucket_cap_mb", cap, "a finite number of megabytes above 0 (DDP makes buckets of "
                                     "int(bucket_cap_mb * 2**20) bytes)")
    for key in ZERO_DEFAULTS:
        if key not in zero or isinstance(zero[key], bool):
            continue
        value, least = zero[key], ZERO_MINIMUMS.get(key, 0)
        whole = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value == int(value))
        if not whole or value < least:
            refuse(f"zero.{key}", value, f"a whole number of at least {least}, as DeepSpeedZeroConfig's {key} field takes")


def _world_of_batch(ds: Mapping[str, Any], source: str, values: Dict[str, Any], sources: Dict[str, str]) -> None:
    """The world size a DeepSpeed config's numbers imply: `train_batch_size` = micro-batch x
    accumulation x world size (deepspeed 0.19.8 runtime/config.py `_batch_assertion`), taken when
    no flag gives it, refused when a flag gives another."""
    numbers = [ds.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu")]
    steps = ds.get("gradient_accumulation_steps", 1)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers + [steps]):
        return  # "auto" (the Trainer fills them from its arguments and the processes), or left out
    total, micro = numbers
    world, remainder = divmod(total, micro * steps)
    given = values.get("world_size")
    if remainder or world < 1 or (given is not None and given != world):
        raise SettingsFileError(f"{source}: train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                                f"gradient_accumulation_steps={steps} x world size {given or 'W'}: DeepSpeed refuses it "
                                "(\"Check batch related parameters\")")
    if given is None:
        values["world_size"], sources["world_size"] = world, f"{source} (train_batch_size)"


def _offloaded(section: Any) -> bool:
    return isinstance(section, Mapping) and section.get("device", "none") not in ("none", None)


def read_json_file(path: str, what: str) -> Dict[str, Any]:
    """A JSON object from `path`; ValueError naming the file and what was expected otherwise.

    Read through `trainer_memcb.utils.safe_io.read_json`: a named pipe, a device (`/dev/zero`) or
    a file over `MAX_SETTINGS_FILE_BYTES` is refused at once, never waited on or read to the end."""
    if str(path).endswith((".bin", ".pt", ".pkl", ".pickle")):
        raise ValueError(f"{what} {path!r}: only JSON is read (a pickle such as training_args.bin is never loaded); "
                         "save it with TrainingArguments.to_json_string()")
    try:
        value = read_json(path, MAX_SETTINGS_FILE_BYTES)
    except UnsafeFileError as error:
        raise ValueError(f"{what}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path!r}: expected a JSON object, got {type(value).__name__}")
    return value


def _args_dict(training_args: Any) -> Dict[str, Any]:
    if training_args is None:
        return {}
    if isinstance(training_args, Mapping):
        values = dict(training_args)
        check_training_args(values)
        return values
    if isinstance(training_args, (str, os.PathLike)):
        values = read_json_file(os.fspath(training_args), "training args")
        check_training_args(values, f"training args {os.fspath(training_args)!r}")
        return values
    to_dict = getattr(training_args, "to_dict", None)
    if to_dict is None:
        raise ValueError(f"training_args={type(training_args).__name__}: expected TrainingArguments, a dict or a JSON file")
    # The object itself: its fsdp_config and deepspeed already loaded by __post_init__.
    values = to_dict()
    for name in ("deepspeed", "fsdp_config", "fsdp"):
        if hasattr(training_args, name):
            values[name] = getattr(training_args, name)
    return values


def _checkpointing_kwargs(args: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The checkpointing keywords of the Trainer's arguments, read as `TrainingArguments` reads them
    (a JSON string is parsed into a dict), or None; SettingsFileError for what it or torch refuses."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = args.get(name)
        if not value:
            continue
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise SettingsFileError(f"training args: {name}={value!r} is neither a JSON object nor a dict "
                                        "(TrainingArguments parses a string as JSON)") from None
        if not isinstance(value, dict):
            raise SettingsFileError(f"training args: {name}={value!r}: expected a dict of keywords for "
                                    "torch.utils.checkpoint.checkpoint, such as {\"use_reentrant\": false}")
        reentrant = value.get("use_reentrant", False)
        if not isinstance(reentrant, bool):
            raise SettingsFileError(f"training args: {name}: use_reentrant={reentrant!r}: expected true or false "
                                    "(checkpoint takes any other value as true)")
        layers = value.get("every_n_layers", 1)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise SettingsFileError(f"training args: {name}: every_n_layers={layers!r}: expected a whole number "
                                    "of at least 1")
        return dict(value)
    return None


def _liger_kernel_config(value: Any) -> Dict[str, bool]:
    """The arguments' `liger_kernel_config` (a dict, or JSON text of one, as TrainingArguments parses a
    string), as the apply function takes it; ValueError for what it would misread."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"liger_kernel_config={value!r} is neither a JSON object nor a dict") from None
    check_liger_kernel_config(value)
    return dict(value)


def _precision(args: Mapping[str, Any], deepspeed: bool) -> Optional[str]:
    if args.get("bf16"):
        return "deepspeed-bf16" if deepspeed else "autocast-bf16"
    if args.get("fp16"):
        return "deepspeed-fp16" if deepspeed else "autocast-fp16"
    if "bf16" in args or "fp16" in args:
        return "fp32"
    return None


def _fsdp_on(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (list, tuple)):
        return bool(value)
    return bool(value)


def _fill_auto(ds: Dict[str, Any], args: Mapping[str, Any], hidden_size: Optional[int], world_size: int,
               sources: Dict[str, str]) -> Dict[str, Any]:
    """The `zero_optimization` section with "auto" filled as `trainer_config_process` /
    `trainer_config_finalize` fill it (transformers integrations/deepspeed.py), and DeepSpeed's
    defaults for the keys left out."""
    zero = dict(ds.get("zero_optimization") or {})
    for key in list(zero):
        if zero[key] != "auto":
            sources[f"zero.{key}"] = "deepspeed config"
    autos = {"reduce_bucket_size": None, "stage3_prefetch_bucket_size": None, "stage3_param_persistence_threshold": None}
    if hidden_size is not None:
        autos = {"reduce_bucket_size": hidden_size * hidden_size,
                 "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                 "stage3_param_persistence_threshold": 10 * hidden_size}
    stage = zero.get("stage", 0)
    for key, value in list(zero.items()):
        if value != "auto":
            continue
        filled = autos.get(key)
        if filled is None or (key.startswith("stage3_") and stage != 3):
            raise ValueError(f"deepspeed config zero_optimization.{key}=\"auto\": the Trainer fills it from the "
                             "model's hidden_size (stage 3 for the stage3_ keys); give a number")
        zero[key] = filled
        sources[f"zero.{key}"] = "deepspeed config auto (Trainer: from hidden_size)"
    for key, value in ZERO_DEFAULTS.items():
        zero.setdefault(key, value)
    # Accepted under either name by DeepSpeedZeroConfig (aliases): keep the stage3_ spelling.
    for short in ("prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold", "max_reuse_distance"):
        if short in zero:
            zero[f"stage3_{short}"] = zero.pop(short)
    return zero


class _Resolving:
    """The settings resolved so far and where each came from. The sources are read in order of
    precedence (training args, engine config, flags), so a later `put` overwriting an earlier one
    is what makes a later source win."""

    def __init__(self) -> None:
        self.values: Dict[str, Any] = {}
        self.sources: Dict[str, str] = {}

    def put(self, name: str, value: Any, source: str) -> None:
        """Take `value` from `source`; None is a source that does not give the setting, which must
        leave what an earlier source gave."""
        if value is not None:
            self.values[name] = value
            self.sources[name] = source


def _put_training_args(got: _Resolving, args: Mapping[str, Any]) -> None:
    """The settings the Trainer's arguments give, read as the Trainer reads them (the optimizer's
    enum spelt as its value, `max_grad_norm` None as 0, DDP's unused-parameter search derived from
    checkpointing as `Trainer._build_accelerator_args` derives it)."""
    arg = "training args"
    got.put("batch_size", args.get("per_device_train_batch_size"), arg)
    got.put("gradient_accumulation_steps", args.get("gradient_accumulation_steps"), arg)
    got.put("optimizer", str(args["optim"]).split(".")[-1].lower() if args.get("optim") is not None else None, arg)
    checkpointing = args.get("gradient_checkpointing", args.get("activation_checkpointing"))
    got.put("gradient_checkpointing", bool(checkpointing) if checkpointing is not None else None, arg)
    got.put("checkpointing_kwargs", _checkpointing_kwargs(args), arg)
    if "max_grad_norm" in args:
        got.put("max_grad_norm", float(args["max_grad_norm"] or 0.0), arg)
    got.put("bucket_cap_mb", args.get("ddp_bucket_cap_mb"), arg)
    got.put("torch_empty_cache_steps", args.get("torch_empty_cache_steps"), arg)
    # Only when on: a dumped TrainingArguments names torch_compile=false, which changes nothing.
    got.put("torch_compile", True if args.get("torch_compile") else None, arg)
    got.put("use_liger_kernel", True if args.get("use_liger_kernel") else None, arg)
    if args.get("use_liger_kernel") and args.get("liger_kernel_config") is not None:
        # Read only with use_liger_kernel, as the Trainer reads it.
        got.put("liger_kernel_config", _liger_kernel_config(args["liger_kernel_config"]), arg)
    if "ddp_find_unused_parameters" in args:
        # Trainer._build_accelerator_args: ddp_find_unused_parameters when set, otherwise True for a
        # model without gradient checkpointing (a PreTrainedModel with it: False).
        unused = args["ddp_find_unused_parameters"]
        got.put("find_unused_parameters", bool(unused) if unused is not None else not checkpointing,
                arg if unused is not None else "training args (Trainer: not gradient_checkpointing)")


def _engine_configs(args: Mapping[str, Any], deepspeed: Any,
                    fsdp_config: Any) -> Tuple[Optional[Dict[str, Any]], str, Optional[Dict[str, Any]]]:
    """(DeepSpeed config, where it came from, FSDP config), each read from its file when given as a
    path; a config given to `resolve_settings` wins over the one the Trainer's arguments name, and
    the arguments' `fsdp_config` counts only when their `fsdp` turns FSDP on."""
    ds = deepspeed if deepspeed is not None else args.get("deepspeed")
    ds_source = "deepspeed config" if deepspeed is not None else "training args (deepspeed)"
    if isinstance(ds, (str, os.PathLike)):
        ds = read_json_file(os.fspath(ds), "deepspeed config")
    fsdp = fsdp_config if fsdp_config is not None else args.get("fsdp_config")
    if fsdp_config is None and "fsdp" in args and not _fsdp_on(args.get("fsdp")):
        # The Trainer shards only when `fsdp` is set; transformers 4.x fills `fsdp_config` with
        # defaults ({"min_num_params": 0, "xla": False, ...}) even then, which must not turn FSDP on.
        fsdp = None
    if isinstance(fsdp, (str, os.PathLike)):
        fsdp = read_json_file(os.fspath(fsdp), "fsdp config")
    return ds, ds_source, fsdp


def _put_deepspeed(got: _Resolving, ds: Mapping[str, Any], ds_source: str) -> None:
    """The sharding, batch, clipping and precision a DeepSpeed config gives ("auto" leaves the
    Trainer's value); both precisions enabled is refused as `DeepSpeedConfig._do_error_check` does."""
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    got.put("sharding", f"zero{stage}" if stage else "ddp", ds_source)
    for key, setting in (("train_micro_batch_size_per_gpu", "batch_size"), ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                         ("gradient_clipping", "max_grad_norm")):
        if key in ds and ds[key] != "auto":
            got.put(setting, ds[key], ds_source)
    if (ds.get("bf16") or {}).get("enabled") is True and (ds.get("fp16") or {}).get("enabled") is True:
        # DeepSpeedConfig._do_error_check (deepspeed 0.19.8 runtime/config.py).
        raise SettingsFileError(f"{ds_source}: bf16.enabled and fp16.enabled are both true: DeepSpeed refuses it "
                                "(\"bfloat16 and fp16 modes cannot be simultaneously enabled\"); keep one")
    if (ds.get("bf16") or {}).get("enabled") is True:
        got.put("precision", "deepspeed-bf16", ds_source)
    elif (ds.get("fp16") or {}).get("enabled") is True:
        got.put("precision", "deepspeed-fp16", ds_source)
    elif got.values.get("precision", "fp32") == "fp32":
        got.put("precision", "fp32", ds_source if ("bf16" in ds or "fp16" in ds) else got.sources.get("precision", _DEFAULT))


def _put_fsdp(got: _Resolving, fsdp: Optional[Mapping[str, Any]], args: Mapping[str, Any], fsdp_config: Any) -> None:
    """The sharding, resharding, offload and checkpointing an FSDP config (or the arguments' legacy
    `fsdp` words) gives, read as `TrainingArguments._process_fsdp_args` reads them; what the plan
    cannot trace (HSDP without a degree, FSDP1) is refused."""
    fsdp = dict(fsdp or {})
    fsdp = {key[5:] if key.startswith("fsdp_") else key: value for key, value in fsdp.items()}
    legacy = args.get("fsdp")
    legacy = legacy.split() if isinstance(legacy, str) else (legacy if isinstance(legacy, list) else [])
    src = "fsdp config" if fsdp_config is not None else "training args (fsdp_config)"
    reshard = fsdp.get("reshard_after_forward")
    if reshard is None and legacy:
        reshard = "shard_grad_op" not in legacy
        src = "training args (fsdp)"
    reshard = True if reshard is None else _str_to_bool(reshard, f"{src}: reshard_after_forward")
    got.put("sharding", "fsdp-full-shard" if reshard else "fsdp-shard-grad-op", src)
    got.put("reshard_after_forward", reshard, src)
    # `if self.fsdp_config.get("cpu_offload", False)` in `_process_fsdp_args`: any true value.
    offload = fsdp.get("cpu_offload", fsdp.get("offload_params"))
    if offload is None and "offload" in legacy:
        offload = True
    got.put("fsdp_cpu_offload", bool(offload) if offload is not None else None, src)
    if "hybrid_shard" in legacy or "hybrid_shard_zero2" in legacy:
        raise ValueError("fsdp hybrid_shard: give the replicate degree with replicate=N (HSDP mesh)")
    # TrainingArguments._process_fsdp_args: `version` (`fsdp_version`) picks the plugin's FSDP,
    # 2 when absent on transformers 5 (1 on 4.x); the plan traces FSDP2's fully_shard only.
    version = fsdp.get("version", 2)
    if str(version) != "2":
        raise ValueError(f"fsdp config version={version!r}: only FSDP2 (version 2, the Trainer's default) is planned")
    if "activation_checkpointing" in fsdp:
        # accelerate's FSDP2 wraps each layer in a non-reentrant checkpoint (`fsdp2_apply_ac`).
        got.put("gradient_checkpointing", _str_to_bool(fsdp["activation_checkpointing"], f"{src}: activation_checkpointing"),
                src)


def _settle_processes(got: _Resolving, args: Mapping[str, Any]) -> None:
    """The settings that follow from the sharding and the world size, settled only once the flags
    are in because a flag may give either: FSDP's resharding from its sharding strategy (unless a
    flag gave it), DDP for a Trainer run on several processes with no engine; a rank or an HSDP
    degree the world cannot hold is refused."""
    values, sources = got.values, got.sources
    if values.get("sharding") == "fsdp-shard-grad-op" and sources.get("reshard_after_forward") != "flag":
        values["reshard_after_forward"] = False
        sources.setdefault("reshard_after_forward", sources["sharding"])
    if values.get("sharding") == "fsdp-full-shard" and sources.get("reshard_after_forward") not in ("flag",):
        values["reshard_after_forward"] = True
        sources.setdefault("reshard_after_forward", sources["sharding"])
    world = values.get("world_size", 1)
    if args and world > values.get("tp_size", 1) and "sharding" not in values:
        # The Trainer under torchrun with neither DeepSpeed nor FSDP wraps the model in DDP
        # (accelerate's prepare_model, DistributedType.MULTI_*); its tensor-parallel processes
        # hold one replica between them.
        got.put("sharding", "ddp", "training args (Trainer: several processes, no deepspeed or fsdp)")
    rank = values.get("rank", 0)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not a process of world_size={world}: expected 0 to {world - 1}")
    replicate = values.get("replicate", 1)
    if world % replicate:
        raise ValueError(f"replicate={replicate} does not divide world_size={world}")


def _layout(args: Mapping[str, Any], parallelism: Any) -> Optional[Tuple[Any, str]]:
    """(the parallel layout, its source): the one given, else the training args' `parallelism_config`."""
    from trainer_memcb.plan.settings.parallelism import Parallelism, parallelism_from_config, parse_parallelism

    if parallelism is not None:
        return (parallelism if isinstance(parallelism, Parallelism) else parse_parallelism(parallelism)), "flag"
    found = parallelism_from_config(args.get("parallelism_config"), "training args")
    return (found, "training args (parallelism_config)") if found is not None else None


def _cp_comm_strategy(args: Mapping[str, Any]) -> Optional[str]:
    """The training args' `parallelism_config.cp_handler.cp_comm_strategy`, if given."""
    config = args.get("parallelism_config")
    handler = config.get("cp_handler") if isinstance(config, Mapping) else getattr(config, "cp_handler", None)
    if handler is None:
        return None
    return handler.get("cp_comm_strategy") if isinstance(handler, Mapping) else getattr(handler, "cp_comm_strategy", None)


def _put_parallelism(got: _Resolving, layout: Any, source: str, strategy: Optional[str] = None) -> None:
    """The settings a parallel layout (`parallelism.Parallelism`) gives: its processes, its tensor
    and context parallel degrees (the ring's rotate method `strategy`, else accelerate's default),
    and FSDP2 (HSDP with replicas) where it shards (over `dp_shard x cp` with context parallelism),
    DDP where it only replicates, as accelerate prepares the model for it."""
    got.put("world_size", layout.total, source)
    got.put("tp_size", layout.tp, source)
    if layout.cp > 1:
        # accelerate runs CP beside FSDP2 only, sharding over dp_shard x cp (`dp_shard_cp`).
        got.put("cp_size", layout.cp, source)
        got.put("cp_comm_strategy", strategy or "allgather", source if strategy else
                "default (accelerate's TorchContextParallelConfig)")
        got.put("sharding", "fsdp-full-shard", source)
        got.put("replicate", layout.dp_replicate, source)
    elif layout.dp_shard > 1:
        got.put("sharding", "fsdp-full-shard", source)
        got.put("replicate", layout.dp_replicate, source)
    elif layout.dp_replicate > 1:
        got.put("sharding", "ddp", source)


def resolve_settings(training_args: Any = None, deepspeed: Any = None, fsdp_config: Any = None,
                     hidden_size: Optional[int] = None, parallelism: Any = None, **flags: Any) -> StepSettings:
    """Resolve the plan's settings once.

    Args:
        training_args: `TrainingArguments`, a dict of its values, or a JSON file of them
            (`to_json_string()`'s output, or a run's dump).
        deepspeed: a DeepSpeed config (dict or JSON file); None takes `training_args.deepspeed`.
        fsdp_config: an FSDP config (dict or JSON file); None takes `training_args.fsdp_config`.
        hidden_size: the model's, for the DeepSpeed config's "auto" bucket sizes.
        parallelism: the parallel layout (`trainer_memcb.plan.settings.parallelism.Parallelism`, or its
            text, "tp=2"); None takes the training args' `parallelism_config`, if any. Its sizes give
            the world size; a `world_size` flag that differs is refused, as accelerate refuses it.
        flags: settings given explicitly (a `StepSettings` field name each); None values are not given.

    Raises:
        ValueError: an unknown flag, a file that is not JSON, an "auto" the Trainer cannot fill, a
            flag's value out of range.
        SettingsFileError: a value of the arguments or a config that the Trainer or the engine
            would refuse or misread (the module's docstring lists them).
    """
    names = {item.name for item in dataclasses.fields(StepSettings)} - {"sources", "zero"}
    unknown = sorted(set(flags) - names)
    if unknown:
        raise ValueError(f"unknown settings {unknown}: expected some of {sorted(names)}")
    got = _Resolving()
    args = _args_dict(training_args)
    _put_training_args(got, args)
    ds, ds_source, fsdp = _engine_configs(args, deepspeed, fsdp_config)
    got.put("precision", _precision(args, deepspeed=bool(ds)), "training args")

    zero: Dict[str, Any] = {}
    if ds:
        _put_deepspeed(got, ds, ds_source)
        zero = _fill_auto(ds, args, hidden_size, 1, got.sources)
    elif fsdp or _fsdp_on(args.get("fsdp")):
        _put_fsdp(got, fsdp, args, fsdp_config)
    layout = _layout(args, parallelism)
    if layout is not None:
        _put_parallelism(got, layout[0], layout[1], _cp_comm_strategy(args))
    for name, value in flags.items():
        got.put(name, value, "flag")
    if layout is not None:
        layout[0].check_world(got.values.get("world_size", 1))
    if ds:
        _world_of_batch(ds, ds_source, got.values, got.sources)
    _settle_processes(got, args)
    _check_values(got.values, zero, got.sources)
    return StepSettings(zero=zero, sources=got.sources, **got.values)
