"""bitsandbytes' CPU kernels compiled at their first call instead of as bitsandbytes is imported.

bitsandbytes wraps four of its default (CPU) kernels in `torch.compile` as it is imported
(`bitsandbytes/backends/default/ops.py`, `_try_torch_compile`), which loads torch's compiler
front end and Inductor's `compile_fx`: about 0.65 s of an `estimate` that plans an 8-bit
optimizer (the default three include one), for kernels such an estimate never runs on real
tensors (its tensors are fake or on the meta device, and take the ops' fake kernels). In the
`trainer-memcb` process only, while that one module is executed, `torch.compile` returns a
function that compiles at its first call, as the import would have, and runs the compiled code;
`torch.compile` is itself again once the module is in.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, Optional

__all__ = ["defer_bitsandbytes_compilation", "compiled_at_first_call", "COMPILING_MODULE"]

# The module that compiles as it is imported.
COMPILING_MODULE = "bitsandbytes.backends.default.ops"


def compiled_at_first_call(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile`'s signature, deferred: `compile_(fn, **options)` runs at the first call of
    what it returns (and only then), which then calls the compiled function, as every later call
    does."""

    def compile_later(model: Optional[Callable[..., Any]] = None, **options: Any) -> Any:
        if model is None:  # used as `@torch.compile(**options)`
            return lambda fn: compile_later(fn, **options)
        compiled: list = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile_later


class _DeferredWhileExecuting(importlib.abc.MetaPathFinder):
    """Finds `COMPILING_MODULE` as the path finder does, and executes it with `torch.compile`
    deferred (`compiled_at_first_call`)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != COMPILING_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            import torch

            compile_ = torch.compile
            torch.compile = compiled_at_first_call(compile_)
            try:
                execute(module)
            finally:
                torch.compile = compile_

        spec.loader.exec_module = exec_module  # this module's own loader object
        return spec


def defer_bitsandbytes_compilation() -> None:
    """Install the finder, once, unless bitsandbytes' kernels are already in."""
    if COMPILING_MODULE in sys.modules or any(isinstance(f, _DeferredWhileExecuting) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferredWhileExecuting())
