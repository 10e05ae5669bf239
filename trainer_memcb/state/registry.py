"""The registry of estimate rules: per optimizer class, how its state grows and where it lives.

The bottom of the `state` layer: `measure`, `estimate` and the rules in `trainer_memcb.state.rules`
import this module, and it imports none of them. The built-in rules register themselves when the
`state` package is imported (its `__init__` imports `rules`), so every lookup sees them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "ParamInfo",
    "EstimateRule",
    "PerParamRule",
    "SharedRule",
    "StateLocation",
    "OptimizerView",
    "register_estimate_rule",
    "find_estimate_rule",
    "find_state_location",
    "register_optimizer_view",
    "optimizer_views",
    "state_of",
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
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return self.numel * self.element_size


# A per-parameter rule: (parameter, its group's hyperparameters, the optimizer) -> bytes by key.
PerParamRule = Callable[[ParamInfo, Mapping, Any], Mapping[str, int]]
# Bytes held once for the whole optimizer (bitsandbytes' shared quantization maps), by key.
SharedRule = Callable[[Any, Sequence[ParamInfo]], Mapping[str, int]]
# Where an optimizer keeps its state: optimizer -> one entry per parameter, each a mapping of state
# key -> value (or an object whose attributes hold the tensors). The default reads
# `optimizer.state.values()`.
StateLocation = Callable[[Any], Iterable[Any]]
# A view of an optimizer for estimating: optimizer -> the optimizer, or a stand-in showing what its
# inner optimizer steps over (DeepSpeed ZeRO-3 lends its partitions only during the step).
OptimizerView = Callable[[Any], Any]


@dataclass(frozen=True)
class EstimateRule:
    """How one optimizer family's state grows with its parameters, and where that state lives.

    Attributes:
        per_param: bytes by state key for one parameter.
        shared: bytes held once per optimizer, by state key (optional).
        source: where the rule comes from (the optimizer's own source file and function).
        includes_frozen: the optimizer makes state for parameters that do not train (Adagrad
            fills its state at construction for every parameter in its groups).
        state_location: where the state lives, when not in `optimizer.state` (None).
    """

    per_param: PerParamRule
    shared: Optional[SharedRule] = None
    source: str = ""
    includes_frozen: bool = False
    state_location: Optional[StateLocation] = None


_RULES: Dict[type, EstimateRule] = {}
# Rules for optional libraries, by (module, class name): resolved only once the library has been
# imported by the user, so that estimating never imports bitsandbytes or torchao itself.
_PENDING: Dict[Tuple[str, str], EstimateRule] = {}
# Per class, its state location (None: `optimizer.state`), as found at its first lookup. Measuring
# looks it up at every logged step: one dict lookup then, rather than a walk of the class's MRO.
# Emptied by every registration.
_LOCATIONS: Dict[type, Optional[StateLocation]] = {}
_VIEWS: List[OptimizerView] = []


def register_estimate_rule(
    optimizer_class: Any,
    per_param: PerParamRule,
    *,
    shared: Optional[SharedRule] = None,
    source: str = "",
    includes_frozen: bool = False,
    state_location: Optional[StateLocation] = None,
) -> None:
    """Register how the state of `optimizer_class` (and its subclasses) grows, and where it lives.

    Args:
        optimizer_class: the optimizer class, or a `"module:ClassName"` string for a class whose
            library should only be resolved once the user imports it.
        per_param: `(param_info, group, optimizer) -> {state_key: bytes}` for one parameter.
        shared: `(optimizer, param_infos) -> {state_key: bytes}` held once per optimizer.
        source: where the numbers come from.
        includes_frozen: state is made for parameters that do not train too.
        state_location: `optimizer -> iterable of per-parameter states` (each a mapping of state
            key -> tensor, or an object whose attributes are tensors), for an optimizer that keeps
            its state somewhere other than `optimizer.state`; None for `optimizer.state`.
            `measure_optimizer_state` reads the state there, so measuring and estimating agree.

    Examples:
        >>> import torch
        >>> from trainer_memcb import register_estimate_rule, estimate_optimizer_state
        >>> from trainer_memcb import measure_optimizer_state
        >>> class MomentumOnly(torch.optim.SGD):
        ...     pass
        >>> register_estimate_rule(
        ...     MomentumOnly, lambda p, group, opt: {"momentum_buffer": p.num_bytes})
        >>> estimate_optimizer_state(MomentumOnly(torch.nn.Linear(4, 2).parameters(), lr=0.1,
        ...                                       momentum=0.9)).num_bytes
        40
        >>> class KeepsItsOwn(torch.optim.SGD):  # state in an attribute, not in .state
        ...     def __init__(self, params):
        ...         super().__init__(params, lr=0.1)
        ...         self.moments = {id(p): torch.zeros_like(p) for p in self.param_groups[0]["params"]}
        >>> register_estimate_rule(
        ...     KeepsItsOwn, lambda p, group, opt: {"moment": p.num_bytes},
        ...     state_location=lambda opt: ({"moment": m} for m in opt.moments.values()))
        >>> optimizer = KeepsItsOwn(torch.nn.Linear(4, 2).parameters())
        >>> measure_optimizer_state(optimizer).num_bytes, estimate_optimizer_state(optimizer).num_bytes
        (40, 40)
    """
    if state_location is not None and not callable(state_location):
        raise ValueError(
            f"state_location={state_location!r}: expected a callable optimizer -> per-parameter states, or None"
        )
    rule = EstimateRule(
        per_param=per_param,
        shared=shared,
        source=source,
        includes_frozen=includes_frozen,
        state_location=state_location,
    )
    _LOCATIONS.clear()
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
    _resolve_pending()
    for cls in optimizer_class.__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule
    return None


def find_state_location(optimizer_class: type) -> Optional[StateLocation]:
    """Where instances of `optimizer_class` keep their state; None for `optimizer.state`."""
    try:
        return _LOCATIONS[optimizer_class]
    except KeyError:
        pass
    rule = find_estimate_rule(optimizer_class)
    location = rule.state_location if rule is not None else None
    _LOCATIONS[optimizer_class] = location
    return location


def state_of(optimizer: Any) -> List[Any]:
    """The per-parameter states of one (unwrapped) optimizer, from wherever its class keeps them."""
    location = find_state_location(type(optimizer))
    if location is None:
        state = getattr(optimizer, "state", None)
        # Iterating a defaultdict's values never inserts; indexing it would.
        return list(state.values()) if isinstance(state, Mapping) else []
    return list(location(optimizer))


def register_optimizer_view(view: OptimizerView) -> None:
    """Add a view that `estimate_optimizer_state` applies to an optimizer before estimating it.

    Args:
        view: `optimizer -> optimizer or a stand-in`; it returns its argument when it does not apply.
    """
    if not callable(view):
        raise ValueError(f"view={view!r}: expected a callable optimizer -> optimizer")
    if view not in _VIEWS:
        _VIEWS.append(view)


def optimizer_views() -> Tuple[OptimizerView, ...]:
    """The registered views, the built-in ones (DeepSpeed ZeRO-3's lent partitions) included."""
    return tuple(_VIEWS)
