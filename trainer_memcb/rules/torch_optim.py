"""Rules for `torch.optim`: state made by each optimizer's `_init_group` in torch/optim/<name>.py."""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from trainer_memcb.estimate import ParamInfo, register_estimate_rule
from trainer_memcb.rules._common import torch_step_bytes


def _adam(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # torch/optim/adam.py Adam._init_group: step (0-dim), exp_avg and exp_avg_sq = zeros_like(p),
    # max_exp_avg_sq = zeros_like(p) with amsgrad. AdamW subclasses Adam in torch >= 2.7.
    state = {
        "step": torch_step_bytes(group),
        "exp_avg": param.num_bytes,
        "exp_avg_sq": param.num_bytes,
    }
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = param.num_bytes
    return state


register_estimate_rule(torch.optim.Adam, _adam, source="torch/optim/adam.py Adam._init_group")
register_estimate_rule(torch.optim.AdamW, _adam, source="torch/optim/adamw.py (Adam._init_group)")
