"""Modules first imported while a step is traced run their bodies outside the trace, as in a run.

A library is imported once per process, before or during the first step that uses it; what its
module body makes (constants, default arguments such as peft's `torch.tensor(1)`, bitsandbytes'
quantization maps) is made once, on the CPU, and is never the step's. Imported under the fake mode
instead, the body's tensors are fake ones made by the trace: the trace counts them in the first
plan of a process and in no later one, and the library keeps fake tensors in its globals for the
rest of the process, where the Trainer later runs it for real.

`imports_outside_the_trace()` (and a fake mode with `ImportsOutsideTheTrace`, while it is entered)
puts a finder first on `sys.meta_path` (nested entries share one): each module found through it is loaded by its own loader, its body run with
every dispatch mode taken off the stack (`torch.utils._python_dispatch._disable_current_modes`,
the fake mode and the tracker's among them) and put back after. The module keeps its own loader
(`__loader__`, `__spec__.loader`, given back before its body runs). A module
imported before the trace is not imported again, and nothing else changes for it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from typing import Any, Iterator, List, Optional, Sequence

from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["imports_outside_the_trace", "ImportsOutsideTheTrace", "enter_imports_outside", "leave_imports_outside"]


class _Outside(importlib.abc.Loader):
    """The module's own loader, its `create_module` and `exec_module` run with no dispatch mode."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        with _disable_current_modes():
            return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module keeps its own loader, before its body runs (it may read its package's files).
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        with _disable_current_modes():
            self.loader.exec_module(module)


class _OutsideTheTrace(importlib.abc.MetaPathFinder):
    """Finds each module with the finders after it, and loads it outside the trace (`_Outside`)."""

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module") and \
                    hasattr(spec.loader, "create_module"):
                spec.loader = _Outside(spec.loader)
            return spec
        return None


_FINDER = _OutsideTheTrace()
_DEPTH: List[int] = [0]
_READY: List[bool] = []
_LOCK = threading.Lock()


def enter_imports_outside() -> None:
    """Put the finder in (once for nested entries)."""
    if not _READY:
        with _disable_current_modes():  # what it imports at its first call, imported before the finder is in
            pass
        _READY.append(True)
    with _LOCK:
        _DEPTH[0] += 1
        if _DEPTH[0] == 1:
            sys.meta_path.insert(0, _FINDER)


def leave_imports_outside() -> None:
    """Take the finder out when the last entry leaves."""
    with _LOCK:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0 and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)


@contextlib.contextmanager
def imports_outside_the_trace() -> Iterator[None]:
    """While entered, a module imported for the first time runs its body outside every dispatch mode."""
    enter_imports_outside()
    try:
        yield
    finally:
        leave_imports_outside()


class ImportsOutsideTheTrace:
    """A dispatch mode's mixin: while the mode is entered, imports run outside it
    (`imports_outside_the_trace`)."""

    def __enter__(self) -> Any:
        enter_imports_outside()
        try:
            return super().__enter__()  # type: ignore[misc]
        except BaseException:
            leave_imports_outside()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)  # type: ignore[misc]
        finally:
            leave_imports_outside()
