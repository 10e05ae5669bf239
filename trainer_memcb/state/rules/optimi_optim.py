"""Rules for torch-optimi's optimizers (torch-optimi 0.3.3: optimi/<name>.py `_init_state`,
`_init_group`), `stable_adamw` in the Trainer.

Every buffer is made like the parameter (its dtype). A low-precision (fp16/bf16) parameter also
gets a parameter-sized Kahan-summation compensation buffer `kahan_comp` unless `kahan_sum=False`.
Adam, AdamW, Adan, RAdam, Ranger and StableAdamW count their steps in one int32 tensor per param
group, `group["step"]`, not in `optimizer.state`; their state location reads it there (and passes
over the `group` entry that gradient release puts in each parameter's state: the group holds the
parameters themselves). With Triton (`triton=True`, and for StableAdamW also `triton=None` whenever
Triton imports, see `_stable_adamw_triton`) a parameter without a Kahan buffer gets a one-value
stand-in, and StableAdamW a one-value fp32 `mean_square`. Registered by `"module:ClassName"`:
nothing here imports optimi (it reads `optimi.utils.HAS_TRITON` from `sys.modules`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterator, Mapping, Sequence, Tuple

import torch

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule

__all__ = ["optimi_state"]

_HALF = (torch.float16, torch.bfloat16)
_INT32_BYTES = 4


TritonCheck = Callable[[Mapping[str, Any], Any], bool]


def _triton(group: Mapping[str, Any], optimizer: Any) -> bool:
    # Adam, AdamW, Adan, Lion, RAdam, Ranger, SGD: `_init_state` runs before `_init_group`
    # resolves triton=None, so only a triton=True given at construction makes the one-value
    # stand-ins below.
    return bool(optimizer.defaults.get("triton"))


def _stable_adamw_triton(group: Mapping[str, Any], optimizer: Any) -> bool:
    # stableadamw.py StableAdamW._init_group (0.3.3) resolves triton=None *before* its loop fills
    # `params`: `_default_to_triton(params)` sees an empty list, and utils.py's
    # `HAS_TRITON and all(...)` of it is HAS_TRITON (Triton importable, torch >= 2.6): a CUDA build
    # of torch, which brings Triton, gets the Triton kernels and their state even for CPU tensors.
    if group.get("gradient_release"):  # the state is made in each parameter's hook, before any
        return _triton(group, optimizer)  # `_init_group`: only a triton=True given counts
    if group.get("setup"):  # resolved by a step already
        return bool(group.get("triton"))
    if group.get("triton") is None and group.get("foreach") is None:
        return bool(getattr(sys.modules.get("optimi.utils"), "HAS_TRITON", False))
    return bool(group.get("triton"))


def _kahan(param: ParamInfo, group: Mapping[str, Any], optimizer: Any, stand_in_bytes: int = 1,
           triton: TritonCheck = _triton) -> Dict[str, int]:
    # `(kahan_sum or kahan_sum is None) and p.dtype in (fp16, bf16)`: zeros_like(p); elif triton:
    # zeros(1) (uint8; Lion: p's dtype); else None.
    if (group.get("kahan_sum") or group.get("kahan_sum") is None) and param.dtype in _HALF:
        return {"kahan_comp": param.num_bytes}
    if triton(group, optimizer):
        return {"kahan_comp": stand_in_bytes}
    return {}


def _buffers_rule(buffers: Sequence[str], extra=None, triton: TritonCheck = _triton):
    """Parameter-sized `buffers`, the Kahan buffer, `step` per parameter under gradient release."""

    def rule(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
        state = dict.fromkeys(buffers, param.num_bytes)
        if extra is not None:
            state.update(extra(param, group, optimizer))
        state.update(_kahan(param, group, optimizer, triton=triton))
        if group.get("gradient_release"):
            state["step"] = _INT32_BYTES
        return state

    return rule


def _stable_adamw_extra(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # stableadamw.py StableAdamW._init_state: eps_sq = tensor(eps ** 2, dtype=p.dtype), 0-dim;
    # with triton, mean_square = zeros(1) fp32.
    state = {"eps_sq": param.element_size}
    if _stable_adamw_triton(group, optimizer):
        state["mean_square"] = 4
    return state


def _lion(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # lion.py Lion._init_state: exp_avg = zeros_like(p); the triton stand-in is p's dtype.
    state = {"exp_avg": param.num_bytes}
    state.update(_kahan(param, group, optimizer, stand_in_bytes=param.element_size))
    return state


def _sgd(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # sgd.py SGD._init_state: exp_avg = the gradient's clone when dampening and torch_init, else
    # zeros_like(p) with momentum, else zeros(1) of p's dtype with triton, else None.
    state: Dict[str, int] = {}
    if (group.get("dampening") and group.get("torch_init")) or group.get("momentum"):
        state["exp_avg"] = param.num_bytes
    elif _triton(group, optimizer):
        state["exp_avg"] = param.element_size
    state.update(_kahan(param, group, optimizer))
    return state


def _group_steps(optimizer: Any, params: Sequence[ParamInfo]) -> Dict[str, int]:
    # `_init_group`, run by every whole-model `step()`: on a group's first one, group["step"] =
    # tensor(0, dtype=int32). Under gradient release each parameter also counts its own steps
    # (per-parameter rule); the group's is made too, by the `optimizer.step()` the loop still calls.
    return {"step": _INT32_BYTES * len(optimizer.param_groups)}


def optimi_state(optimizer: Any) -> Iterator[Any]:
    """Where an optimi optimizer keeps its state: `optimizer.state` (less the `group` entry
    gradient release adds), then each param group's `step` tensor."""
    for state in list(optimizer.state.values()):
        yield {key: value for key, value in state.items() if key != "group"} if "group" in state else state
    for group in optimizer.param_groups:
        step = group.get("step")
        if isinstance(step, torch.Tensor):
            yield {"step": step}


# Class -> (per-parameter rule, whether it keeps a step per group, source function)
_CLASSES: Dict[str, Tuple[Any, bool, str]] = {
    "optimi.adam:Adam": (_buffers_rule(("exp_avg", "exp_avg_sq")), True, "optimi/adam.py Adam._init_state"),
    "optimi.adamw:AdamW": (_buffers_rule(("exp_avg", "exp_avg_sq")), True, "optimi/adam.py Adam._init_state"),
    "optimi.adan:Adan": (
        _buffers_rule(("exp_avg", "exp_avg_diff", "exp_avg_sq", "prev_grad")), True, "optimi/adan.py Adan._init_state"),
    "optimi.radam:RAdam": (_buffers_rule(("exp_avg", "exp_avg_sq")), True, "optimi/radam.py RAdam._init_state"),
    "optimi.ranger:Ranger": (
        _buffers_rule(("exp_avg", "exp_avg_sq", "la_param")), True, "optimi/ranger.py Ranger._init_state"),
    "optimi.stableadamw:StableAdamW": (
        _buffers_rule(("exp_avg", "exp_avg_sq"), extra=_stable_adamw_extra, triton=_stable_adamw_triton), True,
        "optimi/stableadamw.py StableAdamW._init_state"),
    "optimi.lion:Lion": (_lion, False, "optimi/lion.py Lion._init_state"),
    "optimi.sgd:SGD": (_sgd, False, "optimi/sgd.py SGD._init_state"),
}

for _name, (_rule, _group_step, _source) in _CLASSES.items():
    register_estimate_rule(
        _name,
        _rule,
        shared=_group_steps if _group_step else None,
        source=f"{_source}, _init_group",
        state_location=optimi_state,
    )
