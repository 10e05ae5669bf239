"""Measure the bytes an optimizer's state really holds, from tensor metadata alone.

Nothing here copies a tensor, reads a value (`.item()`), synchronises a device or talks to other
processes: sizes, dtypes, devices and storage addresses are all metadata on the host.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Set, Tuple

import torch

from trainer_memcb.unwrap import inner_optimizers

__all__ = ["StateMeasurement", "measure_optimizer_state", "dtype_name"]

# Containers inside a state are walked this deep at most; real ones (GaLore's projector objects,
# lists of tensors) are one or two levels deep, and the limit keeps a cyclic object finite.
_MAX_NESTING = 6


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`, the spelling used in every breakdown."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class StateMeasurement:
    """What an optimizer's state holds.

    Attributes:
        num_bytes: bytes of storage held, each storage counted once.
        num_elements: values stored in those storages (a quantized state counts its codes, scales
            and quantization maps, not the logical shape it stands for).
        num_tensors: distinct storages counted.
        num_params_with_state: parameters that have a state entry holding at least one tensor.
        bytes_by_key: bytes per top-level state key (`exp_avg`, `state1`, ...).
        bytes_by_dtype: bytes per storage dtype (`float32`, `uint8`, ...).
        bytes_by_device: bytes per device (`cpu`, `cuda:0`, ...).
        elements_by_key: values per top-level state key.
    """

    num_bytes: int
    num_elements: int
    num_tensors: int
    num_params_with_state: int
    bytes_by_key: Dict[str, int] = field(default_factory=dict)
    bytes_by_dtype: Dict[str, int] = field(default_factory=dict)
    bytes_by_device: Dict[str, int] = field(default_factory=dict)
    elements_by_key: Dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """True before the first optimizer step of most optimizers: nothing to claim yet."""
        return self.num_tensors == 0

    def to_dict(self) -> Dict[str, Any]:
        return {
            "num_bytes": self.num_bytes,
            "num_elements": self.num_elements,
            "num_tensors": self.num_tensors,
            "num_params_with_state": self.num_params_with_state,
            "bytes_by_key": dict(self.bytes_by_key),
            "bytes_by_dtype": dict(self.bytes_by_dtype),
            "bytes_by_device": dict(self.bytes_by_device),
            "elements_by_key": dict(self.elements_by_key),
        }


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that really hold a tensor's data.

    Tensor subclasses (torchao's quantized states, DTensor) report a logical shape and dtype; their
    storage is in the inner tensors `__tensor_flatten__` names. Names that are not tensors (a
    DTensor's mesh, say) are passed over.
    """
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
        yield tensor
        return
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        yield tensor
        return
    inner_names, _ = flatten()
    for name in inner_names:
        inner = getattr(tensor, name, None)
        if isinstance(inner, torch.Tensor):
            yield from _plain_tensors(inner)


def _storage_identity(tensor: torch.Tensor) -> Tuple[str, int, int]:
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr(), storage.nbytes())


class _Tally:
    def __init__(self) -> None:
        self.num_bytes = 0
        self.num_elements = 0
        self.num_tensors = 0
        self.bytes_by_key: Dict[str, int] = defaultdict(int)
        self.bytes_by_dtype: Dict[str, int] = defaultdict(int)
        self.bytes_by_device: Dict[str, int] = defaultdict(int)
        self.elements_by_key: Dict[str, int] = defaultdict(int)
        self._seen_storages: Set[Tuple[str, int, int]] = set()

    def add_tensor(self, key: str, tensor: torch.Tensor) -> bool:
        """Count every plain tensor behind `tensor`; True if it holds any storage."""
        counted = False
        for plain in _plain_tensors(tensor):
            if plain.device.type == "meta":
                continue  # a meta tensor has a shape and no memory
            identity = _storage_identity(plain)
            num_bytes = identity[2]
            if identity in self._seen_storages:
                continue  # shared storage (bitsandbytes' qmaps): already counted once
            if identity[1] != 0:
                self._seen_storages.add(identity)
            # A storage counts whole: a view into a larger buffer keeps the whole buffer alive.
            num_elements = num_bytes // plain.element_size() if plain.element_size() else 0
            self.num_bytes += num_bytes
            self.num_elements += num_elements
            self.num_tensors += 1
            self.bytes_by_key[key] += num_bytes
            self.elements_by_key[key] += num_elements
            self.bytes_by_dtype[dtype_name(plain.dtype)] += num_bytes
            self.bytes_by_device[str(plain.device)] += num_bytes
            counted = True
        return counted

    def add_value(self, key: str, value: Any, depth: int, visiting: Set[int]) -> bool:
        """Count the tensors inside a state value: a tensor, a container, or an object with
        tensors as attributes (GaLore's projector). Plain Python values hold no tensor memory."""
        if isinstance(value, torch.Tensor):
            return self.add_tensor(key, value)
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return False
        if depth >= _MAX_NESTING or id(value) in visiting:
            return False
        if isinstance(value, Mapping):
            children = list(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = list(value)
        else:
            attributes = getattr(value, "__dict__", None)
            if not isinstance(attributes, dict):
                return False
            children = list(attributes.values())
        visiting.add(id(value))
        counted = False
        for child in children:
            counted = self.add_value(key, child, depth + 1, visiting) or counted
        visiting.discard(id(value))
        return counted


def measure_optimizer_state(optimizer: Any) -> StateMeasurement:
    """Measure the bytes an optimizer's state really holds.

    Unwraps accelerate's `AcceleratedOptimizer`, DeepSpeed's wrappers and transformers'
    `LayerWiseDummyOptimizer`; counts tensor subclasses by the storage inside them, a DTensor by its
    local shard, and each storage once; walks dicts, lists and objects inside the state; passes
    over plain Python values and meta tensors. Reads metadata only and adds no entry to
    `optimizer.state`.

    Args:
        optimizer: a `torch.optim.Optimizer`, or any of the wrappers above.

    Example:
        >>> import torch
        >>> from trainer_memcb import measure_optimizer_state
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.AdamW(layer.parameters())
        >>> layer(torch.ones(1, 4)).sum().backward()
        >>> optimizer.step()
        >>> measured = measure_optimizer_state(optimizer)
        >>> measured.num_bytes  # (8 + 2) values x 2 moments x 4 bytes + 2 step tensors x 4 bytes
        88
        >>> measured.bytes_by_key["exp_avg"]
        40
    """
    tally = _Tally()
    num_params_with_state = 0
    for inner in inner_optimizers(optimizer):
        state = getattr(inner, "state", None)
        if not isinstance(state, Mapping):
            continue
        # Iterating a defaultdict's items never inserts; indexing it would.
        for param_state in list(state.values()):
            if not isinstance(param_state, Mapping):
                if tally.add_value("<state>", param_state, 0, set()):
                    num_params_with_state += 1
                continue
            holds_tensor = False
            for key, value in list(param_state.items()):
                holds_tensor = tally.add_value(str(key), value, 0, set()) or holds_tensor
            num_params_with_state += holds_tensor
    return StateMeasurement(
        num_bytes=tally.num_bytes,
        num_elements=tally.num_elements,
        num_tensors=tally.num_tensors,
        num_params_with_state=num_params_with_state,
        bytes_by_key=dict(tally.bytes_by_key),
        bytes_by_dtype=dict(tally.bytes_by_dtype),
        bytes_by_device=dict(tally.bytes_by_device),
        elements_by_key=dict(tally.elements_by_key),
    )
