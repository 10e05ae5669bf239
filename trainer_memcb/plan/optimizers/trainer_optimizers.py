"""Build the optimizer the Trainer would build for any `optim` name, over a meta-device stand-in.

This follows `Trainer.create_optimizer` step by step: the two weight-decay groups of the trainable
parameters, class and keyword arguments from `Trainer.get_optimizer_cls_and_kwargs`, the handlers'
own `params` (GaLore, APOLLO), `model` (LOMO) and `optimizer_dict` (layer-wise) taking their
place, optimizer factories called with the model, and `nn.Embedding` weights kept in 32-bit with
an 8-bit bitsandbytes optimizer. The model given is a stand-in (`trainer_memcb.plan.model.stand_ins`), so
hooks and state land on meta tensors and nothing is allocated.

When the Trainer cannot build the optimizer here, `OptimizerUnavailable` says why, and names the
package when one is missing.
"""

from __future__ import annotations

import copy
import dis
import importlib.util
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

__all__ = [
    "OptimizerUnavailable",
    "build_trainer_optimizer",
    "class_path",
    "keep_embeddings_32bit",
    "trainer_optimizer_cls_and_kwargs",
]

_TARGETS_HINT = ("optim_target_modules: one regular expression matched against whole module names (re.fullmatch), "
                 "e.g. '.*(attn|mlp).*', or a comma list of name parts, e.g. attn,mlp")


class OptimizerUnavailable(Exception):
    """The Trainer cannot build this optimizer here.

    Attributes:
        problem: why, in one line.
        optimizer_class: `module.QualName` of the class, when the Trainer got that far.
        missing_package: the import name of the package that is not installed, if that is why.
    """

    def __init__(self, problem: str, optimizer_class: Optional[str] = None,
                 missing_package: Optional[str] = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.optimizer_class = optimizer_class
        self.missing_package = missing_package


def class_path(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', type(cls).__qualname__)}"


def _not_installed(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return True


def _handler_imports(name: str) -> List[str]:
    """The top-level packages the Trainer's handler for `name` imports, read from its bytecode."""
    try:
        from transformers import trainer_optimizer
    except ImportError:  # a transformers without the handler table
        return []
    handler = getattr(trainer_optimizer, "_OPTIMIZER_HANDLERS", {}).get(name)
    if handler is None or not hasattr(handler, "__code__"):
        return []
    return list(dict.fromkeys(str(instruction.argval).split(".")[0]
                              for instruction in dis.get_instructions(handler)
                              if instruction.opname == "IMPORT_NAME"))


def _missing_package(name: str, error: BaseException) -> Optional[str]:
    """The package whose absence made the Trainer fail, if one did: an import error in the chain
    of causes, else a package the handler imports that is not installed."""
    seen = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        module_name = getattr(cause, "name", None) if isinstance(cause, ImportError) else None
        if module_name and _not_installed(module_name.split(".")[0]):
            return module_name.split(".")[0]
        cause = cause.__cause__ or cause.__context__
    for package in _handler_imports(name):
        if _not_installed(package):
            return package
    return None


# transformers' messages that name another optimizer than the one asked for: `_get_torchao_optimizer`
# (trainer_optimizer.py) builds torchao's AdamW4bit and AdamW8bit, and when torchao is missing says
# "torch 4-bit optimizers" for both. Name -> (words of the message, the words for this name).
_MISWORDED = {"adamw_torch_8bit": ("torch 4-bit optimizers", "torchao's 8-bit AdamW (adamw_torch_8bit)")}


def _worded_for(name: str, message: str) -> str:
    """The library's message, with the words that name another optimizer replaced (`_MISWORDED`)."""
    wrong, right = _MISWORDED.get(name, ("", ""))
    return message.replace(wrong, right) if wrong else message


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


# transformers 5's `Trainer.get_decay_parameter_names`: no weight decay for these names.
_NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def _decay_parameter_names(model: nn.Module) -> List[str]:
    """`Trainer.get_decay_parameter_names(model)`. It reads only the model, so the Trainer's own
    method is used whenever the Trainer is imported already (in a training process); the
    `estimate` command, which must start fast, does not import the Trainer for it and follows
    transformers 5's method instead (the split changes param groups, never state bytes)."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is not None:
        return list(trainer_module.Trainer.get_decay_parameter_names(None, model))
    from transformers.trainer_pt_utils import get_parameter_names

    return list(get_parameter_names(model, [nn.LayerNorm], _NO_DECAY_NAME_PATTERNS))


def _decay_groups(args: Any, model: nn.Module) -> List[dict]:
    """`Trainer.create_optimizer`'s two groups: weight decay, and none for biases and norms."""
    decay = set(_decay_parameter_names(model))
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    return [
        {"params": [param for name, param in named if name in decay], "weight_decay": args.weight_decay},
        {"params": [param for name, param in named if name not in decay], "weight_decay": 0.0},
    ]


class _WeightHolder:
    """Stands in for an `nn.Embedding` in bitsandbytes' module overrides, holding its weight."""

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight


def keep_embeddings_32bit(optimizer: Any, embeddings: Sequence[nn.Parameter]) -> None:
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


def build_trainer_optimizer(name: str, args: Any, model: nn.Module) -> Any:
    """The optimizer `Trainer(model, TrainingArguments(optim=name, ...))` would train with.

    Args:
        name: a `transformers.training_args.OptimizerNames` value.
        args: `TrainingArguments`; its `optim` is replaced by `name`, the rest (`optim_args`,
            `optim_target_modules`, betas, weight decay) is used as the Trainer uses it.
        model: a meta-device stand-in of the model (`meta_stand_in`): the layer-wise variants
            and LOMO hook into its parameters.

    Raises:
        OptimizerUnavailable: the Trainer cannot build it here (a package not installed, a
            device this machine lacks, a missing `optim_target_modules`), with the reason.

    Examples:
        >>> import torch
        >>> from transformers import TrainingArguments
        >>> from trainer_memcb.plan.model.stand_ins import meta_stand_in
        >>> from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer
        >>> model = meta_stand_in(torch.nn.Linear(4, 2))
        >>> optimizer = build_trainer_optimizer("adamw_torch", TrainingArguments("out", report_to=[]), model)
        >>> type(optimizer).__name__, [len(group["params"]) for group in optimizer.param_groups]
        ('AdamW', [1, 1])
    """
    from transformers.training_args import OptimizerNames

    trainer_args = copy.copy(args)
    trainer_args.optim = OptimizerNames(name)
    try:
        optimizer_class, kwargs = trainer_optimizer_cls_and_kwargs(trainer_args, model)
    except Exception as error:  # a library not installed, a device missing, a bad optim_args value
        missing = _missing_package(name, error)
        reason = _worded_for(name, _one_line(error))
        if missing is not None:
            raise OptimizerUnavailable(f"needs the {missing} package, not installed here ({reason})",
                                       missing_package=missing) from None
        problem = f"the Trainer cannot build it: {reason}"
        if "target_modules" in problem or "target modules" in problem:
            problem += f" ({_TARGETS_HINT})"
        raise OptimizerUnavailable(problem) from None

    try:
        from transformers.trainer_optimizer import is_optimizer_factory
    except ImportError:  # an older transformers: classes only
        def is_optimizer_factory(candidate: Any) -> bool:
            return False

    path = class_path(optimizer_class)
    try:
        if is_optimizer_factory(optimizer_class):
            return optimizer_class()(model, **kwargs)
        groups: Any = _decay_groups(trainer_args, model)
        for own in ("params", "model", "optimizer_dict"):  # in create_optimizer's order
            if own in kwargs:
                groups = kwargs.pop(own)
        optimizer = optimizer_class(groups, **kwargs)
        if "bitsandbytes" in str(optimizer_class) and kwargs.get("optim_bits") == 8:
            embeddings = [module.weight for module in model.modules() if isinstance(module, nn.Embedding)]
            keep_embeddings_32bit(optimizer, list(dict.fromkeys(embeddings)))
    except Exception as error:  # a constructor that needs CUDA, or refuses the Trainer's keyword arguments
        raise OptimizerUnavailable(f"its constructor failed: {type(error).__name__}: {_one_line(error)}",
                                   optimizer_class=path) from None
    return optimizer

