"""What-if: the optimizer state a model would need, before training, with no weight in memory.

The optimizers are the ones the Trainer would build for `TrainingArguments(optim=name)`: class and
keyword arguments come from `Trainer.get_optimizer_cls_and_kwargs`, and with an 8-bit bitsandbytes
optimizer the `nn.Embedding` weights are kept in 32-bit, as `Trainer.create_optimizer` does. Each
is built over meta-device stand-ins of the trainable parameters, so nothing is allocated and the
model is never touched, and its estimate comes from the same registry as the callback's
(`estimate_optimizer_state`, 8-bit thresholds included).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from trainer_memcb.estimate import StateEstimate, estimate_optimizer_state
from trainer_memcb.measure import dtype_name
from trainer_memcb.param_shapes import logical_numel, logical_shape
from trainer_memcb.units import format_bytes

__all__ = [
    "DEFAULT_OPTIMIZERS",
    "OPTIMIZER_ALIASES",
    "DTYPES",
    "ModelConfigError",
    "OptimizerWhatIf",
    "WhatIf",
    "optimizer_names",
    "optimizer_what_if",
    "resolve_optimizer_names",
    "resolve_dtype",
    "build_meta_model",
    "select_trainable",
    "what_if",
    "what_if_text",
]

# What the callback states at train begin: the lesson's three families.
DEFAULT_OPTIMIZERS = ("adamw_torch", "adafactor", "adamw_bnb_8bit")
# Short names people type, for the Trainer's `optim` values.
OPTIMIZER_ALIASES = {"adamw": "adamw_torch"}
# Parameter dtypes a what-if may train in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelConfigError(Exception):
    """A model that cannot be built from its config; the message says where it looked."""


@dataclass(frozen=True)
class OptimizerWhatIf:
    """One optimizer's estimate, or why there is none.

    Attributes:
        name: the Trainer's `optim` name.
        optimizer_class: `module.QualName` of the class the Trainer would build, when known.
        estimate: the estimate, or None.
        problem: why there is no estimate (a library not installed, no rule), or None.
    """

    name: str
    optimizer_class: Optional[str] = None
    estimate: Optional[StateEstimate] = None
    problem: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "optimizer_class": self.optimizer_class,
            "estimate": self.estimate.to_dict() if self.estimate is not None else None,
            "problem": self.problem,
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


def resolve_optimizer_names(names: Union[str, Iterable[str]]) -> Tuple[str, ...]:
    """`"adamw,adafactor"` or a list of names -> the Trainer's `optim` names, aliases resolved.

    Raises:
        ValueError: naming the unknown name and the allowed ones.
    """
    if isinstance(names, str):
        names = names.split(",")
    try:
        chosen = [name.strip() for name in names if name.strip()]
    except (TypeError, AttributeError):
        raise ValueError(f"optimizers={names!r}: expected optimizer names, e.g. ('adamw', 'adafactor')") from None
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
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        if type(config) in auto._model_mapping:
            return auto
    raise ModelConfigError(f"transformers has no model class for config type {type(config).__name__}")


def build_meta_model(model: str, dtype: Optional[torch.dtype] = None, architecture: Optional[str] = None) -> nn.Module:
    """Build the model of a config on the meta device: shapes and dtypes only, no weights read.

    Args:
        model: a local folder holding `config.json`, or a hub name (needs the hub or its cache).
        dtype: the parameters' dtype; None leaves the default (float32).
        architecture: the transformers class to build (`"DistilBertForSequenceClassification"`);
            None takes the config's `architectures`.

    Raises:
        ModelConfigError: no such folder, no config in it, or a config transformers cannot build.
        ValueError: an `architecture` transformers does not have.
    """
    from transformers import AutoConfig

    looks_like_path = os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1
    if os.path.isdir(model):
        config_file = os.path.join(model, "config.json")
        if not os.path.isfile(config_file):
            raise ModelConfigError(f"{model}: no config.json in this folder (looked for {config_file})")
    elif looks_like_path or os.path.exists(model):
        raise ModelConfigError(f"{model}: no such folder (give a folder holding config.json, or a hub name)")
    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as error:  # a corrupt config, an unknown model type, an unreachable hub
        raise ModelConfigError(f"{model}: could not read a model config ({error})") from None
    cls = _model_class(config, architecture)
    try:
        with torch.device("meta"):
            built = cls.from_config(config) if hasattr(cls, "_model_mapping") else cls(config)
    except Exception as error:
        raise ModelConfigError(f"{model}: could not build {getattr(cls, '__name__', cls)} from its config ({error})") from None
    if dtype is not None:
        built.to(dtype)  # on the meta device: a change of metadata
    return built


def select_trainable(model: nn.Module, pattern: Optional[str]) -> int:
    """Train only the parameters whose name matches `pattern` (`re.search`); None trains all.

    A LoRA-like setup in one option: `select_trainable(model, r"q_proj|v_proj")`.
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
        param.requires_grad_(matcher is None or matcher.search(name) is not None)
        count += param.requires_grad
    return count


class _WeightHolder:
    """Stands in for an `nn.Embedding` in bitsandbytes' module overrides, holding the stand-in weight."""

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight


def _meta_stand_ins(model: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """Meta-device twins of the trainable parameters (tied ones once), and the twins of
    `nn.Embedding` weights among them. Nothing is allocated and the model is left as it is.
    A ZeRO-3 partitioned parameter (an empty local tensor) gets its real shape, `ds_shape`."""
    twins: Dict[int, nn.Parameter] = {}
    for param in model.parameters():  # yields a tied tensor once
        if param.requires_grad:
            twins[id(param)] = nn.Parameter(torch.empty(logical_shape(param), dtype=param.dtype, device="meta"))
    embeddings = [
        twins[id(module.weight)]
        for module in model.modules()
        if isinstance(module, nn.Embedding) and id(module.weight) in twins
    ]
    return list(twins.values()), list(dict.fromkeys(embeddings))


def _keep_embeddings_32bit(optimizer: Any, embeddings: Sequence[nn.Parameter]) -> None:
    """`Trainer.create_optimizer` with an 8-bit bitsandbytes optimizer registers every
    `nn.Embedding` weight for 32-bit state in bitsandbytes' global manager. Here the overrides go
    to a manager of this optimizer's own, so the process-wide one is left untouched."""
    manager_class = type(optimizer.mng)
    manager = manager_class.__new__(manager_class)  # as GlobalOptimManager.get_instance does
    manager.initialize()
    for weight in embeddings:
        manager.register_module_override(_WeightHolder(weight), "weight", {"optim_bits": 32})
    optimizer.mng = manager


def trainer_optimizer_cls_and_kwargs(args: Any, model: Optional[nn.Module] = None) -> Tuple[Any, Dict[str, Any]]:
    """`Trainer.get_optimizer_cls_and_kwargs(args, model)`, without importing `transformers.trainer`.

    transformers 5 keeps what that static method does in `transformers.trainer_optimizer`: one
    handler per `optim` name, given the learning rate, Adam's betas and eps, and the parsed
    `optim_args`. Importing that module alone spares `transformers.trainer`'s own imports (datasets,
    the integrations; about 120 MiB and seconds of start-up). Where the module is missing (other
    transformers versions) the Trainer's method is called. A test checks both give the same.
    """
    try:
        from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS, OptimizerContext, _parse_optim_args
    except ImportError:
        from transformers import Trainer

        return Trainer.get_optimizer_cls_and_kwargs(args, model)
    handler = _OPTIMIZER_HANDLERS.get(args.optim)
    if handler is None:
        raise ValueError(f"Trainer cannot instantiate unsupported optimizer: {args.optim}")
    return handler(OptimizerContext(
        args=args,
        model=model,
        optimizer_kwargs={"lr": args.learning_rate},
        adam_kwargs={"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon},
        optim_args=_parse_optim_args(args.optim_args),
    ))


def optimizer_what_if(name: str, params: List[nn.Parameter], args: Any = None, model: Optional[nn.Module] = None,
                      embeddings: Sequence[nn.Parameter] = ()) -> OptimizerWhatIf:
    """One optimizer, as the Trainer builds it for `optim=name`, over `params` (meta-device
    stand-ins: a model's parameters, a shard's or a flat partition's), and its estimate.

    Args:
        name: the Trainer's `optim` name (aliases resolved).
        params: what the optimizer steps over; nothing is allocated when they are on the meta device.
        args: `TrainingArguments` for the hyperparameters; None uses the defaults.
        model: the model, for the few optimizers the Trainer builds around it; may be None.
        embeddings: stand-ins among `params` that are `nn.Embedding` weights (kept 32-bit by 8-bit
            bitsandbytes optimizers).
    """
    (name,) = resolve_optimizer_names([name])
    return _optimizer_what_if(name, args if args is not None else _default_training_args(), model, list(params),
                              list(embeddings))


def _optimizer_what_if(name: str, args: Any, model: Optional[nn.Module], params: List[nn.Parameter],
                       embeddings: List[nn.Parameter]) -> OptimizerWhatIf:
    from transformers.training_args import OptimizerNames

    trainer_args = copy.copy(args)
    trainer_args.optim = OptimizerNames(name)
    try:
        optimizer_class, kwargs = trainer_optimizer_cls_and_kwargs(trainer_args, model)
    except Exception as error:  # a library not installed, most often
        return OptimizerWhatIf(name, problem=str(error))
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or (
        {"params", "model", "optimizer_dict"} & set(kwargs)
    ):
        return OptimizerWhatIf(name, problem="the Trainer builds this one around the model itself; "
                                             "the what-if only builds plain optimizers")
    class_path = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    try:
        optimizer = optimizer_class(params, **kwargs)
        if "bitsandbytes" in class_path and kwargs.get("optim_bits") == 8:
            _keep_embeddings_32bit(optimizer, embeddings)
        estimate = estimate_optimizer_state(optimizer)
    except Exception as error:
        return OptimizerWhatIf(name, class_path, problem=f"building it failed ({error!r})")
    if estimate is None:
        return OptimizerWhatIf(name, class_path, problem=f"no estimate rule for {class_path}")
    return OptimizerWhatIf(name, class_path, estimate)


def _default_training_args() -> Any:
    from transformers import TrainingArguments

    # Only read for the optimizer's hyperparameters; nothing is written to output_dir.
    return TrainingArguments(output_dir="trainer_output", report_to=[])


def what_if(model: nn.Module, optimizers: Union[str, Iterable[str]] = DEFAULT_OPTIMIZERS,
            args: Any = None, model_name: Optional[str] = None) -> WhatIf:
    """Estimate each optimizer's state for the trainable parameters of `model`.

    Args:
        model: a model on any device, the meta device included; it is not changed.
        optimizers: the Trainer's `optim` names (`"adamw,adafactor,adamw_8bit"` or a list).
        args: `TrainingArguments` whose hyperparameters (`optim_args`, betas) the optimizers take;
            None uses the defaults.
        model_name: how to name the model in the result; by default its class.

    Raises:
        ValueError: an unknown optimizer name, or a model with no trainable parameter.

    Example:
        >>> import torch
        >>> from trainer_memcb.whatif import what_if
        >>> result = what_if(torch.nn.Linear(4, 2), ["adamw"])
        >>> result.trainable_params, result.optimizers[0].estimate.num_bytes
        (10, 88)
    """
    names = resolve_optimizer_names(optimizers)
    params, embeddings = _meta_stand_ins(model)
    if not params:
        raise ValueError(f"{model_name or type(model).__name__} has no trainable parameter")
    if args is None:
        args = _default_training_args()
    total = {id(param): logical_numel(param) for param in model.parameters()}
    result = WhatIf(
        model=model_name or type(model).__name__,
        total_params=sum(total.values()),
        trainable_params=sum(param.numel() for param in params),
        trainable_tensors=len(params),
        trainable_bytes=sum(param.numel() * param.element_size() for param in params),
        trainable_dtypes=tuple(sorted({dtype_name(param.dtype) for param in params})),
    )
    for name in names:
        result.optimizers.append(_optimizer_what_if(name, args, model, params, embeddings))
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
