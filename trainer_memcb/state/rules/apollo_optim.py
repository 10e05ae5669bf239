"""Rules for APOLLO (apollo-torch 1.0.3: apollo_torch/apollo.py `AdamW`, the Trainer's
`apollo_adamw` and `apollo_adamw_layerwise`).

A parameter in a param group with `rank` (the Trainer's `optim_target_modules`) keeps a projector
and its moments at the projected shape, plus the norm of its last scaled gradient; every other
parameter keeps AdamW's two moments. `scale_type` ("channel" or "tensor") and `scale` change only
temporaries, not the state. Registered by `"module:ClassName"`: nothing here imports apollo_torch.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule
from trainer_memcb.state.rules.galore_optim import projected_side, svd_projection


def random_projection(shape: Tuple[int, ...], rank: int, proj_type: str, grad_dtype: torch.dtype) -> Tuple[Tuple[int, ...], int]:
    """The low-rank gradient's shape and the projector's bytes for `proj="random"`.

    random_projector.py `GradientProjector.get_orthogonal_matrix`: a fresh fp32 Gaussian
    (m, rank) ("left") or (rank, n) ("right"), rank not capped by the shape, divided by sqrt(rank)
    (a new tensor), cast back to the gradient's dtype when that is not fp32. `project` gives
    (rank, n) or (m, rank). "full" is not implemented there.
    """
    rows, cols = shape[0], shape[1]
    side = projected_side(shape, proj_type)
    if side == "full":
        raise ValueError("proj_type='full': APOLLO's random projector does not implement it")
    element_size = 4 if grad_dtype == torch.float32 else grad_dtype.itemsize
    if side == "right":
        return (rows, rank), rank * cols * element_size
    return (rank, cols), rows * rank * element_size


def _apollo_adamw(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # apollo.py AdamW.step: `step` and `seed` Python ints; exp_avg, exp_avg_sq =
    # zeros_like(projected grad), in the parameter's dtype. With `rank`: the projector
    # (`_initialize_projector`: random or svd, GaLore's) and, unless `disable_nl`, `scaled_grad`,
    # the 0-dim norm of `p.grad * grad_scaling_factor` (the parameter's dtype).
    if "rank" not in group:
        return {"exp_avg": param.num_bytes, "exp_avg_sq": param.num_bytes}
    project = random_projection if group["proj"] == "random" else svd_projection
    low_rank, projector_bytes = project(param.shape, group["rank"], group["proj_type"], param.dtype)
    numel = low_rank[0] * low_rank[1]
    state = {
        "projector": projector_bytes,
        "exp_avg": numel * param.element_size,
        "exp_avg_sq": numel * param.element_size,
    }
    if not getattr(optimizer, "disable_nl", False):
        state["scaled_grad"] = param.element_size
    return state


register_estimate_rule(
    "apollo_torch.apollo:AdamW",
    _apollo_adamw,
    source="apollo_torch/apollo.py AdamW.step, _initialize_projector; random_projector.py GradientProjector",
)
