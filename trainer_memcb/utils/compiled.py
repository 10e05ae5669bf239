"""Whether a model is compiled with `torch.compile`, and the module behind the compiled wrapper.

`torch.compile(model)` returns an `OptimizedModule` that holds the model as `_orig_mod` (and
forwards attribute reads to it, so walking it like a plain module can recurse without end);
`model.compile()` compiles in place and keeps the compiled call as `_compiled_call_impl`. Both are
read by attribute, not by class, so that nothing here imports dynamo.

Why it matters to a measurement: a dispatch mode or saved-tensor hooks of ours around a compiled
call change how it runs. Dynamo skips a frame it meets under a dispatch mode that does not ignore
compile internals (`torch/_dynamo/convert_frame.py`, `ConvertFrame.__call__`: "non-infra torch
dispatch mode present"), and that skip is kept for the frame's code, so the model runs eagerly for
the rest of the process; saved-tensor hooks are traced into the graph, or split it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dispatch_modes_stop_compiling", "has_compiled_part", "is_compiled", "uncompiled"]

# How many `torch.compile` wrappers around one model are followed (a model compiled twice has two).
_MAX_WRAPPERS = 8


def uncompiled(model: Any) -> Any:
    """The module a `torch.compile` wrapper holds (`_orig_mod`, followed), or `model` itself.

    Examples:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> uncompiled(torch.compile(layer)) is layer, uncompiled(layer) is layer
        (True, True)
    """
    for _ in range(_MAX_WRAPPERS):
        inner = getattr(model, "__dict__", {}).get("_modules", {}).get("_orig_mod")
        if inner is None:
            return model
        model = inner
    return model


def is_compiled(model: Any) -> bool:
    """Whether calling `model` runs a graph compiled by `torch.compile` (a wrapper, or in place).

    Examples:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> is_compiled(layer), is_compiled(torch.compile(layer))
        (False, True)
        >>> layer.compile(); is_compiled(layer)
        True
    """
    if uncompiled(model) is not model:
        return True
    return getattr(model, "_compiled_call_impl", None) is not None


def has_compiled_part(model: Any) -> bool:
    """Whether calling `model` runs a compiled graph anywhere: the model itself, or any module inside it
    (`model.encoder.compile()`, a `torch.compile`d layer). A walk of the modules: call it once per
    run or per evaluation, not per step.

    Examples:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> has_compiled_part(model)
        False
        >>> model[0].compile(); is_compiled(model), has_compiled_part(model)
        (False, True)
    """
    if is_compiled(model):
        return True
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return False
    return any(is_compiled(module) for module in modules())


def dispatch_modes_stop_compiling() -> bool:
    """Whether a dispatch mode of ours, around code that calls a `torch.compile`d function no module
    shows, would keep that function from compiling for the rest of the process: on a torch whose
    dispatch modes cannot declare that they ignore compile internals
    (`TorchDispatchMode.ignore_compile_internals`, which torch 2.6 lacks), once dynamo has compiled
    anything in this process. Nothing is imported: dynamo is asked only when already loaded.

    Examples:
        >>> from torch.utils._python_dispatch import TorchDispatchMode
        >>> dispatch_modes_stop_compiling() if hasattr(TorchDispatchMode, "ignore_compile_internals") else False
        False
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    if hasattr(TorchDispatchMode, "ignore_compile_internals"):
        return False
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(dynamo_utils, "counters", None)
    return counters is not None and counters["frames"]["total"] > 0
