"""The bytes alive at each moment of a step run under fake tensors: a dispatch-mode tracker.

`LiveStorages` is a `TorchDispatchMode` that sees every tensor an operation returns. Each storage
is counted once, with its full size (`untyped_storage().nbytes()`), from the moment an operation
first returns a tensor on it until the last tensor object seen on it is collected (a weak
reference with a callback per tensor object, kept by the tracker; torch keeps a tensor's Python
object alive as long as C++ holds the tensor, so the callback runs when the tensor is really gone). Tensors that exist before
the step (parameters, buffers, the batch) are registered with `add`. The peak is the most bytes
alive after any operation, and at that moment the tracker keeps which storages were alive, so that
the plan can say what they were (parameters, gradients, optimizer state, activations, others).
Storages named in `exclude` are never counted: so it also measures what a real forward allocates
(`trainer_memcb.training.evaluation_probe`), its parameters and inputs left out.

A storage resized in place (`UntypedStorage.resize_`, which no dispatch mode sees: FSDP2 frees and
re-allocates its unsharded parameters that way, `_fsdp_param.py` `free_storage`/`alloc_storage`)
is counted at its new size from then on, under a new serial number, while the tracker is entered:
the method is patched for that time, as torch's own `MemTracker._track_resize` does.

The timeline itself is kept too (`events`: each storage's birth and death, by serial number, in
order), so that once the step is over and every storage's part is known, `most_by` replays it
and gives the most bytes each part held at one moment (the model-states table's figures per
engine: DDP's gradients with their buckets, ZeRO-1's whole gradients before the reduction).

Where an engine allocates on streams of its own, it sets `stream_of`, and each storage is noted
with the stream current when it starts to count (`streams`, the default stream's left out): the
allocator replay gives a block back only to its own stream.

It reads metadata only, and is meant for fake tensors (`FakeTensorMode`): nothing is allocated,
so the figures are what a caching-free allocator would hold, storage by storage, on the device the
tensors claim.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from trainer_memcb.plan.step.timeline import most_by
from trainer_memcb.state.saved_tensors import storages_of

__all__ = ["LiveStorages", "TrackerState"]


class TrackerState(NamedTuple):
    """A `LiveStorages`' books at one moment (`LiveStorages.snapshot`); the storages alive then are
    held here, so that `LiveStorages.restore` finds them alive however long after."""

    events: Tuple[int, ...]
    sizes: Dict[int, int]
    tags: Dict[int, str]
    tensors: Dict[int, int]
    storages: Dict[int, Any]
    serial: Dict[int, int]
    seen: Dict[int, Any]
    seen_keys: Dict[int, List[int]]  # the storage keys of each tensor object seen
    alive_bytes: int
    first_matmul: Dict[str, int]
    phase: str
    watch: Optional[Dict[int, Any]]
    streams: Dict[int, int] = {}
    # The log (`LiveStorages.tokens`) and its names, where one is kept.
    tokens: Optional[Tuple[Any, ...]] = None
    labels: Dict[int, Any] = {}
    companions: Dict[int, int] = {}


class LiveStorages(TorchDispatchMode):
    """Bytes alive, storage by storage, and the peak with what was alive then.

    Attributes:
        alive_bytes: bytes alive now.
        peak_bytes: the most bytes alive after any operation so far.
        peak_keys: the storages alive at the peak, by serial number.
        watch: None, or a dict whose keys are storage keys: `peak_watch` is then those of them
            alive at the peak, by serial number, in no particular order.
        peak_label: the phase (`phase`, set by the caller) at the peak.
        sizes: serial number -> bytes, for every storage seen (alive or not). A storage's key (its
            address) may be reused once it is freed; its serial number never is.
        events: with `keep_timeline=True`, the timeline: `s` when storage `s` (a serial number)
            starts to count, `~s` when it stops; `most_by` replays it. Empty otherwise.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's `__torch_dispatch__` in `torch._dynamo.disable` where this says so:
        # two more Python calls and four frame-evaluation switches at every operation, for a
        # compiler that never runs inside a trace.
        return False

    def __init__(self, exclude: Any = (), keep_timeline: bool = False) -> None:
        super().__init__()
        # Storage keys never counted (`storages_of`'s): a real model's parameters, buffers and
        # batch, when a real forward is measured for what it allocates itself.
        self._exclude = frozenset(exclude)
        self.alive_bytes = 0
        self.peak_bytes = 0
        self.peak_keys: List[int] = []
        self.peak_label = ""
        self.tokens: Optional[List[Any]] = None  # the log, with `keep_tokens()` (its comment below)
        self.phase = ""
        self.sizes: Dict[int, int] = {}
        self._tensors: Dict[int, int] = {}  # storage key -> live tensor objects seen on it
        self._storages: Dict[int, Any] = {}
        self._serial: Dict[int, int] = {}  # storage key -> serial number, while alive
        self._seen: Dict[int, Any] = {}  # id() of the tensor objects seen and alive -> a weak reference
        self.watch: Optional[Dict[int, Any]] = None  # storages whose keys are copied at the peak
        self.peak_watch: List[int] = []
        # serial number -> part, for storages an engine names (its buffers, unsharded parameters);
        # a storage resized keeps its part under its new serial number.
        self.tags: Dict[int, str] = {}
        # Called as on_op(func, args, kwargs) after each operation, its outputs tracked: an engine
        # tags the buffers its collectives use.
        self.on_op: Optional[Any] = None
        # Called as count_flops(func, out, args, kwargs) after each operation but a device's query
        # (`trainer_memcb.plan.step.flops.FlopCounting`).
        self.count_flops: Optional[Any] = None
        # The timeline, with `keep_timeline` (a fake step's, bounded by it): a serial number s when
        # its storage is counted, ~s when it no longer is; `_start` is where the step's state
        # begins (`restart_peak`).
        self.events: List[int] = []
        self._record = self.events.append if keep_timeline else _ignore
        self._start = 0
        # phase -> the position in `events` where its first matrix multiply ran (its outputs
        # recorded from there): where CUDA makes a cuBLAS handle's workspaces (the allocator replay).
        self.first_matmul: Dict[str, int] = {}
        # Called as stream_of() when a storage starts to count: the number of the stream it is
        # allocated on (0: the default stream), where an engine runs work on streams of its own
        # (FSDP2's all-gather and reduce-scatter streams); None: every storage on the default one.
        self.stream_of: Optional[Any] = None
        # serial number -> its allocation stream, for the storages not on the default stream.
        self.streams: Dict[int, int] = {}
        # With `keep_tokens()`: the timeline's events with what else decides the peaks, in order
        # (`trainer_memcb.plan.step.layer_fold`): each event (an int, as in `events`), and tuples for
        # a peak check that could raise the peak (("c",)), a reset of the peak (("r",)), a phase
        # (("p", name)), a moment the caller takes the peak (("t", name)), a storage saved for
        # backward or released from it (("w", 1 or -1, serial)), a storage resized (("z", old, new),
        # before its two events). None (set above): nothing logged.
        self._checked_at = -1
        # With `tokens`: serial -> the serial of the list element a foreach operation made it from
        # (its output at the same index), and serial -> a name for what it holds (a parameter's,
        # its gradient's, its optimizer state's), which `layer_fold` aligns the logs by.
        self.companions: Dict[int, int] = {}
        self.labels: Dict[int, Any] = {}

    def __enter__(self) -> "LiveStorages":
        self._original_resize = torch.UntypedStorage.resize_
        original, tracker = self._original_resize, self

        def resize_(storage: Any, size: int) -> Any:
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def restart_peak(self) -> None:
        """Take the bytes alive now as the peak so far (an engine that has just brought the
        model to its state between steps: ZeRO-3's partitioned parameters)."""
        self.reset_peak()
        self._start = len(self.events)
        self._check_peak()

    def reset_peak(self) -> None:
        """Count the peak anew from here (a phase's or a micro-batch's own peak)."""
        self.peak_bytes = 0
        if self.tokens is not None:
            self.tokens.append(_RESET)
            self._checked_at = -1

    def keep_tokens(self) -> None:
        """Log `tokens` from now on (before anything is counted: an empty log)."""
        self.tokens = []

        def record(event: int, events: List[int] = self.events, tokens: List[Any] = self.tokens) -> None:
            events.append(event)
            tokens.append(event)

        self._record = record

    def log_saved(self, book: Any) -> None:
        """With `tokens`, log each storage `book` (a `SavedTensorsCounter`'s) starts or stops
        holding for backward, as ("w", 1 or -1, serial), and watch its storages at each peak."""
        if self.tokens is None:
            return
        book.live = _LoggedBook(book.live, self)
        self.watch = book.live

    def take(self, name: str) -> None:
        """Note in `tokens` that the caller reads the peak here (`name`: what it reads it for)."""
        if self.tokens is not None:
            self.tokens.append(("t", name))

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase = name
        if self.tokens is not None:
            self.tokens.append(("p", name))

    @property
    def step_start(self) -> int:
        """Where in `events` the step begins (`restart_peak`; 0 unless an engine restarted it)."""
        return self._start

    def most_by(self, group_of: Any) -> Dict[str, int]:
        """The most bytes each group held at one moment since the step began (`restart_peak`),
        the timeline replayed with `group_of(serial)` naming each storage's group (None: none)."""
        return most_by(self.events, self.sizes, self._start, group_of)

    def alive_serials(self) -> frozenset:
        """The serial numbers of the storages counted now."""
        return frozenset(self._serial.values())

    def snapshot(self) -> "TrackerState":
        """What the tracker holds now, for `restore`: the timeline so far and every book."""
        return TrackerState(tuple(self.events), dict(self.sizes), dict(self.tags), dict(self._tensors),
                            dict(self._storages), dict(self._serial), dict(self._seen),
                            {ident: ref.__callback__.keys for ident, ref in self._seen.items()}, self.alive_bytes,
                            dict(self.first_matmul), self.phase, dict(self.watch) if self.watch is not None else None,
                            dict(self.streams), tuple(self.tokens) if self.tokens is not None else None,
                            dict(self.labels), dict(self.companions))

    def restore(self, state: "TrackerState", replacements: Dict[int, torch.Tensor]) -> None:
        """Count again exactly what `state` counted, as if nothing had run since `snapshot`: the
        timeline, the sizes and the parts from then, every storage alive then alive now (the state
        holds them). A tensor object seen then and gone since is forgotten, or, where
        `replacements` gives one for its `id` then (a tensor on the same storages, never seen),
        counted as that one, which releases them when it goes."""
        self.events = list(state.events)
        self._record = self.events.append
        if state.tokens is not None:
            self.keep_tokens()
            self.tokens.extend(state.tokens)
            self.labels, self.companions = dict(state.labels), dict(state.companions)
            self._checked_at = -1
        self.sizes, self.tags, self.first_matmul = dict(state.sizes), dict(state.tags), dict(state.first_matmul)
        self.streams = dict(state.streams)
        self._tensors, self._storages, self._serial = dict(state.tensors), dict(state.storages), dict(state.serial)
        self.alive_bytes, self._phase = state.alive_bytes, state.phase
        self.watch = dict(state.watch) if state.watch is not None else None
        seen = dict(state.seen)
        gone = [(ident, ref) for ident, ref in seen.items() if ref() is None]
        for ident, _ in gone:  # first all: a replacement may have the id of another one gone
            del seen[ident]
        for ident, _ in gone:
            tensor = replacements.get(ident)
            if tensor is not None:
                seen[id(tensor)] = weakref.ref(tensor, _Gone(self, id(tensor), state.seen_keys[ident]))
        self._seen = seen

    def set_size(self, storage: Any, nbytes: int, part: Optional[str] = None) -> None:
        """Count a tracked storage at `nbytes` from now on (an engine's model of a buffer that is
        gathered and released), under a new serial number named `part`."""
        key = storage._cdata
        serial = self._serial.get(key)
        if serial is None:
            return
        if self.tokens is not None:
            self.tokens.append(("z", serial, len(self.sizes)))
        self.alive_bytes -= self.sizes[serial]
        self._record(~serial)
        serial = self._serial[key] = len(self.sizes)
        self.sizes[serial] = nbytes
        self._on_stream(serial)
        self._record(serial)
        if part is not None:
            self.tags[serial] = part
        self.alive_bytes += nbytes
        self._check_peak()

    def made_at_size(self, storage: Any, nbytes: int, part: Optional[str] = None) -> None:
        """Count a tracked storage at `nbytes` from its making on, as if it had been made so: a
        model handed to an engine whole that a real run makes in the engine's layout (ZeRO-3's
        parameters, which `deepspeed.zero.Init` partitions as each is made, so that no two are
        ever whole at once). Its allocation keeps its place in the timeline, at the new size."""
        serial = self._serial.get(storage._cdata)
        if serial is None:
            return
        self.alive_bytes += nbytes - self.sizes[serial]
        self.sizes[serial] = nbytes
        if part is not None:
            self.tags[serial] = part

    def _resized(self, storage: Any) -> None:
        key = storage._cdata
        serial = self._serial.get(key)
        if serial is None or self.sizes[serial] == storage.nbytes():
            return
        if self.tokens is not None:
            self.tokens.append(("z", serial, len(self.sizes)))
        self.alive_bytes -= self.sizes[serial]
        self._record(~serial)
        tag = self.tags.get(serial)
        serial = self._serial[key] = len(self.sizes)
        if tag is not None:
            self.tags[serial] = tag
        self.sizes[serial] = storage.nbytes()
        self._on_stream(serial)
        self._record(serial)
        self.alive_bytes += self.sizes[serial]
        self._check_peak()

    def _on_stream(self, serial: int) -> None:
        """Note the stream storage `serial` is allocated on, where it is not the default one."""
        stream = self.stream_of() if self.stream_of is not None else 0
        if stream:
            self.streams[serial] = stream

    def add(self, tensor: torch.Tensor) -> None:
        """Count a tensor that exists before the step (a parameter, a buffer, the batch)."""
        self._track(tensor)
        self._check_peak()

    def _track(self, tensor: torch.Tensor) -> None:
        ident = id(tensor)
        if ident in self._seen:
            return
        if is_traceable_wrapper_subclass(tensor):
            found = [(key, nbytes, inner.untyped_storage()) for key, nbytes, inner in storages_of(tensor)]
        else:  # nearly every tensor: one storage, no generator to run (as `storages_of` finds it)
            storage = tensor.untyped_storage()
            found = [(storage._cdata, storage.nbytes(), storage)]
        keys = []
        for key, nbytes, storage in found:
            if key in self._exclude:
                continue
            count = self._tensors.get(key)
            if count is None:
                self._tensors[key] = 1
                self._storages[key] = storage  # keeps the address unique while counted
                serial = self._serial[key] = len(self.sizes)
                self.sizes[serial] = nbytes
                self.alive_bytes += nbytes
                if self.stream_of is not None:
                    self._on_stream(serial)
                self._record(serial)
            else:
                self._tensors[key] = count + 1
            keys.append(key)
        # One weak reference per tensor object, its callback run as the tensor dies: the object
        # forgotten, then its storages released, the last one first (the order of a
        # `weakref.finalize` per storage and one for the object, which cost more to make).
        self._seen[ident] = weakref.ref(tensor, _Gone(self, ident, keys))

    def _gone(self, ident: int, keys: List[int]) -> None:
        self._seen.pop(ident, None)
        for key in reversed(keys):
            self._release(key)

    def _release(self, key: int) -> None:
        count = self._tensors[key] - 1
        if count:
            self._tensors[key] = count
        else:
            del self._tensors[key]
            del self._storages[key]
            serial = self._serial.pop(key)
            self.alive_bytes -= self.sizes[serial]
            self._record(~serial)

    def _check_peak(self) -> None:
        if self.tokens is not None and self._checked_at != len(self.events):
            # A check can raise the peak only after an allocation (or after a reset, which sets
            # `_checked_at` to -1): one token where one of those came before it.
            self.tokens.append(_CHECK)
            self._checked_at = len(self.events)
        if self.alive_bytes > self.peak_bytes:
            self.peak_bytes = self.alive_bytes
            self.peak_keys = list(self._serial.values())
            self.peak_label = self.phase
            if self.watch is not None:
                # The watched storages alive now, found by intersecting the two key sets in C rather
                # than by a Python loop over every watched one (a 70B step has 4,348 new peaks).
                serial = self._serial
                self.peak_watch = list(map(serial.__getitem__, self.watch.keys() & serial.keys()))

    def tag(self, tensors: Any, part: str, replace: bool = False) -> None:
        """Name the part the storages of `tensors` (tracked now) belong to; a storage already
        named keeps its part unless `replace`."""
        for serial in self.serials(tensors):
            if replace or serial not in self.tags:
                self.tags[serial] = part

    def serials(self, tensors: Any) -> List[int]:
        """The serial numbers of the storages of `tensors` (alive and tracked now)."""
        found = []
        for tensor in tensors:
            for key, _, _ in storages_of(tensor):
                if key in self._serial:
                    found.append(self._serial[key])
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if func is _DEVICE:  # a tensor's device, asked of the fake tensor: nothing made
            out = func(*args, **(kwargs or {}))
            if self.alive_bytes > self.peak_bytes:
                self._check_peak()
            return out
        kwargs = kwargs or {}
        if func in _MATMULS and self.phase not in self.first_matmul:
            self.first_matmul[self.phase] = len(self.events)
        out = func(*args, **kwargs)
        if self.count_flops is not None:
            self.count_flops(func, out, args, kwargs)
        if isinstance(out, torch.Tensor):  # most operations: one tensor, no tree to walk
            self._track(out)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._track(leaf)
        if self.on_op is not None:
            self.on_op(func, args, kwargs)
        if self.tokens is not None:
            if isinstance(out, torch.Tensor):
                source = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
                if source is not None:
                    self._note_companions((out,), ((source,),))
            elif isinstance(out, (list, tuple)) and func.__name__.startswith("_foreach_"):
                self._note_companions(out, args)
        self._check_peak()
        return out

    def _note_companions(self, out: Any, args: Tuple[Any, ...]) -> None:
        """Each output of an operation: the input at its index of its first tensor list (a
        foreach operation's), or its first tensor argument."""
        inputs = next((arg for arg in args if isinstance(arg, (list, tuple)) and len(arg) == len(out)
                       and all(isinstance(item, torch.Tensor) for item in arg)), None)
        if inputs is None:
            return
        serial = self._serial
        for made, source in zip(out, inputs):
            if isinstance(made, torch.Tensor):
                made_serial = serial.get(made.untyped_storage()._cdata)
                source_serial = serial.get(source.untyped_storage()._cdata)
                if made_serial is not None and source_serial is not None and made_serial != source_serial:
                    self.companions.setdefault(made_serial, source_serial)

    def label(self, tensors: Any, name: Any) -> None:
        """Name what the storages of `tensors` hold, where `tokens` are logged."""
        if self.tokens is None:
            return
        for serial in self.serials(tensors):
            self.labels.setdefault(serial, name)


# The aten operations a linear layer or a batched product dispatches to (cuBLAS / cuBLASLt on CUDA).
_MATMULS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                      torch.ops.aten.baddbmm.default))


_DEVICE = torch.ops.prim.device.default
_CHECK, _RESET = ("c",), ("r",)


def _ignore(event: int) -> None:
    pass


class _LoggedBook(dict):
    """A saved-tensors book's storages (key -> entry) that logs, in the tracker's tokens, each
    storage it starts or stops holding, by the serial the tracker counts it under."""

    def __init__(self, entries: Dict[int, Any], tracker: "LiveStorages") -> None:
        super().__init__(entries)
        self.tracker = tracker

    def __setitem__(self, key: int, value: Any) -> None:
        if key not in self:
            serial = self.tracker._serial.get(key)
            if serial is not None:
                self.tracker.tokens.append(("w", 1, serial))
        super().__setitem__(key, value)

    def __delitem__(self, key: int) -> None:
        serial = self.tracker._serial.get(key)
        if serial is not None:
            self.tracker.tokens.append(("w", -1, serial))
        super().__delitem__(key)


class _Gone:
    """A tracked tensor's weak-reference callback: `tracker._gone(ident, keys)`."""

    __slots__ = ("tracker", "ident", "keys")

    def __init__(self, tracker: "LiveStorages", ident: int, keys: List[int]) -> None:
        self.tracker, self.ident, self.keys = tracker, ident, keys

    def __call__(self, _: Any) -> None:
        self.tracker._gone(self.ident, self.keys)
