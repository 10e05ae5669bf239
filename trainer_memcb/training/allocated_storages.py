"""The bytes alive of the storages that operations allocate while a counter is entered, and their peak.

`AllocatedStorages` is a `TorchDispatchMode` for a real run (not a fake trace): it counts a storage
from the operation that allocates it until the last tensor object it saw on that storage is gone,
each storage once, at its full size (`untyped_storage().nbytes()`). Whether an operation allocates
is read from its schema: a result with alias information (`Tensor(a)`: a view, `Tensor(a!)`: an
in-place operation) is a tensor on a storage that already exists, so `weight.t()`, a slice of the
batch, or AdamW's in-place update of its state never count what was alive before the counter was
entered; such a result only keeps a storage counted when the counter already counts it (a view of
a fresh tensor outliving it). So no list of what existed before is needed, and nothing is walked.

The counter can be entered and left several times (`enter`, `leave`): only operations while it is
entered count, and a storage it counts stays counted while it is left, until its tensors are gone
(weak references, whose callbacks run wherever the tensor dies). The peak is read after each
operation. It reads metadata only: no copy, no `.item()`, no device sync; each operation costs a
few microseconds of Python, which is why it is only entered on the steps the Trainer logs.

What it does not see: buffers a kernel allocates for itself and frees before returning (scratch
space, not tensors), and small tensors made in C++ without an operation (wrapped scalars); on
CUDA, the caching allocator's rounding and its segments (`device_peak_reserved_bytes` says those).
A `torch.compile`d function called while it is entered (a compiled reward model, `generate`'s
compiled forward with a static cache) is compiled and run as without it: the counter declares that
it ignores compile internals (`TorchDispatchMode.ignore_compile_internals`), rather than making
dynamo skip the function's frame for the rest of the process; what its compiled code allocates
without calling operations (inductor's kernels) is then not seen. torch 2.6 cannot be told so
(`trainer_memcb.utils.compiled.dispatch_modes_stop_compiling`).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocatedStorages"]

# Per operation: for each of its results, whether it may alias an input (its schema's alias_info).
_ALIASING: Dict[Any, Tuple[bool, ...]] = {}


def _aliasing(func: Any) -> Tuple[bool, ...]:
    found = _ALIASING.get(func)
    if found is None:
        try:
            found = tuple(result.alias_info is not None for result in func._schema.returns)
        except Exception:  # an operation without a schema: its results are taken as views
            found = ()
        _ALIASING[func] = found
    return found


class _Gone:
    """A counted tensor's weak-reference callback: its storage loses one tensor object."""

    __slots__ = ("counter", "ident", "key")

    def __init__(self, counter: "AllocatedStorages", ident: int, key: int) -> None:
        self.counter, self.ident, self.key = counter, ident, key

    def __call__(self, _: Any) -> None:
        self.counter._gone(self.ident, self.key)


class AllocatedStorages(TorchDispatchMode):
    """Bytes alive of the storages allocated while entered, and the most of them at once.

    Attributes:
        alive_bytes: bytes of the counted storages alive now.
        peak_bytes: the most of them alive after any operation while entered.

    Examples:
        >>> import torch
        >>> weight = torch.ones(4, 4)
        >>> counter = AllocatedStorages()
        >>> counter.enter()
        >>> product = weight.t() @ torch.ones(4, 2)  # the view of weight does not count; ones and the product do
        >>> counter.leave()  # nothing entered after it: it leaves the stack
        True
        >>> counter.peak_bytes, counter.alive_bytes  # two 4x2 fp32 tensors; the ones are gone, the product alive
        (64, 32)
    """

    def __init__(self) -> None:
        super().__init__()
        self.alive_bytes = 0
        self.peak_bytes = 0
        self._tensors: Dict[int, int] = {}  # storage key -> tensor objects seen on it and alive
        self._sizes: Dict[int, int] = {}  # storage key -> bytes, while counted
        self._storages: Dict[int, Any] = {}  # storage key -> the storage, so the key stays unique
        self._seen: Dict[int, Any] = {}  # id() of a tensor object seen -> its weak reference
        self.entered = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def enter(self) -> None:
        """Count the operations from now on (this thread's dispatch-mode stack)."""
        if not self.entered:
            self.__enter__()
            self.entered = True

    def leave(self) -> bool:
        """Stop counting operations; the storages counted stay counted until gone. Returns False,
        leaving it entered, when another dispatch mode entered later is still on top of the stack
        (popping would take that one off)."""
        if not self.entered:
            return True
        if _get_current_dispatch_mode() is not self:
            return False
        self.__exit__(None, None, None)
        self.entered = False
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        aliasing = _aliasing(func)
        if isinstance(out, tuple) and len(out) == len(aliasing):
            for result, aliases in zip(out, aliasing):
                self._results(result, aliases)
        else:
            self._results(out, not aliasing or aliasing[0])
        if self.alive_bytes > self.peak_bytes:
            self.peak_bytes = self.alive_bytes
        return out

    def _results(self, out: Any, aliases: bool) -> None:
        for leaf in ([out] if hasattr(out, "untyped_storage") else tree_leaves(out)):
            if hasattr(leaf, "untyped_storage"):
                self._track(leaf, aliases)

    def _track(self, tensor: Any, aliases: bool) -> None:
        ident = id(tensor)
        if ident in self._seen:
            return
        try:
            storage = tensor.untyped_storage()
        except Exception:  # a tensor subclass without one storage: its inner operations are seen instead
            return
        key = storage._cdata
        count = self._tensors.get(key)
        if count is None:
            if aliases:  # on a storage that existed before, or that this counter does not count
                return
            self._sizes[key] = storage.nbytes()
            self._storages[key] = storage
            self.alive_bytes += self._sizes[key]
            count = 0
        self._tensors[key] = count + 1
        self._seen[ident] = weakref.ref(tensor, _Gone(self, ident, key))

    def _gone(self, ident: int, key: int) -> None:
        self._seen.pop(ident, None)
        count = self._tensors.get(key, 0) - 1
        if count > 0:
            self._tensors[key] = count
            return
        self._tensors.pop(key, None)
        self._storages.pop(key, None)
        self.alive_bytes -= self._sizes.pop(key, 0)

    def forget(self) -> None:
        """Count nothing more: drop every storage and weak reference (the figures stay)."""
        self._tensors, self._sizes, self._storages, self._seen = {}, {}, {}, {}
