"""Count the bytes autograd saves for backward (the activations), from tensor metadata alone.

`SavedTensorsCounter` is a context manager around a forward pass. While it is active, every tensor
that autograd saves for backward goes through its pack hook, which records the tensor's storage and
hands autograd a small holder object in its place; the unpack hook gives the tensor back. The
figures it keeps:

- `saved_bytes` (-> `activations_bytes`): the bytes of the distinct storages saved while it was
  active and still alive when it exited. Each storage counts once however many tensors (views)
  of it are saved, and the storages of the parameters given in `exclude` never count (they are
  counted as parameters; `weight.t()` saved by a linear layer is a view of the parameter).
- `alive_bytes`: the saved bytes alive now. It falls during backward as autograd releases what it
  saved, and is 0 once the graph is gone.
- `peak_bytes` (-> `activations_peak_bytes`): the most saved bytes alive at any moment so far,
  updated during backward too (recomputed checkpoint tensors, see below, can raise it there).

How the release is seen. The pack hook returns a `_Saved` holder that holds `tensor.detach()` (for a
plain tensor `tensor.data`, the same without the dispatcher): a new tensor object on the same
storage (no copy), so the holder keeps no reference to the graph
(torch's documentation warns that a pack hook returning the input tensor itself makes a reference
cycle). Autograd keeps the holder inside the saved variable and drops it when backward has used it
(or when the graph is freed); the holder's `__del__` then lowers the storage's reference count,
and when that reaches 0 the storage's bytes leave `alive_bytes`. Nothing is copied, no value is
read (`.item()`), the device is never synchronised: the hooks read sizes and identities only.

Storage identity. Real tensors have a `data_ptr()`, fake tensors (`FakeTensorMode`) do not (it is
0, and deprecated). The identity used here is the address of the storage implementation,
`tensor.untyped_storage()._cdata`, which works on real and fake tensors alike and is unique while
the storage is alive (the holder keeps it alive). Its size is `untyped_storage().nbytes()`: the
whole storage, which is what the allocator holds even when only a view of it is saved. Tensor
subclasses that wrap inner tensors (`__tensor_flatten__`: DTensor, torchao's quantized tensors,
`TwoTensor`) report a storage of the outer shape that holds nothing; their inner tensors are
counted instead, recursively.

Other saved-tensor hooks. Hooks form a stack and only the innermost pair applies, so a pair pushed
inside a user's own pair (`torch.autograd.graph.save_on_cpu`, a pair that offloads to disk) would
hide every tensor from it. The counter therefore looks at the pair on top of the stack when it
enters (`torch._C._autograd._top_saved_tensors_default_hooks`), and with `other_hooks="chain"`
(the default) it calls that pair: its pack hook runs the user's pack hook and counts the tensors
that the user's packed value holds (what stays held for backward: the CPU copy for
`save_on_cpu`, nothing for a pair that writes to disk), and its unpack hook calls the user's
unpack hook. With `other_hooks="refuse"` it pushes nothing when another pair is active,
`counting` is False and `refused_reason` says why. torch 2.6 and 2.7 have no way to read the top
of the stack: there "chain" counts without chaining (a user's pair active around the counter does
not apply to the forward it counts), and "refuse" always refuses.

Activation checkpointing (`torch.utils.checkpoint`, `use_reentrant=False`, which is what the
Trainer's `gradient_checkpointing=True` uses in transformers 5). For each checkpointed block,
torch 2.13 saves the block's positional tensor inputs as saved variables (`save_inputs`,
`_make_saved_tensor`) *before* it pushes its own pair, so the counter sees them, under the same
rules (the parameters excluded, each storage once). Inside the block, checkpoint's own pair is on
top: what the block's operations save is not kept (only an empty `_Holder`), and the counter
does not see it. Keyword arguments of the checkpointed function are captured by a closure, not
saved: transformers passes `position_embeddings` and the attention mask that way, and those
tensors are held by the outside anyway (they are the same storages for every layer, and are
counted where the model outside the blocks saves them). So with checkpointing, `saved_bytes`
counts what is saved outside the checkpointed blocks plus every block's positional inputs, alive
at the end of forward. During backward each block is recomputed under checkpoint's
`_recomputation_hook`, which keeps the recomputed saved tensors in the checkpoint frame until
backward unpacks them. With `watch_recomputation=True` the counter also counts those (while the
counter is alive, the class `torch.utils.checkpoint._recomputation_hook` is wrapped so that its
pack hook reports each recomputed tensor; it is released when checkpoint drops it), so
`peak_bytes` includes the recomputation's peak. That wrapping is undone when the counter is closed
(`close()`, or garbage collection of the counter).

Example:

    >>> import torch
    >>> layer = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4)
    >>> with SavedTensorsCounter(exclude=layer.parameters()) as counter:
    ...     loss = layer(x).relu().sum()
    >>> counter.saved_bytes  # x (linear saves its input) and relu's output, 32 bytes each
    64
    >>> loss.backward(); counter.alive_bytes, counter.peak_bytes
    (0, 64)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["SavedTensorsCounter", "storage_key", "storages_of", "OTHER_HOOKS"]

# What to do when another pair of saved-tensor hooks is already active when the counter enters.
OTHER_HOOKS = ("chain", "refuse")

# Containers inside a packed value (a user's pack hook returns e.g. `(device, tensor)`) are walked
# this deep at most.
_MAX_NESTING = 4


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of a plain tensor's storage: the address of its storage implementation.

    Works on real and fake tensors (a fake tensor's `data_ptr()` is 0); unique while the storage
    is alive."""
    return tensor.untyped_storage()._cdata


def storages_of(value: Any, depth: int = 0) -> Iterator[Tuple[int, int, torch.Tensor]]:
    """(storage key, storage bytes, tensor) for each plain tensor inside `value`.

    A wrapper tensor subclass (`__tensor_flatten__`) yields its inner tensors, recursively; tuples,
    lists and dicts (a user's packed value) are walked `_MAX_NESTING` deep; anything else holds no
    tensor that can be seen."""
    if depth > _MAX_NESTING:
        return
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from storages_of(getattr(value, name, None), depth + 1)
            return
        storage = value.untyped_storage()
        yield storage._cdata, storage.nbytes(), value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from storages_of(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from storages_of(item, depth + 1)


class _Book:
    """Per-storage reference counts and the running totals, shared by the holders.

    Kept apart from the counter so that holders, which may outlive the counter (a graph kept for
    a second backward), never keep the counter itself alive."""

    __slots__ = ("live", "alive_bytes", "peak_bytes", "lock")

    def __init__(self) -> None:
        self.live: Dict[int, List[Any]] = {}  # key -> [nbytes, holders, storage (kept alive)]
        self.alive_bytes = 0
        self.peak_bytes = 0
        self.lock = threading.Lock()

    def hold(self, key: int, nbytes: int, storage: Any) -> None:
        with self.lock:
            entry = self.live.get(key)
            if entry is None:
                self.live[key] = [nbytes, 1, storage]
                self.alive_bytes += nbytes
                if self.alive_bytes > self.peak_bytes:
                    self.peak_bytes = self.alive_bytes
            else:
                entry[1] += 1

    def release(self, key: int) -> None:
        with self.lock:
            entry = self.live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[key]
                self.alive_bytes -= entry[0]


class _Saved:
    """What autograd keeps in place of a saved tensor: the packed value, and the storages it
    holds, released from the book when autograd drops this object."""

    __slots__ = ("packed", "keys", "book")

    def __init__(self, packed: Any, keys: Tuple[int, ...], book: _Book) -> None:
        self.packed = packed
        self.keys = keys
        self.book = book

    def __del__(self) -> None:
        for key in self.keys:
            self.book.release(key)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # A new tensor object on the same storage: no copy, and no reference back to the graph.
    return tensor.detach()


class SavedTensorsCounter:
    """Counts the storages autograd saves for backward while it is active: each storage once, the
    given parameters excluded (they are counted as parameters).

    Args:
        exclude: tensors (the parameters) whose storages are never counted.
        other_hooks: "chain" (call another active pair of saved-tensor hooks, and count what its
            packed values hold) or "refuse" (count nothing while another pair is active).
        watch_recomputation: also count the tensors that non-reentrant activation checkpointing
            recomputes during backward, until checkpoint releases them (see the module docstring).

    Figures: `saved_bytes`, `peak_bytes`, `alive_bytes` (bytes, exact integers); `counting` is
    False when it refused, with `refused_reason`.
    """

    def __init__(
        self,
        exclude: Iterable[torch.Tensor] = (),
        *,
        other_hooks: str = "chain",
        watch_recomputation: bool = False,
    ) -> None:
        if other_hooks not in OTHER_HOOKS:
            raise ValueError(f"other_hooks={other_hooks!r}: allowed values are {', '.join(map(repr, OTHER_HOOKS))}")
        if not isinstance(watch_recomputation, bool):
            raise ValueError(f"watch_recomputation={watch_recomputation!r}: allowed values are True and False")
        # The excluded storages are held (strongly) so that their addresses cannot be reused by an
        # activation while the counter lives; parameters are alive for the step anyway.
        self._excluded: Dict[int, Any] = {}
        for tensor in exclude:
            kind = type(tensor)
            if kind is torch.nn.Parameter or kind is torch.Tensor:  # the common case: no walk, nbytes unread
                storage = tensor.untyped_storage()
                self._excluded[storage._cdata] = storage
                continue
            for key, _, inner in storages_of(tensor):
                self._excluded[key] = inner.untyped_storage()
        self.other_hooks = other_hooks
        self.watch_recomputation = watch_recomputation
        self._book = _Book()
        self.saved_bytes = 0
        self.counting = False
        self.refused_reason: Optional[str] = None
        self._pushed = False
        self._watching = False
        self._chained: Optional[Tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = None

    # Figures ------------------------------------------------------------------------------------
    @property
    def alive_bytes(self) -> int:
        return self._book.alive_bytes

    @property
    def peak_bytes(self) -> int:
        return self._book.peak_bytes

    # The hooks ------------------------------------------------------------------------------------
    def _keys_of(self, value: Any) -> Tuple[int, ...]:
        if type(value) is torch.Tensor:
            # The common case, a plain tensor (what `detach()` gives): the reads `storages_of`
            # makes, without its generator. This runs for every tensor a measured forward saves.
            storage = value.untyped_storage()
            key = storage._cdata
            if key in self._excluded:
                return ()
            self._book.hold(key, storage.nbytes(), storage)
            return (key,)
        keys = []
        book = self._book
        for key, nbytes, tensor in storages_of(value):
            if key in self._excluded:
                continue
            keys.append(key)
            book.hold(key, nbytes, tensor.untyped_storage())
        return tuple(keys)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._chained is not None:
            packed = self._chained[0](tensor)
            return _Saved(packed, self._keys_of(packed), self._book)
        if type(tensor) is not torch.Tensor:
            packed = tensor.detach()  # `_detached`, inline: this runs for every tensor saved
            return _Saved(packed, self._keys_of(packed), self._book)
        # A plain tensor: `.data` is the same as `detach()` here (a new tensor object on the same
        # storage, no copy, no grad_fn) without a trip through the dispatcher, a third of its cost.
        # It has a version counter of its own; autograd checks a saved tensor against the counter
        # of the original (`SavedVariable::unpack`), which this does not touch.
        packed = tensor.data
        # The common case, a plain tensor, with `_keys_of` and `_Book.hold` inline (a call each
        # less per saved tensor), and a storage's size read only when the storage is new.
        book = self._book
        storage = packed.untyped_storage()
        key = storage._cdata
        if key in self._excluded:
            return _Saved(packed, (), book)
        with book.lock:
            entry = book.live.get(key)
            if entry is None:
                nbytes = storage.nbytes()
                book.live[key] = [nbytes, 1, storage]
                book.alive_bytes += nbytes
                if book.alive_bytes > book.peak_bytes:
                    book.peak_bytes = book.alive_bytes
            else:
                entry[1] += 1
        return _Saved(packed, (key,), book)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if self._chained is not None:
            return self._chained[1](saved.packed)
        return saved.packed

    # The context ----------------------------------------------------------------------------------
    def __enter__(self) -> "SavedTensorsCounter":
        if self._pushed:
            raise RuntimeError("SavedTensorsCounter is already active; it cannot be entered twice at once")
        top_of_stack = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top_of_stack is None:  # torch before 2.8 cannot say which pair is on top
            if self.other_hooks == "refuse":
                self.counting = False
                self.refused_reason = ("this torch cannot tell whether another pair of saved-tensor hooks is active "
                                       "(torch 2.8 or newer can)")
                return self
            top = None
        else:
            top = top_of_stack(True)
        if top is not None and self.other_hooks == "refuse":
            self.counting = False
            self.refused_reason = (
                f"another pair of saved-tensor hooks is active ({_describe(top[0])}); counting inside it would hide "
                "the saved tensors from it"
            )
            return self
        self._chained = top
        if self.watch_recomputation and not self._watching:
            _RecomputationWatch.add(self._book, self._excluded)
            self._watching = True
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self._pushed = True
        self.counting = True
        self.refused_reason = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            self._pushed = False
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if self.counting:
            self.saved_bytes = self._book.alive_bytes

    def close(self) -> None:
        """Stop watching recomputation (a no-op without `watch_recomputation`)."""
        if self._watching:
            self._watching = False
            _RecomputationWatch.remove(self._book)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _describe(hook: Callable[..., Any]) -> str:
    owner = getattr(hook, "__self__", None)
    if owner is not None:
        return type(owner).__qualname__
    return getattr(hook, "__qualname__", type(hook).__qualname__)


class _RecomputationWatch:
    """Wraps `torch.utils.checkpoint._recomputation_hook` while at least one counter watches.

    Checkpoint's recomputation pack hook returns the recomputed tensor and keeps it in the frame
    (`frame.recomputed`) until backward unpacks it; the wrapper reports each recomputed tensor to
    the watching books and releases it when that tensor object is collected (a `weakref.finalize`
    on the tensor, which is `x.detach()` for a tensor that requires grad: only checkpoint holds it).
    """

    books: Dict[int, Tuple[_Book, Dict[int, Any]]] = {}
    original: Any = None
    lock = threading.Lock()

    @classmethod
    def add(cls, book: _Book, excluded: Dict[int, Any]) -> None:
        from torch.utils import checkpoint

        with cls.lock:
            cls.books[id(book)] = (book, excluded)
            if cls.original is None:
                cls.original = checkpoint._recomputation_hook
                watching = _WATCHING_HOOKS.get(cls.original)
                if watching is None:  # a class made once per original, not at every logged step
                    watching = _WATCHING_HOOKS[cls.original] = _make_watching_hook(cls.original)
                checkpoint._recomputation_hook = watching

    @classmethod
    def remove(cls, book: _Book) -> None:
        from torch.utils import checkpoint

        with cls.lock:
            cls.books.pop(id(book), None)
            if not cls.books and cls.original is not None:
                checkpoint._recomputation_hook = cls.original
                cls.original = None


# The watching subclass of each original `_recomputation_hook` class seen (one, unless the class
# is replaced by someone else).
_WATCHING_HOOKS: Dict[Any, Any] = {}


def _make_watching_hook(original: Any) -> Any:
    class _watching_recomputation_hook(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner_pack = self.pack_hook

            def pack_hook(x: torch.Tensor) -> Any:
                packed = inner_pack(x)
                if isinstance(packed, torch.Tensor):
                    for book, excluded in list(_RecomputationWatch.books.values()):
                        for key, nbytes, tensor in storages_of(packed):
                            if key in excluded:
                                continue
                            book.hold(key, nbytes, tensor.untyped_storage())
                            weakref.finalize(packed, book.release, key)
                return packed

            self.pack_hook = pack_hook

    return _watching_recomputation_hook
