"""Meta-device stand-ins of a model: the same module tree, shapes and dtypes, and no memory.

Some of the Trainer's optimizers are built around the model itself: GaLore and APOLLO pick their
target `nn.Linear` modules by name, LOMO takes the model, and the layer-wise variants hang a hook
on every trainable parameter. A what-if builds them over a stand-in, so that the real model gets
no hook, no state and no new attribute, and nothing is allocated.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from trainer_memcb.plan.model.param_shapes import logical_shape

__all__ = ["meta_stand_in"]


def _meta_parameter(param: torch.Tensor) -> nn.Parameter:
    # A packed 4-bit weight is uint8: the stand-in keeps the shape and dtype the model holds.
    # A ZeRO-3 partitioned parameter is an empty tensor: the twin takes its real shape, ds_shape.
    twin = torch.empty(logical_shape(param), dtype=param.dtype, device="meta")
    return nn.Parameter(twin, requires_grad=bool(param.requires_grad))


def _stand_in(module: nn.Module, params: Dict[int, nn.Parameter], modules: Dict[int, nn.Module]) -> nn.Module:
    if id(module) in modules:  # a submodule shared by two parents stays shared
        return modules[id(module)]
    cls = type(module)
    twin = cls.__new__(cls)
    nn.Module.__init__(twin)  # fresh internals: no hook of the model's is carried over
    internals = set(twin.__dict__)
    # The rest (a config, in_features, a PEFT wrapper's adapter names) is shared, read-only.
    twin.__dict__.update({key: value for key, value in module.__dict__.items() if key not in internals})
    twin.training = module.training
    modules[id(module)] = twin
    for name, param in module._parameters.items():
        if param is not None and id(param) not in params:
            params[id(param)] = _meta_parameter(param)
        twin._parameters[name] = None if param is None else params[id(param)]
    for name, buffer in module._buffers.items():
        twin._buffers[name] = None if buffer is None else torch.empty(
            tuple(buffer.shape), dtype=buffer.dtype, device="meta")
    for name, child in module._modules.items():
        twin._modules[name] = None if child is None else _stand_in(child, params, modules)
    return twin


def meta_stand_in(model: nn.Module) -> nn.Module:
    """A twin of `model` whose parameters and buffers are meta tensors of the same shapes, dtypes
    and `requires_grad`, in modules of the same classes under the same names. Tied weights stay
    tied (one stand-in for one tensor). The model itself is left untouched.

    Args:
        model: any `nn.Module`, on any device.

    Examples:
        >>> import torch
        >>> from trainer_memcb.plan.model.stand_ins import meta_stand_in
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
        >>> twin = meta_stand_in(model)
        >>> type(twin[0]).__name__, twin[0].weight.device.type, tuple(twin[0].weight.shape)
        ('Linear', 'meta', (2, 4))
    """
    return _stand_in(model, {}, {})
