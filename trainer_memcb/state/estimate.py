"""Estimate what an optimizer's state should hold, from its parameters and hyperparameters alone.

An estimate never reads the state, so it exists before the first step. Every rule lives in one
registry, `trainer_memcb.state.registry` (`trainer_memcb.state.rules` fills it with the built-in ones, each
citing the source it follows); `register_estimate_rule` adds a rule for your own optimizer class.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

# The registry lives below this module and the rules; its names are re-exported here, where they
# were first published.
from trainer_memcb.state.registry import (
    EstimateRule,
    ParamInfo,
    find_estimate_rule,
    optimizer_views,
    register_estimate_rule,
)
from trainer_memcb.state.unwrap import inner_optimizers

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

    Examples:
        >>> import torch
        >>> from trainer_memcb import estimate_optimizer_state
        >>> layer = torch.nn.Linear(4, 2)
        >>> estimate = estimate_optimizer_state(torch.optim.AdamW(layer.parameters()))
        >>> estimate.num_params, estimate.num_bytes
        (10, 88)
    """
    # Views registered by the rules: ZeRO-3 lends its flat partitions to the inner optimizer only
    # during the step; outside it a stand-in shows them.
    for view in optimizer_views():
        optimizer = view(optimizer)
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
