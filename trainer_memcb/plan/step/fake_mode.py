"""The fake-tensor mode the step is traced under, with a quicker dispatch-cache key.

Every operation of a traced step goes through `FakeTensorMode`'s dispatch cache, whose key lists
the operation's arguments with each fake tensor's metadata (`extract_tensor_metadata`, then
`TensorMetadata._flatten_into`). On a 7B model's step that key is about a third of the trace's
time: for each tensor argument, a dataclass built, its fields walked by `dataclasses.fields`, its
shape and strides flattened through the generic argument walk, the sparse layouts asked three times.

`fake_tensor_mode()` returns a `FakeTensorMode` whose `_prep_args_for_hash` appends the very same
values to the key, in the same order, for the common arguments (a strided fake tensor of this mode
without symbolic sizes, a plain number, dtype, device or string) and hands everything else to
torch's own. The key being the same list, the cache finds the same entries and every fake tensor
made is the same: no figure can change. Where torch's key is not laid out as this module expects
(another release), or a check of the two keys on sample tensors disagrees, it is torch's mode as it
is.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, List, Optional

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer_memcb.plan.step.outside_imports import ImportsOutsideTheTrace

__all__ = ["fake_tensor_mode", "quick_keys_available"]

# `TensorMetadata`'s fields, in the order `_flatten_into` appends them, as this module writes them.
_FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
           "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
           "dense_dim", "sparse_dim")
# Arguments torch's walk appends as `type(arg), arg` (its last branch), by their exact type.
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format))

_SIZE, _STRIDED, _CONTIGUOUS = torch.Size, torch.strided, torch.contiguous_format

_MODE_CLASS: List[Optional[type]] = []  # the quick mode's class once built, or None where torch's is kept


def _quick_mode_class() -> Optional[type]:
    """The `FakeTensorMode` subclass with the quicker key, or None where this torch's key is laid
    out otherwise."""
    from torch._subclasses import fake_tensor

    if tuple(field.name for field in dataclasses.fields(fake_tensor.TensorMetadata)) != _FIELDS:
        return None
    if list(inspect.signature(fake_tensor.FakeTensorMode._prep_args_for_hash).parameters) != [
            "self", "result", "args", "state", "id_hashed_objects"]:
        return None
    FakeTensor, strided = fake_tensor.FakeTensor, torch.strided

    class QuickKeyFakeTensorMode(ImportsOutsideTheTrace, fake_tensor.FakeTensorMode):
        """`FakeTensorMode`, its dispatch-cache key appended without the generic walk where it can."""

        # Its `__torch_dispatch__` as written, without the `torch._dynamo.disable` wrapper torch
        # puts around a mode's (two more Python calls and four frame-evaluation switches at every
        # operation, for a compiler that never runs inside a trace).
        __torch_dispatch__ = getattr(fake_tensor.FakeTensorMode.__torch_dispatch__, "__wrapped__",
                                     fake_tensor.FakeTensorMode.__torch_dispatch__)

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def _prep_args_for_hash(self, result: List[object], args: Any, state: Any, id_hashed_objects: List[object]) -> None:
            if self.shape_env is not None:  # symbolic sizes: torch's walk converts them
                return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
            if isinstance(args, (list, tuple, dict)):
                result.append(type(args))
                result.append(f"length_{len(args)}")
                if isinstance(args, dict):
                    self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
                    self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
                    return None
            append = result.append
            for arg in args:
                kind = type(arg)
                if kind in _PLAIN:
                    append(kind)
                    append(arg)
                elif (kind is FakeTensor and arg.fake_mode is self and arg.constant is None and arg.layout is strided
                      and not arg._has_symbolic_sizes_strides):
                    _append_metadata(append, arg)
                elif isinstance(arg, (list, tuple, dict)):
                    self._prep_args_for_hash(result, arg, state, id_hashed_objects)
                else:  # torch's own walk for this one argument (an iterator: no length of its own)
                    super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)
            return None

    return QuickKeyFakeTensorMode if _keys_agree(QuickKeyFakeTensorMode) else None


def _append_metadata(append: Any, tensor: torch.Tensor) -> None:
    """`extract_tensor_metadata(tensor)._flatten_into(...)` for a strided tensor with plain sizes."""
    # `suggest_memory_format` asks the strides only of a 4- or 5-dimensional tensor.
    memory_format = suggest_memory_format(tensor) if tensor.dim() in (4, 5) else _CONTIGUOUS
    if not tensor.is_contiguous(memory_format=memory_format):
        memory_format = None
    shape, stride = tensor.shape, tensor.stride()
    append(tensor.dtype)
    append(_SIZE)
    append(f"length_{len(shape)}")
    for size in shape:
        append(int)
        append(size)
    append(tuple)
    append(f"length_{len(stride)}")
    for step in stride:
        append(int)
        append(step)
    for value in (tensor.device, _STRIDED, memory_format, tensor.storage_offset(),
                  tensor.untyped_storage().nbytes(), tensor.requires_grad, tensor.is_quantized, tensor.is_conj(),
                  tensor.is_neg(), tensor.is_inference(), False, None, None, None):
        append(value)


def _keys_agree(mode_class: type) -> bool:
    """Whether the quick mode's key equals torch's on sample tensors: contiguous, transposed,
    channels-last, offset, needing gradients, in several dtypes, beside plain arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState

    mode = mode_class()
    with mode:
        base = torch.empty(2, 3, 4, 5)
        samples = [base, base.transpose(0, 2), base.contiguous(memory_format=torch.channels_last), base[1],
                   torch.empty(4, 6, dtype=torch.bfloat16, requires_grad=True), torch.empty(()), base[:, 1:, ::2],
                   torch.empty(1, 1, 1, 1), torch.empty(2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d)]
    # The tensors at the top: torch's walk of a nested list calls the mode's own (the quick one).
    args = (*samples, 2, 1.5, True, None, torch.float16, "mean", [3, (4, 5)], {"dim": -1, "keepdim": False})
    quick: List[object] = []
    plain: List[object] = []
    try:
        mode._prep_args_for_hash(quick, args, _CacheKeyState(None), [])
        FakeTensorMode._prep_args_for_hash(mode, plain, args, _CacheKeyState(None), [])
    except Exception:  # a release whose walk this module does not know
        return False
    return quick == plain and [type(value) for value in quick] == [type(value) for value in plain]


def quick_keys_available() -> bool:
    """Whether `fake_tensor_mode()` gives the quick-key mode on this torch."""
    if not _MODE_CLASS:
        _MODE_CLASS.append(_quick_mode_class())
    return _MODE_CLASS[0] is not None


class _PlainFakeTensorMode(ImportsOutsideTheTrace, FakeTensorMode):
    """torch's `FakeTensorMode`, imports made while it is entered run outside it."""


def fake_tensor_mode(**options: Any) -> Any:
    """A `FakeTensorMode(**options)` under which a module imported for the first time runs its body
    outside the mode (`trainer_memcb.plan.step.outside_imports`), with the quicker dispatch-cache
    key where this torch's key is laid out as expected (`quick_keys_available`)."""
    mode_class = _MODE_CLASS[0] if quick_keys_available() else None
    return (mode_class or _PlainFakeTensorMode)(**options)
