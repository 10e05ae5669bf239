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
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["StepSettings", "resolve_settings", "read_json_file"]

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
# torch DistributedDataParallel's bucket_cap_mb default (None there means 25 MiB).
DDP_BUCKET_CAP_MB = 25
_DEFAULT = "default"


@dataclass(frozen=True)
class StepSettings:
    """Everything the step plan reads, resolved once, each value's source in `sources`.

    Attributes:
        batch_size, seq_len: the per-process micro-batch.
        gradient_accumulation_steps: micro-batches per optimizer step (the peak is one micro-batch's).
        precision, optimizer, gradient_checkpointing, max_grad_norm: as the Trainer trains.
        world_size, nodes, sharding: the job (sharding one of `setup.SHARDINGS`).
        rank: the process the plan is for, 0 to world_size - 1. Under DeepSpeed ZeRO-1/2 each rank's
            flat partition holds other parameters' values, so the gradients it keeps, and when it
            makes its gradient partition, differ by rank; DDP, FSDP2 (even, padded shards) and
            ZeRO-3 (`ceil(numel / world_size)` of every parameter) hold the same on every rank.
        bucket_cap_mb, gradient_as_bucket_view, find_unused_parameters: DDP's reducer
            (`find_unused_parameters` from the Trainer's arguments as the Trainer sets it).
        reshard_after_forward, fsdp_cpu_offload, replicate: FSDP2 (`replicate` > 1: HSDP, a 2-D mesh
            of `replicate` x `world_size // replicate`).
        torch_empty_cache_steps: the Trainer's `torch_empty_cache_steps`: `torch.cuda.empty_cache()`
            after the forward of each step whose `global_step` it divides (the allocator replay).
        zero: DeepSpeed's `zero_optimization` section, "auto" values filled and defaults added.
        sources: setting name -> where its value came from ("default", "training args", "deepspeed
            config", "fsdp config", "flag").
    """

    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    gradient_accumulation_steps: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw_torch"
    gradient_checkpointing: bool = False
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
    torch_empty_cache_steps: Optional[int] = None
    zero: Dict[str, Any] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
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

    def used(self) -> Tuple[Tuple[str, Any, str], ...]:
        """(name, value, source) for every setting, in field order; ZeRO's keys as `zero.KEY`."""
        rows = []
        for item in dataclasses.fields(self):
            if item.name in ("zero", "sources") or getattr(self, item.name) is None:
                continue
            rows.append((item.name, getattr(self, item.name), self.sources.get(item.name, _DEFAULT)))
        for key in sorted(self.zero):
            rows.append((f"zero.{key}", self.zero[key], self.sources.get(f"zero.{key}", _DEFAULT)))
        return tuple(rows)


def _offloaded(section: Any) -> bool:
    return isinstance(section, Mapping) and section.get("device", "none") not in ("none", None)


def read_json_file(path: str, what: str) -> Dict[str, Any]:
    """A JSON object from `path`; ValueError naming the file and what was expected otherwise."""
    if str(path).endswith((".bin", ".pt", ".pkl", ".pickle")):
        raise ValueError(f"{what} {path!r}: only JSON is read (a pickle such as training_args.bin is never loaded); "
                         "save it with TrainingArguments.to_json_string()")
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except OSError as error:
        raise ValueError(f"{what} {path!r}: cannot be read ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} {path!r}: not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path!r}: expected a JSON object, got {type(value).__name__}")
    return value


def _args_dict(training_args: Any) -> Dict[str, Any]:
    if training_args is None:
        return {}
    if isinstance(training_args, Mapping):
        return dict(training_args)
    if isinstance(training_args, (str, os.PathLike)):
        return read_json_file(os.fspath(training_args), "training args")
    to_dict = getattr(training_args, "to_dict", None)
    if to_dict is None:
        raise ValueError(f"training_args={type(training_args).__name__}: expected TrainingArguments, a dict or a JSON file")
    # The object itself: its fsdp_config and deepspeed already loaded by __post_init__.
    values = to_dict()
    for name in ("deepspeed", "fsdp_config", "fsdp"):
        if hasattr(training_args, name):
            values[name] = getattr(training_args, name)
    return values


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


def resolve_settings(training_args: Any = None, deepspeed: Any = None, fsdp_config: Any = None,
                     hidden_size: Optional[int] = None, **flags: Any) -> StepSettings:
    """Resolve the plan's settings once.

    Args:
        training_args: `TrainingArguments`, a dict of its values, or a JSON file of them
            (`to_json_string()`'s output, or a run's dump).
        deepspeed: a DeepSpeed config (dict or JSON file); None takes `training_args.deepspeed`.
        fsdp_config: an FSDP config (dict or JSON file); None takes `training_args.fsdp_config`.
        hidden_size: the model's, for the DeepSpeed config's "auto" bucket sizes.
        flags: settings given explicitly (a `StepSettings` field name each); None values are not given.

    Raises:
        ValueError: an unknown flag, a file that is not JSON, an "auto" the Trainer cannot fill.
    """
    names = {item.name for item in dataclasses.fields(StepSettings)} - {"sources", "zero"}
    unknown = sorted(set(flags) - names)
    if unknown:
        raise ValueError(f"unknown settings {unknown}: expected some of {sorted(names)}")
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}

    def put(name: str, value: Any, source: str) -> None:
        if value is not None:
            values[name] = value
            sources[name] = source

    args = _args_dict(training_args)
    arg = "training args"
    put("batch_size", args.get("per_device_train_batch_size"), arg)
    put("gradient_accumulation_steps", args.get("gradient_accumulation_steps"), arg)
    put("optimizer", str(args["optim"]).split(".")[-1].lower() if args.get("optim") is not None else None, arg)
    checkpointing = args.get("gradient_checkpointing", args.get("activation_checkpointing"))
    put("gradient_checkpointing", bool(checkpointing) if checkpointing is not None else None, arg)
    if "max_grad_norm" in args:
        put("max_grad_norm", float(args["max_grad_norm"] or 0.0), arg)
    put("bucket_cap_mb", args.get("ddp_bucket_cap_mb"), arg)
    put("torch_empty_cache_steps", args.get("torch_empty_cache_steps"), arg)
    if "ddp_find_unused_parameters" in args:
        # Trainer._build_accelerator_args: ddp_find_unused_parameters when set, otherwise True for a
        # model without gradient checkpointing (a PreTrainedModel with it: False).
        unused = args["ddp_find_unused_parameters"]
        put("find_unused_parameters", bool(unused) if unused is not None else not checkpointing,
            arg if unused is not None else "training args (Trainer: not gradient_checkpointing)")

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
    put("precision", _precision(args, deepspeed=bool(ds)), arg)

    zero: Dict[str, Any] = {}
    if ds:
        stage = (ds.get("zero_optimization") or {}).get("stage", 0)
        put("sharding", f"zero{stage}" if stage else "ddp", ds_source)
        for key, setting in (("train_micro_batch_size_per_gpu", "batch_size"), ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                             ("gradient_clipping", "max_grad_norm")):
            if key in ds and ds[key] != "auto":
                put(setting, ds[key], ds_source)
        if (ds.get("bf16") or {}).get("enabled") is True:
            put("precision", "deepspeed-bf16", ds_source)
        elif (ds.get("fp16") or {}).get("enabled") is True:
            put("precision", "deepspeed-fp16", ds_source)
        elif values.get("precision", "fp32") == "fp32":
            put("precision", "fp32", ds_source if ("bf16" in ds or "fp16" in ds) else sources.get("precision", _DEFAULT))
        zero = _fill_auto(ds, args, hidden_size, 1, sources)
    elif fsdp or _fsdp_on(args.get("fsdp")):
        fsdp = dict(fsdp or {})
        fsdp = {key[5:] if key.startswith("fsdp_") else key: value for key, value in fsdp.items()}
        legacy = args.get("fsdp")
        legacy = legacy.split() if isinstance(legacy, str) else (legacy if isinstance(legacy, list) else [])
        src = "fsdp config" if fsdp_config is not None else "training args (fsdp_config)"
        reshard = fsdp.get("reshard_after_forward")
        if reshard is None and legacy:
            reshard = "shard_grad_op" not in legacy
            src = "training args (fsdp)"
        reshard = True if reshard is None else (reshard if isinstance(reshard, bool) else str(reshard).lower() in ("true", "full_shard"))
        put("sharding", "fsdp-full-shard" if reshard else "fsdp-shard-grad-op", src)
        put("reshard_after_forward", reshard, src)
        offload = fsdp.get("cpu_offload", fsdp.get("offload_params"))
        if offload is None and "offload" in legacy:
            offload = True
        put("fsdp_cpu_offload", bool(offload) if offload is not None else None, src)
        if "hybrid_shard" in legacy or "hybrid_shard_zero2" in legacy:
            raise ValueError("fsdp hybrid_shard: give the replicate degree with replicate=N (HSDP mesh)")
        # TrainingArguments._process_fsdp_args: `version` (`fsdp_version`) picks the plugin's FSDP,
        # 2 when absent on transformers 5 (1 on 4.x); the plan traces FSDP2's fully_shard only.
        version = fsdp.get("version", 2)
        if str(version) != "2":
            raise ValueError(f"fsdp config version={version!r}: only FSDP2 (version 2, the Trainer's default) is planned")
        if "activation_checkpointing" in fsdp:
            # accelerate's FSDP2 wraps each layer in a non-reentrant checkpoint (`fsdp2_apply_ac`).
            put("gradient_checkpointing", str(fsdp["activation_checkpointing"]).lower() == "true", src)
    for name, value in flags.items():
        put(name, value, "flag")
    if values.get("sharding") == "fsdp-shard-grad-op" and sources.get("reshard_after_forward") != "flag":
        values["reshard_after_forward"] = False
        sources.setdefault("reshard_after_forward", sources["sharding"])
    if values.get("sharding") == "fsdp-full-shard" and sources.get("reshard_after_forward") not in ("flag",):
        values["reshard_after_forward"] = True
        sources.setdefault("reshard_after_forward", sources["sharding"])
    world = values.get("world_size", 1)
    if args and world > 1 and "sharding" not in values:
        # The Trainer under torchrun with neither DeepSpeed nor FSDP wraps the model in DDP
        # (accelerate's prepare_model, DistributedType.MULTI_*).
        put("sharding", "ddp", "training args (Trainer: several processes, no deepspeed or fsdp)")
    rank = values.get("rank", 0)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not a process of world_size={world}: expected 0 to {world - 1}")
    replicate = values.get("replicate", 1)
    if world % replicate:
        raise ValueError(f"replicate={replicate} does not divide world_size={world}")
    return StepSettings(zero=zero, sources=sources, **values)
