"""Rules for bitsandbytes' optimizers (bitsandbytes/optim/optimizer.py).

Registered by `"module:ClassName"`, so nothing here imports bitsandbytes: a rule is only resolved
once the user has imported the optimizer's module. Every class below keeps the base classes'
`Optimizer2State.init_state` / `Optimizer1State.init_state`.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Sequence

from trainer_memcb.registry import ParamInfo, register_estimate_rule
from trainer_memcb.rules._common import num_blocks

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

    def shared(optimizer: Any, params: Sequence[ParamInfo]) -> Dict[str, int]:
        # qmap1 (signed) and qmap2 (unsigned) are the optimizer's name2qmap tensors, the same
        # ones in every 8-bit parameter's state: held once, if any parameter goes 8-bit.
        if any(p.requires_grad and _is_8bit(_config(optimizer, p), p) for p in params):
            return {f"qmap{i}": _QMAP_BYTES for i in indices}
        return {}

    return per_param, shared


_TWO_STATE = _state_rule(2)
_ONE_STATE = _state_rule(1)

_TWO_STATE_SOURCE = "bitsandbytes/optim/optimizer.py Optimizer2State.init_state"
_ONE_STATE_SOURCE = "bitsandbytes/optim/optimizer.py Optimizer1State.init_state"


def _family(name: str) -> List[str]:
    return [name, f"{name}8bit", f"{name}32bit"]


def _paged(name: str) -> List[str]:
    return _family(name) + _family(f"Paged{name}")


# Module (`cls.__module__` in bitsandbytes 0.50) -> (class names, rules, source). All of these
# keep their base class's init_state; AdEMAMix overrides it and has no rule here.
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

for _module, (_names, (_per_param, _shared), _source) in _CLASSES.items():
    for _name in _names:
        register_estimate_rule(f"{_module}:{_name}", _per_param, shared=_shared, source=_source)
