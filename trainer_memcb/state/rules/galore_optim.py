"""Rules for GaLore's optimizers (galore-torch 1.0: galore_torch/adamw.py, adafactor.py,
adamw8bit.py) and the copies apollo-torch ships of them (apollo_torch/adamw.py, adafactor.py,
adamw8bit.py, with apollo_torch/svd_projector.py).

A parameter in a param group with `rank` (the Trainer's `optim_target_modules`) keeps a
`GaLoreProjector` in its state and its moments at the projected, low-rank shape; every other
parameter is stepped as by the plain optimizer. Registered by `"module:ClassName"`: nothing here
imports galore_torch or apollo_torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Tuple

import torch

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule
from trainer_memcb.state.rules import bitsandbytes_optim
from trainer_memcb.state.rules.transformers_optim import adafactor_state

__all__ = ["svd_projection", "projected_side"]

_HALF = (torch.float16, torch.bfloat16)


def projected_side(shape: Tuple[int, ...], proj_type: str) -> str:
    """Which side `GaLoreProjector.project` multiplies by: `"right"` (keeps the rows),
    `"left"` (keeps the columns) or `"full"` (both)."""
    rows, cols = shape[0], shape[1]
    if proj_type == "std":
        return "right" if rows >= cols else "left"
    if proj_type == "reverse_std":
        return "left" if rows >= cols else "right"
    if proj_type in ("right", "left", "full"):
        return proj_type
    raise ValueError(f"proj_type={proj_type!r}: GaLore knows std, reverse_std, right, left and full")


def svd_projection(shape: Tuple[int, ...], rank: int, proj_type: str, grad_dtype: torch.dtype) -> Tuple[Tuple[int, ...], int]:
    """The low-rank gradient's shape and the projector's bytes, for a 2-D gradient of `grad_dtype`.

    galore_projector.py `GaLoreProjector.get_orthogonal_matrix`: `torch.linalg.svd(fp32 matrix,
    full_matrices=False)` gives U (m, k) and Vh (k, n), k = min(m, n). For an fp32 gradient the
    projector keeps the slice `Vh[:rank]` ("right"), `U[:, :rank]` ("left") or both ("full"): views,
    which keep the whole U or Vh storage alive. For another dtype it keeps copies cast back to it,
    of `min(rank, k)` rows or columns only. `project` multiplies the gradient by it, so the
    gradient's low-rank shape is (m, r), (r, n) or (r, r), r = min(rank, k).
    """
    rows, cols = shape[0], shape[1]
    k = min(rows, cols)
    r = min(rank, k)
    side = projected_side(shape, proj_type)
    if grad_dtype == torch.float32:
        held = {"right": k * cols, "left": rows * k, "full": rows * k + k * cols}[side]
        element_size = 4
    else:
        held = {"right": r * cols, "left": rows * r, "full": rows * r + r * cols}[side]
        element_size = grad_dtype.itemsize
    low_rank = {"right": (rows, r), "left": (r, cols), "full": (r, r)}[side]
    return low_rank, held * element_size


def _projected(param: ParamInfo, group: Mapping[str, Any], grad_dtype: torch.dtype) -> Tuple[ParamInfo, Dict[str, int]]:
    """The parameter as the optimizer sees it (its low-rank gradient's shape), and the projector's
    bytes; unchanged, with no projector, outside a param group with `rank`."""
    if "rank" not in group:
        return param, {}
    low_rank, projector_bytes = svd_projection(param.shape, group["rank"], group["proj_type"], grad_dtype)
    return dataclasses.replace(param, shape=low_rank), {"projector": projector_bytes}


def _galore_adamw(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # galore_torch/adamw.py AdamW.step: `step` a Python int; with `rank`, the projector and
    # exp_avg, exp_avg_sq = zeros_like(projected grad) (the parameter's dtype), else param-sized.
    seen, state = _projected(param, group, param.dtype)
    state.update(exp_avg=seen.num_bytes, exp_avg_sq=seen.num_bytes)
    return state


def _galore_adafactor(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # galore_torch/adafactor.py Adafactor.step: the gradient is upcast from fp16/bf16 to fp32 before
    # the projection, then the state is transformers' Adafactor's over the projected shape
    # (`_get_options(group, grad_shape)`), `RMS` of the fp32 copy of the full parameter.
    grad_dtype = torch.float32 if param.dtype in _HALF else param.dtype
    seen, state = _projected(param, group, grad_dtype)
    state.update(adafactor_state(seen, group))
    return state


def _galore_adamw8bit(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # galore_torch/adamw8bit.py AdamW8bit.step: with `rank`, `p.data` is swapped for the projected
    # gradient before `init_state`, so bitsandbytes sizes state1/state2 (and decides 8-bit against
    # min_8bit_size) on the low-rank shape. AdamW8bit.__init__ passes its arguments to
    # Optimizer2State by position: under bitsandbytes >= 0.50 `percentile_clipping` lands in
    # `max_unorm` (unorm_vec per parameter), as `optimizer.args` shows.
    seen, state = _projected(param, group, param.dtype)
    state.update(bitsandbytes_optim.two_state_per_param(seen, group, optimizer))
    return state


_ADAMW_SOURCE = "galore_torch/adamw.py AdamW.step; galore_projector.py GaLoreProjector.get_orthogonal_matrix"
_ADAFACTOR_SOURCE = "galore_torch/adafactor.py Adafactor.step; galore_projector.py GaLoreProjector.get_orthogonal_matrix"
_ADAMW8BIT_SOURCE = (
    "galore_torch/adamw8bit.py AdamW8bit.step; bitsandbytes/optim/optimizer.py Optimizer2State.init_state; "
    "galore_projector.py GaLoreProjector.get_orthogonal_matrix"
)

for _library in ("galore_torch", "apollo_torch"):
    register_estimate_rule(f"{_library}.adamw:AdamW", _galore_adamw, source=_ADAMW_SOURCE)
    register_estimate_rule(f"{_library}.adafactor:Adafactor", _galore_adafactor, source=_ADAFACTOR_SOURCE)
    register_estimate_rule(
        f"{_library}.adamw8bit:AdamW8bit",
        _galore_adamw8bit,
        shared=bitsandbytes_optim.shared_qmaps,
        source=_ADAMW8BIT_SOURCE,
        state_location=bitsandbytes_optim.bitsandbytes_state,
    )
