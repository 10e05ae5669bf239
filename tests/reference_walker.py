"""An independent count of what an optimizer holds, for checking `measure_optimizer_state`.

It shares no code with the library: it walks the whole object graph of the optimizer (its
attributes, param groups, state, whatever dicts, lists and objects hang off them) and adds up every
tensor storage it reaches, each once. Not counted: the model's parameters and gradients, modules,
functions, and hyperparameters (a param group's `params`, the keys its optimizer's `defaults`
name, and the LR scheduler's `initial_lr`): settings, not state.
"""

from __future__ import annotations

import types
from typing import Any, Dict, Iterator, Set, Tuple

import torch

_LEAVES = (
    type(None), bool, int, float, complex, str, bytes, type, types.FunctionType, types.MethodType,
    types.BuiltinFunctionType, types.ModuleType, torch.nn.Module, torch.dtype, torch.device,
)
_MAX_DEPTH = 16


def _plain(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        yield tensor
        return
    inner_names, _ = tensor.__tensor_flatten__()  # torchao's quantized states, DTensor
    for name in inner_names:
        yield from _plain(getattr(tensor, name))


def held_storages(optimizer: Any, model: torch.nn.Module) -> Dict[Tuple[str, int, int], str]:
    """(device, address, bytes) of every storage the optimizer holds -> where it was first found."""
    excluded: Set[int] = set()
    for param in model.parameters():
        excluded.add(param.untyped_storage().data_ptr())
        if param.grad is not None:
            excluded.add(param.grad.untyped_storage().data_ptr())
    found: Dict[Tuple[str, int, int], str] = {}
    visited: Set[int] = set()

    def walk(value: Any, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            for plain in _plain(value):
                storage = plain.untyped_storage()
                if plain.device.type != "meta" and storage.data_ptr() not in excluded:
                    found.setdefault((str(plain.device), storage.data_ptr(), storage.nbytes()), path)
            return
        if isinstance(value, _LEAVES) or depth > _MAX_DEPTH or id(value) in visited:
            return
        visited.add(id(value))
        if isinstance(value, torch.optim.Optimizer):
            settings = set(value.defaults) | {"params", "initial_lr"}
            for index, group in enumerate(value.param_groups):
                for key, item in group.items():
                    if key not in settings:
                        walk(item, f"{path}.param_groups[{index}][{key}]", depth + 1)
            for key, item in vars(value).items():
                if key not in ("param_groups", "defaults"):
                    walk(item, f"{path}.{key}", depth + 1)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(key, f"{path}[key]", depth + 1)
                walk(item, f"{path}[{key if isinstance(key, str) else type(key).__name__}]", depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                walk(item, f"{path}[]", depth + 1)
        elif isinstance(getattr(value, "__dict__", None), dict):
            for key, item in vars(value).items():
                walk(item, f"{path}.{key}", depth + 1)

    walk(optimizer, "optimizer", 0)
    return found


def held_bytes(optimizer: Any, model: torch.nn.Module) -> int:
    """Bytes of every storage the optimizer holds, each once."""
    return sum(size for _, _, size in held_storages(optimizer, model))
