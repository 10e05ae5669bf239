"""Estimate what an optimizer's state should hold, from its parameters and hyperparameters alone.

An estimate never reads the state, so it exists before the first step. Every rule lives in one
registry (`trainer_memcb.rules` fills it with the built-in ones, each citing the source it follows);
`register_estimate_rule` adds a rule for your own optimizer class.
"""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from trainer_memcb.unwrap import inner_optimizers

__all__ = [
    "ParamInfo",
    "EstimateRule",
    "StateEstimate",
    "estimate_optimizer_state",
    "register_estimate_rule",
    "find_estimate_rule",
    "param_infos",
]


@dataclass(frozen=True)
class ParamInfo:
    """The facts about one parameter that a rule may use.

    Attributes:
        shape: the shape this process holds (a DTensor's local shard).
        dtype: the parameter's dtype.
        requires_grad: whether it trains.
        group_index: index of its param group in the optimizer.
        index_in_group: its index inside that group's `params`.
        param: the parameter itself, for rules keyed by identity (bitsandbytes' overrides).
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    group_index: int
    index_in_group: int
    param: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def num_bytes(self) -> int:
        return self.numel * self.element_size


# A per-parameter rule: (parameter, its group's hyperparameters, the optimizer) -> bytes by key.
PerParamRule = Callable[[ParamInfo, Mapping[str, Any], Any], Mapping[str, int]]
# Bytes held once for the whole optimizer (bitsandbytes' shared quantization maps), by key.
SharedRule = Callable[[Any, Sequence[ParamInfo]], Mapping[str, int]]


@dataclass(frozen=True)
class EstimateRule:
    """How one optimizer family's state grows with its parameters.

    Attributes:
        per_param: bytes by state key for one parameter.
        shared: bytes held once per optimizer, by state key (optional).
        source: where the rule comes from (the optimizer's own source file and function).
        includes_frozen: the optimizer makes state for parameters that do not train (Adagrad
            fills its state at construction for every parameter in its groups).
    """

    per_param: PerParamRule
    shared: Optional[SharedRule] = None
    source: str = ""
    includes_frozen: bool = False


@dataclass(frozen=True)
class StateEstimate:
    """What an optimizer's state should hold once every trainable parameter has had a gradient.

    Attributes:
        num_bytes: the estimated bytes.
        num_params: trainable parameter values covered (each tensor once, tied weights once).
        num_param_tensors: trainable parameter tensors covered.
        bytes_by_key: estimated bytes per state key.
        optimizer_class: the class the rule was found for, `module.QualName`.
        source: where the rule comes from.
    """

    num_bytes: int
    num_params: int
    num_param_tensors: int
    bytes_by_key: Dict[str, int]
    optimizer_class: str
    source: str

    def to_dict(self) -> Dict[str, Any]:
        return {
            "num_bytes": self.num_bytes,
            "num_params": self.num_params,
            "num_param_tensors": self.num_param_tensors,
            "bytes_by_key": dict(self.bytes_by_key),
            "optimizer_class": self.optimizer_class,
            "source": self.source,
        }


_RULES: Dict[type, EstimateRule] = {}
# Rules for optional libraries, by (module, class name): resolved only once the library has been
# imported by the user, so that estimating never imports bitsandbytes or torchao itself.
_PENDING: Dict[Tuple[str, str], EstimateRule] = {}
_BUILTINS_LOADED = False


def register_estimate_rule(
    optimizer_class: Any,
    per_param: PerParamRule,
    *,
    shared: Optional[SharedRule] = None,
    source: str = "",
    includes_frozen: bool = False,
) -> None:
    """Register how the state of `optimizer_class` (and its subclasses) grows.

    Args:
        optimizer_class: the optimizer class, or a `"module:ClassName"` string for a class whose
            library should only be resolved once the user imports it.
        per_param: `(param_info, group, optimizer) -> {state_key: bytes}` for one parameter.
        shared: `(optimizer, param_infos) -> {state_key: bytes}` held once per optimizer.
        source: where the numbers come from.
        includes_frozen: state is made for parameters that do not train too.

    Example:
        >>> import torch
        >>> from trainer_memcb import register_estimate_rule, estimate_optimizer_state
        >>> class MomentumOnly(torch.optim.SGD):
        ...     pass
        >>> register_estimate_rule(
        ...     MomentumOnly, lambda p, group, opt: {"momentum_buffer": p.num_bytes})
        >>> estimate_optimizer_state(MomentumOnly(torch.nn.Linear(4, 2).parameters(), lr=0.1,
        ...                                       momentum=0.9)).num_bytes
        40
    """
    rule = EstimateRule(per_param=per_param, shared=shared, source=source, includes_frozen=includes_frozen)
    if isinstance(optimizer_class, str):
        module, _, name = optimizer_class.partition(":")
        if not module or not name:
            raise ValueError(
                f"optimizer_class={optimizer_class!r}: a string must read 'module:ClassName'"
            )
        _PENDING[(module, name)] = rule
        return
    if not isinstance(optimizer_class, type):
        raise ValueError(f"optimizer_class={optimizer_class!r}: expected a class or 'module:ClassName'")
    _RULES[optimizer_class] = rule


def _load_builtin_rules() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        importlib.import_module("trainer_memcb.rules")


def _resolve_pending() -> None:
    for (module_name, class_name), rule in list(_PENDING.items()):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        cls = getattr(module, class_name, None)
        del _PENDING[(module_name, class_name)]
        if isinstance(cls, type):
            _RULES.setdefault(cls, rule)


def find_estimate_rule(optimizer_class: type) -> Optional[EstimateRule]:
    """The rule for `optimizer_class`: its own, or the nearest registered base class's."""
    _load_builtin_rules()
    _resolve_pending()
    for cls in optimizer_class.__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule
    return None


def _local_shape(param: torch.Tensor) -> Tuple[int, ...]:
    """A DTensor's state is made like its local shard: that is what this process holds."""
    local = getattr(param, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return tuple(local.shape)
    return tuple(param.shape)


def param_infos(optimizer: Any) -> List[ParamInfo]:
    """Every parameter in the optimizer's param groups, each tensor once (tied weights once)."""
    infos: List[ParamInfo] = []
    seen = set()
    for group_index, group in enumerate(getattr(optimizer, "param_groups", [])):
        for index_in_group, param in enumerate(group.get("params", [])):
            if not isinstance(param, torch.Tensor) or id(param) in seen:
                continue
            seen.add(id(param))
            infos.append(
                ParamInfo(
                    shape=_local_shape(param),
                    dtype=param.dtype,
                    requires_grad=param.requires_grad,
                    group_index=group_index,
                    index_in_group=index_in_group,
                    param=param,
                )
            )
    return infos


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def estimate_optimizer_state(optimizer: Any) -> Optional[StateEstimate]:
    """Estimate the bytes an optimizer's state will hold once every trainable parameter has
    had a gradient, or None when no rule knows the optimizer's class.

    Computed from the param groups (shapes, dtypes, `requires_grad`) and hyperparameters, never
    from the state. Unwraps the same wrappers as `measure_optimizer_state`.

    Args:
        optimizer: a `torch.optim.Optimizer`, or a wrapper around one.

    Example:
        >>> import torch
        >>> from trainer_memcb import estimate_optimizer_state
        >>> layer = torch.nn.Linear(4, 2)
        >>> estimate = estimate_optimizer_state(torch.optim.AdamW(layer.parameters()))
        >>> estimate.num_params, estimate.num_bytes
        (10, 88)
    """
    # Imported here: the ZeRO module registers rules through this one. ZeRO-3 lends its flat
    # partitions to the inner optimizer only during the step; outside it a stand-in shows them.
    from trainer_memcb.rules.deepspeed_zero import with_zero3_partitions

    optimizer = with_zero3_partitions(optimizer)
    bytes_by_key: Dict[str, int] = defaultdict(int)
    counted = set()
    num_params = 0
    num_param_tensors = 0
    classes: List[str] = []
    sources: List[str] = []
    for inner in inner_optimizers(optimizer):
        rule = find_estimate_rule(type(inner))
        if rule is None:
            return None
        infos = [info for info in param_infos(inner) if id(info.param) not in counted]
        counted.update(id(info.param) for info in infos)
        groups = inner.param_groups
        for info in infos:
            if info.requires_grad:
                num_params += info.numel
                num_param_tensors += 1
            if not (info.requires_grad or rule.includes_frozen):
                continue
            for key, num_bytes in rule.per_param(info, groups[info.group_index], inner).items():
                bytes_by_key[key] += int(num_bytes)
        if rule.shared is not None:
            for key, num_bytes in rule.shared(inner, infos).items():
                bytes_by_key[key] += int(num_bytes)
        if _class_path(type(inner)) not in classes:
            classes.append(_class_path(type(inner)))
            sources.append(rule.source)
    if not classes:
        return None
    return StateEstimate(
        num_bytes=sum(bytes_by_key.values()),
        num_params=num_params,
        num_param_tensors=num_param_tensors,
        bytes_by_key=dict(bytes_by_key),
        optimizer_class=", ".join(classes),
        source="; ".join(dict.fromkeys(sources)),
    )
