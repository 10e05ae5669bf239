"""Rules for bitsandbytes' optimizers (bitsandbytes/optim/optimizer.py).

Registered by `"module:ClassName"`, so nothing here imports bitsandbytes: a rule is only resolved
once the user has imported the optimizer's module. Every class keeps the base classes'
`Optimizer2State.init_state` / `Optimizer1State.init_state`, except AdEMAMix
(bitsandbytes/optim/ademamix.py `AdEMAMix.init_state`).

Where the state lives: `optimizer.state`, and the quantization maps in `optimizer.name2qmap`, which
`Optimizer8bit.__init__` fills (`fill_qmap`) for every 8-bit optimizer whether or not any
parameter ends up with 8-bit state (`min_8bit_size`).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterator, List, Mapping, Sequence

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule
from trainer_memcb.state.rules._common import num_blocks

__all__ = ["bitsandbytes_state", "shared_qmaps", "two_state_per_param"]

# Optimizer2State.init_state / Optimizer1State.init_state: one fp32 absmax per 256 values.
_BLOCK_SIZE = 256
# F.create_dynamic_map(signed=...): 256 fp32 values, one tensor per optimizer in name2qmap.
_QMAP_BYTES = 256 * 4
# percentile_clipping < 100: gnorm_vec = torch.zeros((100,)) fp32 (bitsandbytes < 0.50 only).
_GNORM_VEC_BYTES = 100 * 4
# max_unorm > 0: unorm_vec = torch.zeros((1,)) fp32.
_UNORM_VEC_BYTES = 4


def _legacy_options() -> bool:
    """bitsandbytes < 0.50 also had `percentile_clipping` and non-blockwise 8-bit state; 0.50
    removed both, `F.percentile_clipping` with them."""
    return hasattr(sys.modules.get("bitsandbytes.functional"), "percentile_clipping")


def _config(optimizer: Any, param: ParamInfo) -> Dict[str, Any]:
    """The config `Optimizer8bit.get_config` will give this parameter at its first step."""
    args = optimizer.args
    config = {
        "optim_bits": args.optim_bits,
        "min_8bit_size": args.min_8bit_size,
        "max_unorm": args.max_unorm,
        "percentile_clipping": getattr(args, "percentile_clipping", 100),
        "block_wise": getattr(args, "block_wise", True),
    }
    manager = optimizer.mng
    module_override = None
    if not getattr(optimizer, "initialized", False):
        # Optimizer8bit.check_overrides, run at the first step, turns every
        # register_module_override(module, name, config) whose tensor is this parameter into
        # pid2config[id(p)] = index2config[(gindex, pindex)] = config; the last one wins.
        for module, name, override in manager.module_weight_config_triple:
            if getattr(module, name, None) is param.param:
                module_override = override
    if module_override is not None:
        config.update(module_override)
    else:
        # Optimizer8bit.get_config: index2config, then pid2config on top.
        config.update(manager.index2config.get((param.group_index, param.index_in_group), {}))
        config.update(manager.pid2config.get(id(param.param), {}))
    return config


def _is_8bit(config: Mapping[str, Any], param: ParamInfo) -> bool:
    # init_state: uint8 state for optim_bits == 8, unless p.numel() < min_8bit_size.
    return config["optim_bits"] == 8 and param.numel >= config["min_8bit_size"]


def _state_rule(num_states: int):
    """Per-parameter and shared rules for `Optimizer{num_states}State.init_state`."""
    indices = range(1, num_states + 1)

    def per_param(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
        # `step` is a Python int. 32-bit state is fp32 whatever the parameter's dtype
        # (get_state_buffer(p, dtype=torch.float32)); 8-bit state is uint8 plus its scales.
        config = _config(optimizer, param)
        state: Dict[str, int] = {}
        for i in indices:
            if not _is_8bit(config, param):
                state[f"state{i}"] = 4 * param.numel
            elif config["block_wise"]:
                state[f"state{i}"] = param.numel
                state[f"absmax{i}"] = 4 * num_blocks(param.numel, _BLOCK_SIZE)
            else:  # bitsandbytes < 0.50 with block_wise=False: one fp32 max per tensor
                state[f"state{i}"] = param.numel
                state[f"max{i}"] = 4
                state[f"new_max{i}"] = 4
        if _legacy_options() and config["percentile_clipping"] < 100:
            state["gnorm_vec"] = _GNORM_VEC_BYTES
        if config["max_unorm"] > 0.0:
            state["unorm_vec"] = _UNORM_VEC_BYTES
        return state

    return per_param, shared_qmaps


def shared_qmaps(optimizer: Any, params: Sequence[ParamInfo]) -> Dict[str, int]:
    # Optimizer8bit.fill_qmap makes name2qmap["dynamic"] (signed, qmap1) and ["udynamic"]
    # (unsigned, qmap2) together, at construction when optim_bits == 8, else at the first 8-bit
    # init_state; every 8-bit parameter's state points at the same two tensors: held once.
    if optimizer.args.optim_bits == 8 or any(p.requires_grad and _is_8bit(_config(optimizer, p), p) for p in params):
        return {"qmap1": _QMAP_BYTES, "qmap2": _QMAP_BYTES}
    return {}


def bitsandbytes_state(optimizer: Any) -> Iterator[Any]:
    """Where an `Optimizer8bit` keeps its state: `optimizer.state`, then the quantization maps of
    `name2qmap` (the same tensors as the 8-bit states' qmap1/qmap2, counted once)."""
    yield from list(optimizer.state.values())
    qmaps = getattr(optimizer, "name2qmap", None)
    if isinstance(qmaps, dict) and qmaps:
        yield {key: qmaps[name] for key, name in (("qmap1", "dynamic"), ("qmap2", "udynamic")) if name in qmaps}


def _ademamix(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # bitsandbytes/optim/ademamix.py AdEMAMix.init_state: state1 holds the fast and the slow EMA,
    # (2, *p.shape) (`_get_state_double_buffer`), state2 p's shape; fp32, or uint8 when 8-bit with
    # absmax1 (2, blocks) and absmax2 (blocks,) fp32. `step` is a Python int; no unorm_vec.
    config = _config(optimizer, param)
    if not _is_8bit(config, param):
        return {"state1": 2 * 4 * param.numel, "state2": 4 * param.numel}
    blocks = num_blocks(param.numel, _BLOCK_SIZE)
    return {"state1": 2 * param.numel, "state2": param.numel, "absmax1": 2 * 4 * blocks, "absmax2": 4 * blocks}


_TWO_STATE = _state_rule(2)
_ONE_STATE = _state_rule(1)
# For optimizers built on Optimizer2State (GaLore's AdamW8bit): its per-parameter state.
two_state_per_param = _TWO_STATE[0]

_TWO_STATE_SOURCE = "bitsandbytes/optim/optimizer.py Optimizer2State.init_state"
_ONE_STATE_SOURCE = "bitsandbytes/optim/optimizer.py Optimizer1State.init_state"


def _family(name: str) -> List[str]:
    return [name, f"{name}8bit", f"{name}32bit"]


def _paged(name: str) -> List[str]:
    return _family(name) + _family(f"Paged{name}")


_ADEMAMIX_SOURCE = "bitsandbytes/optim/ademamix.py AdEMAMix.init_state"

# Module (`cls.__module__` in bitsandbytes 0.50) -> (class names, rules, source). All of these
# keep their base class's init_state. AdEMAMix32bit and PagedAdEMAMix32bit have no rule: they keep
# Optimizer2State.init_state (no room for the slow EMA), and their first step fails on the CPU
# (bitsandbytes 0.50), so no state of theirs could be checked.
_CLASSES = {
    "bitsandbytes.optim.adam": (_paged("Adam"), _TWO_STATE, _TWO_STATE_SOURCE),
    "bitsandbytes.optim.adamw": (_paged("AdamW"), _TWO_STATE, _TWO_STATE_SOURCE),
    "bitsandbytes.optim.lamb": (_family("LAMB"), _TWO_STATE, _TWO_STATE_SOURCE),
    "bitsandbytes.optim.lion": (_paged("Lion"), _ONE_STATE, _ONE_STATE_SOURCE),
    "bitsandbytes.optim.lars": (_family("LARS"), _ONE_STATE, _ONE_STATE_SOURCE),
    "bitsandbytes.optim.rmsprop": (_family("RMSprop"), _ONE_STATE, _ONE_STATE_SOURCE),
    "bitsandbytes.optim.sgd": (_family("SGD"), _ONE_STATE, _ONE_STATE_SOURCE),
    "bitsandbytes.optim.adagrad": (_family("Adagrad"), _ONE_STATE, _ONE_STATE_SOURCE),
}
_ADEMAMIX_CLASSES = ["AdEMAMix", "AdEMAMix8bit", "PagedAdEMAMix", "PagedAdEMAMix8bit"]

for _module, (_names, (_per_param, _shared), _source) in _CLASSES.items():
    for _name in _names:
        register_estimate_rule(
            f"{_module}:{_name}", _per_param, shared=_shared, source=_source, state_location=bitsandbytes_state
        )
for _name in _ADEMAMIX_CLASSES:
    register_estimate_rule(
        f"bitsandbytes.optim.ademamix:{_name}",
        _ademamix,
        shared=shared_qmaps,
        source=_ADEMAMIX_SOURCE,
        state_location=bitsandbytes_state,
    )
