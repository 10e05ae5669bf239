"""Rules for LOMO and AdaLomo (lomo-optim 0.1.1: lomo_optim/lomo.py, lomo_optim/adalomo.py).

Both update each parameter inside its gradient hook (`fused_backward`), never through
`optimizer.state`. LOMO keeps no state at all. AdaLomo keeps factored second moments as
attributes of the optimizer object, dicts keyed by parameter name, for every parameter of the
model, trained or not; its state location reads them there. Registered by `"module:ClassName"`:
nothing here imports lomo_optim.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule

__all__ = ["adalomo_state"]

# AdaLomo.__init__: the attributes holding its state, name -> tensor each.
_ADALOMO_ATTRIBUTES = ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col")


def _lomo(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # lomo.py Lomo.fuse_update: p.data.add_(grad, alpha=-lr) in the hook; nothing kept.
    return {}


def _adalomo(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # adalomo.py AdaLomo.__init__, for every `model.named_parameters()`: a 1-D parameter gets
    # exp_avg_sq[name] = zeros(shape[0]) fp32, any other exp_avg_sq_row[name] = zeros(shape[0])
    # and exp_avg_sq_col[name] = zeros(shape[1]) fp32 (the first two dimensions only).
    if len(param.shape) == 1:
        return {"exp_avg_sq": 4 * param.shape[0]}
    return {"exp_avg_sq_row": 4 * param.shape[0], "exp_avg_sq_col": 4 * param.shape[1]}


def adalomo_state(optimizer: Any) -> Iterator[Dict[str, Any]]:
    """Where AdaLomo keeps its state: per parameter name, its entries of the three attribute dicts."""
    tables = [(key, getattr(optimizer, key, None)) for key in _ADALOMO_ATTRIBUTES]
    tables = [(key, table) for key, table in tables if isinstance(table, dict)]
    names = dict.fromkeys(name for _, table in tables for name in table)
    for name in names:
        yield {key: table[name] for key, table in tables if name in table}


register_estimate_rule("lomo_optim.lomo:Lomo", _lomo, source="lomo_optim/lomo.py Lomo.fuse_update")
register_estimate_rule(
    "lomo_optim.adalomo:AdaLomo",
    _adalomo,
    source="lomo_optim/adalomo.py AdaLomo.__init__",
    includes_frozen=True,
    state_location=adalomo_state,
)
