"""Rule for GrokAdamW (grokadamw 0.1.2: grokadamw/grokadamw.py).

GrokAdamW keeps its state not in `optimizer.state` but in each param group, `group["state"]`, a
dict parameter -> state; its state location reads it there. Registered by `"module:ClassName"`:
nothing here imports grokadamw.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule

__all__ = ["grokadamw_state"]


def _grokadamw(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # grokadamw.py GrokAdamW._update_group: `step` a Python int; exp_avg, exp_avg_sq and grok_ema
    # = zeros_like(p, device="cpu"), kept on the CPU between steps, in the parameter's dtype.
    return {"exp_avg": param.num_bytes, "exp_avg_sq": param.num_bytes, "grok_ema": param.num_bytes}


def grokadamw_state(optimizer: Any) -> Iterator[Any]:
    """Where GrokAdamW keeps its state: `param_groups[i]["state"]`, parameter -> state."""
    for group in optimizer.param_groups:
        state = group.get("state")
        if isinstance(state, dict):
            yield from list(state.values())


register_estimate_rule(
    "grokadamw.grokadamw:GrokAdamW",
    _grokadamw,
    source="grokadamw/grokadamw.py GrokAdamW._update_group",
    state_location=grokadamw_state,
)
