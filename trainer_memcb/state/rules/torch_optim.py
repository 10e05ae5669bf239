"""Rules for `torch.optim`: state made by each optimizer's `_init_group` in torch/optim/<name>.py.

State is kept in the parameter's dtype (`zeros_like(p)`); scalars such as `step` are 0-dim tensors
sized by `torch_step_bytes`.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule
from trainer_memcb.state.rules._common import factored_numels, step_and_buffers, torch_step_bytes

_ADAM = {"exp_avg": None, "exp_avg_sq": None, "max_exp_avg_sq": "amsgrad"}

# Optimizers whose state is a few 0-dim scalar tensors plus parameter-sized buffers:
# class -> (scalar tensor keys, buffer key -> group option that switches it on or None, source).
_STEP_AND_BUFFERS = {
    # AdamW subclasses Adam in torch >= 2.7 and shares its _init_group.
    torch.optim.Adam: (("step",), _ADAM, "torch/optim/adam.py Adam._init_group"),
    torch.optim.AdamW: (("step",), _ADAM, "torch/optim/adamw.py (Adam._init_group)"),
    # momentum_buffer = a clone of the first gradient; no state at all without momentum.
    torch.optim.SGD: ((), {"momentum_buffer": "momentum"}, "torch/optim/sgd.py SGD.step"),
    # Filled at construction for every parameter in the groups: see _INCLUDES_FROZEN.
    torch.optim.Adagrad: (("step",), {"sum": None}, "torch/optim/adagrad.py Adagrad.__init__"),
    torch.optim.RMSprop: (
        ("step",),
        {"square_avg": None, "momentum_buffer": "momentum", "grad_avg": "centered"},
        "torch/optim/rmsprop.py RMSprop._init_group",
    ),
    torch.optim.NAdam: (
        ("step", "mu_product"),
        {"exp_avg": None, "exp_avg_sq": None},
        "torch/optim/nadam.py NAdam._init_group",
    ),
    torch.optim.RAdam: (
        ("step",),
        {"exp_avg": None, "exp_avg_sq": None},
        "torch/optim/radam.py RAdam._init_group",
    ),
    torch.optim.Adamax: (
        ("step",),
        {"exp_avg": None, "exp_inf": None},
        "torch/optim/adamax.py Adamax._init_group",
    ),
    torch.optim.Adadelta: (
        ("step",),
        {"square_avg": None, "acc_delta": None},
        "torch/optim/adadelta.py Adadelta._init_group",
    ),
    torch.optim.Rprop: (
        ("step",),
        {"prev": None, "step_size": None},
        "torch/optim/rprop.py Rprop._init_group",
    ),
    torch.optim.ASGD: (("step", "eta", "mu"), {"ax": None}, "torch/optim/asgd.py ASGD._init_group"),
    # `step` is a Python int here.
    torch.optim.SparseAdam: (
        (),
        {"exp_avg": None, "exp_avg_sq": None},
        "torch/optim/sparse_adam.py SparseAdam.step",
    ),
}
_INCLUDES_FROZEN = {torch.optim.Adagrad}

for _cls, (_scalars, _buffers, _source) in _STEP_AND_BUFFERS.items():
    register_estimate_rule(
        _cls,
        step_and_buffers(_scalars, _buffers),
        source=_source,
        includes_frozen=_cls in _INCLUDES_FROZEN,
    )


def _adafactor(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> Dict[str, int]:
    # torch/optim/_adafactor.py Adafactor._init_group: step (0-dim); for ndim >= 2 row_var and
    # col_var = grad.new_zeros(shape with the last / second to last dim set to 1), else variance =
    # zeros_like(grad). All in the gradient's (= parameter's) dtype.
    state = {"step": torch_step_bytes(group)}
    if len(param.shape) > 1:
        row, col = factored_numels(param.shape)
        state["row_var"] = row * param.element_size
        state["col_var"] = col * param.element_size
    else:
        state["variance"] = param.num_bytes
    return state


if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    register_estimate_rule(
        torch.optim.Adafactor, _adafactor, source="torch/optim/_adafactor.py Adafactor._init_group"
    )
