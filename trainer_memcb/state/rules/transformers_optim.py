"""Rules for the optimizers transformers ships itself (transformers/optimization.py)."""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule
from trainer_memcb.state.rules._common import factored_numels

# Adafactor.step upcasts these gradients (and the parameter copy it takes the RMS of) to float32.
_UPCAST_TO_FP32 = (torch.float16, torch.bfloat16)


__all__ = ["adafactor_state"]


def _adafactor(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    return adafactor_state(param, group)


def adafactor_state(param: ParamInfo, group: Mapping[str, Any]) -> Dict[str, int]:
    """Bytes by key of transformers' Adafactor state for one parameter (GaLore's Adafactor keeps
    the same state over the projected gradient)."""
    # transformers/optimization.py Adafactor.step, "State Initialization": every buffer is made
    # `.to(grad)` or `zeros_like(grad)`, grad upcast from fp16/bf16 to fp32: fp32 state for
    # fp32/fp16/bf16 parameters, fp64 for fp64 ones. `step` is a Python int. `RMS` is the int 0
    # until the first step, then the 0-dim tensor `_rms(p_data_fp32)`: counted as after it.
    element_size = 4 if param.dtype in _UPCAST_TO_FP32 else param.element_size
    state = {"RMS": element_size}
    if group["beta1"] is not None:
        state["exp_avg"] = param.numel * element_size
    if len(param.shape) >= 2:  # Adafactor._get_options: factored
        row, col = factored_numels(param.shape)
        state["exp_avg_sq_row"] = row * element_size
        state["exp_avg_sq_col"] = col * element_size
    else:
        state["exp_avg_sq"] = param.numel * element_size
    return state


# By string, so that estimating never imports transformers.optimization itself.
register_estimate_rule(
    "transformers.optimization:Adafactor",
    _adafactor,
    source="transformers/optimization.py Adafactor.step",
)
