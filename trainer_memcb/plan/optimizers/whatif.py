"""What-if: the optimizer state a model would need, before training, with no weight in memory.

The optimizers are the ones the Trainer would build for `TrainingArguments(optim=name)`, for any
`OptimizerNames` value, built as `Trainer.create_optimizer` builds them
(`trainer_memcb.plan.optimizers.trainer_optimizers`) over a meta-device stand-in of the model
(`trainer_memcb.plan.model.stand_ins`), so nothing is allocated and the model is never touched. Each estimate
comes from the same registry as the callback's (`estimate_optimizer_state`).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from trainer_memcb.state.estimate import StateEstimate, estimate_optimizer_state
from trainer_memcb.state.measure import dtype_name
from trainer_memcb.plan.settings.optim_options import parse_optim_args, parse_optim_target_modules
from trainer_memcb.plan.model.param_shapes import logical_numel
from trainer_memcb.plan.model.stand_ins import meta_stand_in
from trainer_memcb.plan.model.model_folder import looks_like_path, no_such_folder
from trainer_memcb.plan.optimizers.trainer_optimizers import (
    OptimizerUnavailable,
    build_trainer_optimizer,
    class_path,
    keep_embeddings_32bit,
    trainer_optimizer_cls_and_kwargs,
)
from trainer_memcb.utils.compiled import uncompiled
from trainer_memcb.utils.safe_io import UnsafeFileError, read_json
from trainer_memcb.utils.units import MiB, format_bytes
from trainer_memcb.state.unwrap import inner_optimizers
from trainer_memcb.plan.model.config_error import ModelConfigError

__all__ = [
    "DEFAULT_OPTIMIZERS",
    "OPTIMIZER_ALIASES",
    "DTYPES",
    "ModelConfigError",
    "OptimizerWhatIf",
    "WhatIf",
    "model_optimizer_what_if",
    "optimizer_names",
    "optimizer_what_if",
    "resolve_optimizer_names",
    "resolve_dtype",
    "build_meta_model",
    "select_trainable",
    "training_args_with",
    "what_if",
    "what_if_text",
]

# What the callback states at train begin: the lesson's three families.
DEFAULT_OPTIMIZERS = ("adamw_torch", "adafactor", "adamw_bnb_8bit")
# Short names people type, for the Trainer's `optim` values.
OPTIMIZER_ALIASES = {"adamw": "adamw_torch"}
# Parameter dtypes a what-if may train in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A model config is a few KiB.
MAX_CONFIG_BYTES = 16 * MiB
# What to do when a hub name cannot be read (offline, a gated or a mistyped model): only its
# config.json is needed, and a folder holding it is read without the hub.
_GIVE_A_FOLDER = ("without the hub, give a folder holding the model's config.json instead (its config.json alone "
                  "is read; examples/models/ holds some)")
# `auto_map` names Python files beside the config that transformers would import: never done here.
_ASKS_FOR_CODE = "{model}: its config.json asks to run code from the model's files (auto_map); that code is never run"


@dataclass(frozen=True)
class OptimizerWhatIf:
    """One optimizer's estimate, or why there is none.

    Attributes:
        name: the Trainer's `optim` name.
        optimizer_class: `module.QualName` of the class the Trainer would build, when known.
        estimate: the estimate, or None.
        problem: why there is no estimate (a library not installed, no rule), or None.
        missing_package: the package to install for this name, when that is the problem.
    """

    name: str
    optimizer_class: Optional[str] = None
    estimate: Optional[StateEstimate] = None
    problem: Optional[str] = None
    missing_package: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "optimizer_class": self.optimizer_class,
            "estimate": self.estimate.to_dict() if self.estimate is not None else None,
            "problem": self.problem,
            "missing_package": self.missing_package,
        }


@dataclass(frozen=True)
class WhatIf:
    """The what-if for one model.

    Attributes:
        model: what the model is (a folder, a hub name or a class name).
        total_params: parameter values, tied weights once.
        trainable_params: the values that train.
        trainable_tensors: the tensors that train.
        trainable_bytes: bytes of the trainable parameters themselves.
        trainable_dtypes: dtype names of the trainable parameters.
        optimizers: one entry per optimizer asked for, in that order.
    """

    model: str
    total_params: int
    trainable_params: int
    trainable_tensors: int
    trainable_bytes: int
    trainable_dtypes: Tuple[str, ...]
    optimizers: List[OptimizerWhatIf] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "model": self.model,
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "trainable_tensors": self.trainable_tensors,
            "trainable_bytes": self.trainable_bytes,
            "trainable_dtypes": list(self.trainable_dtypes),
            "optimizers": [entry.to_dict() for entry in self.optimizers],
        }


def optimizer_names() -> List[str]:
    """Every name `resolve_optimizer_names` accepts: the Trainer's `optim` values and the aliases."""
    from transformers.training_args import OptimizerNames

    return sorted({str(name.value) for name in OptimizerNames} | set(OPTIMIZER_ALIASES))


def resolve_optimizer_names(names: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    """`"adamw,adafactor"` or a list of names -> the Trainer's `optim` names, aliases resolved.

    Raises:
        ValueError: naming the unknown name and the allowed ones.
    """
    if isinstance(names, str):
        names = names.split(",")
    # A list or a tuple only, as every list-or-string argument (`trainer_memcb.utils.name_lists`):
    # a dict's keys or a set's arbitrary order would pass unnoticed.
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"optimizers={names!r}: expected optimizer names, a list or tuple or one comma-separated "
                         "string, e.g. ('adamw', 'adafactor')")
    chosen = [name.strip() for name in names if name.strip()]
    if not chosen:
        raise ValueError("no optimizer named; give one or more of the Trainer's optim names, e.g. adamw,adafactor")
    allowed = optimizer_names()
    for name in chosen:
        if name not in allowed:
            raise ValueError(f"optimizer {name!r} is not one of: {', '.join(allowed)}")
    return tuple(dict.fromkeys(OPTIMIZER_ALIASES.get(name, name) for name in chosen))


def resolve_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """`"bfloat16"` -> `torch.bfloat16`; None keeps the model's own dtypes."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of: {', '.join(DTYPES)}")
    return DTYPES[name]


# Counts and sizes of a config.json that build the model: a layer count or a width below 1 builds a
# model with no layers (`range(-2)` is empty) or fails inside torch; a table of negative rows is no
# table. Names as the configs spell them (GPT-2's n_layer, DistilBERT's n_layers, T5's d_model).
_AT_LEAST_ONE = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "encoder_layers",
                 "decoder_layers", "hidden_size", "num_attention_heads", "n_head", "n_heads", "n_embd", "dim",
                 "d_model")
# Others where 0 may mean "none" (no experts, a head_dim taken from hidden_size), never a negative.
_AT_LEAST_ZERO = ("vocab_size", "max_position_embeddings", "n_positions", "intermediate_size", "num_key_value_heads",
                  "hidden_dim", "d_ff", "d_kv", "n_inner", "head_dim", "num_local_experts", "num_experts",
                  "num_experts_per_tok", "image_size", "patch_size", "num_channels")


def _check_sizes(document: Any, where: str = "") -> None:
    """Refuse a count or size of `_AT_LEAST_ONE` below 1, or of `_AT_LEAST_ZERO` below 0, in a
    config's values (nested configs too: `text_config.num_hidden_layers`).

    Raises:
        ModelConfigError: naming the key, its value and what is allowed.
    """
    if not isinstance(document, dict):
        return
    for key, value in document.items():
        if isinstance(value, dict):
            _check_sizes(value, f"{where}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            least = 1 if key in _AT_LEAST_ONE else (0 if key in _AT_LEAST_ZERO else None)
            if least is not None and value < least:
                raise ModelConfigError(f"its config has {where}{key}={value}: expected a whole number of at least "
                                       f"{least}" + (" (a model of no layers, heads or width is no model)" if least else
                                                     " (a count or a size is never negative)"))


def _close_classes(name: Any, transformers: Any) -> str:
    """`"; close: LlamaForCausalLM, ..."` from the model classes transformers exports (their names
    only, nothing imported), or `""` when none is close."""
    import difflib

    if not isinstance(name, str):
        return ""
    classes = [item for item in dir(transformers) if item[:1].isupper() and ("For" in item or item.endswith("Model"))]
    close = difflib.get_close_matches(name, classes, n=3)
    return f" (close: {', '.join(close)})" if close else ""


def _model_class(config: Any, architecture: Optional[str] = None) -> Any:
    """`architecture`, else the class named in `config.architectures`, else a causal LM, else
    the bare model."""
    import transformers

    if architecture is not None:
        cls = getattr(transformers, architecture, None)
        if not (isinstance(cls, type) and hasattr(cls, "config_class")):
            raise ValueError(f"architecture {architecture!r} is not a transformers model class "
                             "(e.g. LlamaForCausalLM, DistilBertForSequenceClassification)")
        return cls
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if not isinstance(cls, type):
            # A misspelled or unknown class (code of the model's own is never run): refused, rather
            # than another class planned in its place.
            raise ModelConfigError(f"the config's architectures names {name!r}, which transformers "
                                   f"{transformers.__version__} has no class of{_close_classes(name, transformers)}: "
                                   "correct it, or give --architecture CLASS")
        if not issubclass(cls, transformers.PreTrainedModel):
            raise ModelConfigError(f"the config's architectures names {name}, which is not a model class (a "
                                   "subclass of transformers.PreTrainedModel): give --architecture CLASS, e.g. "
                                   "LlamaForCausalLM")
        return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        if type(config) in auto._model_mapping:
            return auto
    raise ModelConfigError(f"transformers has no model class for config type {type(config).__name__}")


def build_meta_model(model: str, dtype: Optional[torch.dtype] = None, architecture: Optional[str] = None) -> nn.Module:
    """Build the model of a config on the meta device: shapes and dtypes only, no weights read.

    Args:
        model: a local folder holding `config.json` (or the path of that file), or a hub name
            (needs the hub or its cache).
        dtype: the parameters' dtype; None leaves the default (float32).
        architecture: the transformers class to build (`"DistilBertForSequenceClassification"`);
            None takes the config's `architectures`.

    Raises:
        ModelConfigError: no such folder, no config in it, a config that asks to run its own code
            (`auto_map`: code from a config is never run), or one transformers cannot build.
        ValueError: an `architecture` transformers does not have.
    """
    from transformers import AutoConfig

    config_file: Optional[str] = None
    if os.path.isfile(model):  # a config file's own path (`.../config.json`): read as its folder would be
        config_file = model
    elif os.path.isdir(model):
        config_file = os.path.join(model, "config.json")
        if not os.path.lexists(config_file):
            raise ModelConfigError(f"{model}: no config.json in this folder (looked for {config_file})")
    elif looks_like_path(model) or os.path.exists(model):
        raise ModelConfigError(no_such_folder(model))
    if config_file is not None:
        # Read here first, within bounds (no pipe, no device, no huge or deep file), to refuse a
        # config that asks for code before transformers sees it.
        try:
            document = read_json(config_file, MAX_CONFIG_BYTES)
        except UnsafeFileError as error:
            raise ModelConfigError(f"{model}: could not read a model config ({error})") from None
        if isinstance(document, dict) and "auto_map" in document:
            raise ModelConfigError(_ASKS_FOR_CODE.format(model=model))
    try:
        config = AutoConfig.from_pretrained(config_file or model, trust_remote_code=False)
    except Exception as error:  # a corrupt config, an unknown model type, an unreachable hub, remote code
        hint = "" if config_file is not None else f"; {_GIVE_A_FOLDER}"
        raise ModelConfigError(f"{model}: could not read a model config ({error}){hint}") from None
    if getattr(config, "auto_map", None):  # a hub config, seen only now
        raise ModelConfigError(_ASKS_FOR_CODE.format(model=model))
    try:
        _check_sizes(config.to_dict())
    except ModelConfigError as error:
        raise ModelConfigError(f"{model}: {error}") from None
    try:
        cls = _model_class(config, architecture)
    except ModelConfigError as error:
        raise ModelConfigError(f"{model}: {error}") from None
    try:
        with torch.device("meta"):
            built = cls.from_config(config, trust_remote_code=False) if hasattr(cls, "_model_mapping") else cls(config)
    except Exception as error:
        raise ModelConfigError(f"{model}: could not build {getattr(cls, '__name__', cls)} from its config ({error})") from None
    if dtype is not None:
        built.to(dtype)  # on the meta device: a change of metadata
    return built


def select_trainable(model: nn.Module, pattern: Optional[str], *, narrow: bool = False) -> int:
    """Train only the parameters whose name matches `pattern` (`re.search`); None trains all.

    Training a subset by name in one option: `select_trainable(model, r"q_proj|v_proj")`. With
    `narrow=True` only parameters that already train may stay trainable (a PEFT model's adapters:
    `select_trainable(peft_model, "lora_A", narrow=True)`).
    Returns the number of parameter tensors that train.

    Raises:
        ValueError: an invalid regular expression.
    """
    try:
        matcher = re.compile(pattern) if pattern is not None else None
    except re.error as error:
        raise ValueError(f"trainable pattern {pattern!r} is not a regular expression ({error})") from None
    count = 0
    for name, param in model.named_parameters():
        chosen = matcher is None or matcher.search(name) is not None
        param.requires_grad_(chosen and (param.requires_grad or not narrow))
        count += param.requires_grad
    return count


def model_optimizer_what_if(name: str, args: Any, stand_in: nn.Module) -> OptimizerWhatIf:
    """One optimizer as the Trainer builds it for `optim=name` over a model's stand-in
    (`trainer_memcb.plan.model.stand_ins.meta_stand_in`): weight-decay groups, GaLore's and APOLLO's
    target groups, LOMO's model, the layer-wise variants' hooks. The what-if and the
    model-states plan both call this, so that they agree to the byte.

    Args:
        name: the Trainer's `optim` name (aliases resolved).
        args: `TrainingArguments` (`training_args_with`).
        stand_in: the model's meta-device stand-in; hooks and state land on it.
    """
    try:
        optimizer = build_trainer_optimizer(name, args, stand_in)
    except OptimizerUnavailable as unavailable:
        return OptimizerWhatIf(name, unavailable.optimizer_class, problem=unavailable.problem,
                               missing_package=unavailable.missing_package)
    path = class_path(type(optimizer))
    return _estimated(name, optimizer, path)


def training_args_with(args: Any = None, *, optim_args: Union[None, str, Mapping[str, Any]] = None,
                       optim_target_modules: Union[None, str, Sequence[str]] = None) -> Any:
    """A copy of `args` (default `TrainingArguments`) with `optim_args` and `optim_target_modules`
    replaced when given, each checked first.

    Raises:
        ValueError: a malformed `optim_args` or `optim_target_modules`, naming it.
    """
    overrides: Dict[str, Any] = {}
    if optim_args is not None:
        overrides["optim_args"] = parse_optim_args(optim_args)
    if optim_target_modules is not None:
        overrides["optim_target_modules"] = parse_optim_target_modules(optim_target_modules)
    args = copy.copy(args if args is not None else _default_training_args())
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def optimizer_what_if(name: str, params: List[nn.Parameter], args: Any = None, model: Optional[nn.Module] = None,
                      embeddings: Sequence[nn.Parameter] = ()) -> OptimizerWhatIf:
    """One optimizer, as the Trainer builds it for `optim=name`, over `params` (meta-device
    stand-ins: a shard's or a flat partition's, for the model-states plan), and its estimate.

    Args:
        name: the Trainer's `optim` name (aliases resolved).
        params: what the optimizer steps over; nothing is allocated when they are on the meta device.
        args: `TrainingArguments` for the hyperparameters; None uses the defaults.
        model: the model, for the few optimizers the Trainer builds around it; may be None.
        embeddings: stand-ins among `params` that are `nn.Embedding` weights (kept 32-bit by 8-bit
            bitsandbytes optimizers).
    """
    from transformers.training_args import OptimizerNames

    (name,) = resolve_optimizer_names([name])
    trainer_args = copy.copy(args if args is not None else _default_training_args())
    trainer_args.optim = OptimizerNames(name)
    try:
        optimizer_class, kwargs = trainer_optimizer_cls_and_kwargs(trainer_args, model)
    except Exception as error:  # a library not installed, most often
        return OptimizerWhatIf(name, problem=str(error))
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or (
        {"params", "model", "optimizer_dict"} & set(kwargs)
    ):
        return OptimizerWhatIf(name, problem="the Trainer builds this one around the model itself; "
                                             "the plan only builds plain optimizers")
    path = class_path(optimizer_class)
    try:
        optimizer = optimizer_class(list(params), **kwargs)
        if "bitsandbytes" in path and kwargs.get("optim_bits") == 8:
            keep_embeddings_32bit(optimizer, list(embeddings))
    except Exception as error:
        return OptimizerWhatIf(name, path, problem=f"building it failed ({error!r})")
    return _estimated(name, optimizer, path)


def _estimated(name: str, optimizer: Any, path: str) -> OptimizerWhatIf:
    """The what-if row of a built optimizer: its estimate, or why there is none."""
    try:
        estimate = estimate_optimizer_state(optimizer)
    except Exception as error:  # a rule that does not know this configuration
        return OptimizerWhatIf(name, path, problem=f"the estimate rule failed ({error!r})")
    if estimate is None:
        classes = ", ".join(dict.fromkeys(class_path(type(inner)) for inner in inner_optimizers(optimizer)))
        return OptimizerWhatIf(name, classes or path, problem=f"no estimate rule for {classes or path}")
    return OptimizerWhatIf(name, estimate.optimizer_class, estimate)


def _default_training_args() -> Any:
    from transformers import TrainingArguments

    # Only read for the optimizer's hyperparameters; nothing is written to output_dir.
    return TrainingArguments(output_dir="trainer_output", report_to=[])


def what_if(model: nn.Module, optimizers: Union[str, Iterable[str]] = DEFAULT_OPTIMIZERS,
            args: Any = None, model_name: Optional[str] = None, *,
            optim_args: Union[None, str, Mapping[str, Any]] = None,
            optim_target_modules: Union[None, str, Sequence[str]] = None) -> WhatIf:
    """Estimate each optimizer's state for the trainable parameters of `model`.

    Every `OptimizerNames` value is accepted. Each optimizer is built as the Trainer builds it,
    over a meta-device stand-in of the model; a name the Trainer cannot build here (a library not
    installed, XLA, NPU, a constructor that needs CUDA) gets an entry saying why.

    Args:
        model: a model on any device, the meta device included, or `torch.compile(model)` (the
            model it compiles is read); it is not changed.
        optimizers: the Trainer's `optim` names (`"adamw,adafactor,adamw_8bit"` or a list).
        args: `TrainingArguments` whose hyperparameters (`optim_args`, `optim_target_modules`,
            betas, weight decay) the optimizers take; None uses the defaults.
        model_name: how to name the model in the result; by default its class.
        optim_args: replaces `args.optim_args`: `"rank=64,update_proj_gap=200"` or a dict.
        optim_target_modules: replaces `args.optim_target_modules`: one regular expression
            matched against whole module names (`".*(attn|mlp).*"`), `"all-linear"`, or a list /
            comma list of name parts (`"attn,mlp"`), as `TrainingArguments` takes it.

    Raises:
        ValueError: an unknown optimizer name, a malformed `optim_args` or
            `optim_target_modules`, or a model with no trainable parameter.

    Examples:
        >>> import torch
        >>> from trainer_memcb.plan.optimizers.whatif import what_if
        >>> result = what_if(torch.nn.Linear(4, 2), ["adamw"])
        >>> result.trainable_params, result.optimizers[0].estimate.num_bytes
        (10, 88)
    """
    names = resolve_optimizer_names(optimizers)
    args = training_args_with(args, optim_args=optim_args, optim_target_modules=optim_target_modules)
    model = uncompiled(model)  # `torch.compile(model)`: its parameters are the model's own
    stand_in = meta_stand_in(model)
    params = [param for param in stand_in.parameters() if param.requires_grad]  # tied ones once
    if not params:
        raise ValueError(f"{model_name or type(model).__name__} has no trainable parameter")
    result = WhatIf(
        model=model_name or type(model).__name__,
        total_params=sum(logical_numel(param) for param in model.parameters()),  # tied ones once
        trainable_params=sum(param.numel() for param in params),
        trainable_tensors=len(params),
        trainable_bytes=sum(param.numel() * param.element_size() for param in params),
        trainable_dtypes=tuple(sorted({dtype_name(param.dtype) for param in params})),
    )
    for name in names:
        result.optimizers.append(model_optimizer_what_if(name, args, stand_in))
    return result


def what_if_text(result: WhatIf) -> str:
    """One line per optimizer, for the logger, in MiB/GiB."""
    lines = [
        f"Optimizer state what-if for {result.trainable_params:,} trainable parameters "
        f"({', '.join(result.trainable_dtypes)}) of {result.model}:"
    ]
    for entry in result.optimizers:
        if entry.estimate is not None:
            lines.append(f"  {entry.name:<20} {format_bytes(entry.estimate.num_bytes):>12}"
                         f"  ({entry.estimate.num_bytes:,} bytes)")
        else:
            lines.append(f"  {entry.name:<20} {'-':>12}  ({entry.problem})")
    return "\n".join(lines)
