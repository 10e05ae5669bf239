"""Measure the bytes an optimizer's state really holds, from tensor metadata alone.

Nothing here copies a tensor, reads a value (`.item()`), synchronises a device or talks to other
processes: sizes, dtypes, devices and storage addresses are all metadata on the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from math import gcd
from operator import attrgetter, itemgetter
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from trainer_memcb.registry import state_of
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
        num_params_with_state: state entries holding at least one storage not counted before: one
            per parameter, plus any group- or optimizer-wide entry where the optimizer's class keeps
            one (torch-optimi's per-group `step`, bitsandbytes' maps when no parameter is 8-bit).
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


# Per device, its name: `str(tensor.device)` costs over a microsecond per tensor, a state holds
# hundreds of tensors, and a run has a handful of devices.
_DEVICE_NAMES: Dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def _collect_value(found: List[Tuple[int, str, torch.Tensor]], owner: int, key: str, value: Any, depth: int,
                   visiting: Set[int]) -> None:
    """Append `(owner, key, plain tensor)` for every tensor inside a state value: a tensor, a
    container, or an object with tensors as attributes (GaLore's projector). Plain Python values
    hold no tensor memory."""
    if isinstance(value, torch.Tensor):
        found.extend((owner, key, plain) for plain in _plain_tensors(value))
        return
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return
    if depth >= _MAX_NESTING or id(value) in visiting:
        return
    if isinstance(value, Mapping):
        children = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    else:
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            return
        children = list(attributes.values())
    visiting.add(id(value))
    for child in children:
        _collect_value(found, owner, key, child, depth + 1, visiting)
    visiting.discard(id(value))


def _all_states(optimizer: Any) -> List[Any]:
    """Every per-parameter state of the optimizer, in order, read where the optimizer's class keeps
    it (`trainer_memcb.registry`): in `optimizer.state` unless its rule declares another place, as
    the estimate does."""
    inners = inner_optimizers(optimizer)
    if len(inners) == 1:
        return state_of(inners[0])
    return [param_state for inner in inners for param_state in state_of(inner)]


def _state_tensors(states: Sequence[Any]) -> List[Tuple[int, str, torch.Tensor]]:
    """`(parameter number, state key, plain tensor)` for every tensor in the states, in order."""
    found: List[Tuple[int, str, torch.Tensor]] = []
    owner = 0
    for param_state in states:
        owner += 1
        if type(param_state) is not dict and not isinstance(param_state, Mapping):
            _collect_value(found, owner, "<state>", param_state, 0, set())
            continue
        for key, value in list(param_state.items()):
            name = key if type(key) is str else str(key)
            if type(value) is torch.Tensor:  # the common case, no walk needed
                found.append((owner, name, value))
            else:
                _collect_value(found, owner, name, value, 0, set())
    return found


def _count(found: List[Tuple[int, str, torch.Tensor]]) -> StateMeasurement:
    """Add up the storages behind `found`, each once. This loop runs at every logged step over
    every state tensor, so it does only what must be done per tensor: read the storage's device,
    address and size, and file its size under its (state key, dtype, device). Element counts and
    the breakdowns are worked out per part after the loop."""
    parts: Dict[Tuple[str, torch.dtype, str], List[int]] = {}  # -> the sizes of its storages
    # Storages counted, as (device, address, size), looked up by address: an int key hashes at
    # once, where a tuple key would be hashed anew at each lookup. A later storage at a counted
    # address is the same storage again (a view, bitsandbytes' shared qmaps) unless its device or
    # size differs; the rare different ones go to `more_at_counted_address`.
    counted_at: Dict[int, Tuple[str, int, int]] = {}
    more_at_counted_address: Set[Tuple[str, int, int]] = set()
    num_params_with_state = 0
    last_owner = 0  # `found` comes parameter by parameter, so a new owner is a new parameter
    for owner, key, plain in found:
        device = "cpu" if plain.is_cpu else _device_name(plain.device)
        if device == "meta":
            continue  # a meta tensor has a shape and no memory
        storage = plain.untyped_storage()
        num_bytes = storage.nbytes()
        address = storage.data_ptr()
        identity = (device, address, num_bytes)
        if address in counted_at:
            if identity == counted_at[address] or identity in more_at_counted_address:
                continue  # already counted once
            more_at_counted_address.add(identity)
        elif address != 0:  # storages without memory have address 0: each counts (0 bytes)
            counted_at[address] = identity
        # A storage counts whole: a view into a larger buffer keeps the whole buffer alive.
        part = (key, plain.dtype, device)
        sizes = parts.get(part)
        if sizes is None:
            parts[part] = [num_bytes]
        else:
            sizes.append(num_bytes)
        if owner != last_owner:
            num_params_with_state += 1
            last_owner = owner

    totals: List[Tuple[str, torch.dtype, str, int, int, int]] = []
    for (key, dtype, device), sizes in parts.items():
        # Per storage, whole elements only (a storage need not hold a whole number of them).
        element_size = dtype.itemsize
        part_elements = sum(size // element_size for size in sizes) if element_size else 0
        totals.append((key, dtype, device, sum(sizes), part_elements, len(sizes)))
    return _summarise(totals, num_params_with_state)


def _summarise(parts: Sequence[Tuple[str, torch.dtype, str, int, int, int]],
               num_params_with_state: int) -> StateMeasurement:
    """The measurement from its parts, each `(state key, dtype, device, bytes, elements, storages)`
    in the order of their first storage: every breakdown lists its names in that order."""
    num_bytes = num_elements = num_tensors = 0
    bytes_by_key: Dict[str, int] = {}
    bytes_by_dtype: Dict[str, int] = {}
    bytes_by_device: Dict[str, int] = {}
    elements_by_key: Dict[str, int] = {}
    for key, dtype, device, part_bytes, part_elements, part_tensors in parts:
        name = dtype_name(dtype)
        num_bytes += part_bytes
        num_elements += part_elements
        num_tensors += part_tensors
        bytes_by_key[key] = bytes_by_key.get(key, 0) + part_bytes
        bytes_by_dtype[name] = bytes_by_dtype.get(name, 0) + part_bytes
        bytes_by_device[device] = bytes_by_device.get(device, 0) + part_bytes
        elements_by_key[key] = elements_by_key.get(key, 0) + part_elements
    return StateMeasurement(
        num_bytes=num_bytes,
        num_elements=num_elements,
        num_tensors=num_tensors,
        num_params_with_state=num_params_with_state,
        bytes_by_key=bytes_by_key,
        bytes_by_dtype=bytes_by_dtype,
        bytes_by_device=bytes_by_device,
        elements_by_key=elements_by_key,
    )


# -- the common state, column by column ---------------------------------------------------------
#
# Most states are one plain dict per parameter, all with the same keys, each key holding plain
# tensors of one dtype on one device (or a plain number, like bitsandbytes' `step`), with no storage
# held twice. Such a state is read one key (column) at a time, each metadata read mapped over the
# whole column by C code rather than stepped through by the interpreter: the same reads as `_count`
# (every tensor's storage, its size and address, its dtype and device, at every call: nothing is
# remembered between calls), with the same figures. Anything else returns None and goes to
# `_count`, which handles every case.

_UNTYPED_STORAGE = torch.Tensor.untyped_storage
_STORAGE_ADDRESS = torch.UntypedStorage.data_ptr
_DTYPE = attrgetter("dtype")
_IS_CPU = attrgetter("is_cpu")
_DEVICE = attrgetter("device")
# Values that hold no tensor memory and that `_collect_value` passes over.
_PLAIN_VALUES = frozenset({type(None), bool, int, float, complex, str, bytes})


def _count_columns(states: Sequence[Any]) -> Optional[StateMeasurement]:
    """The measurement of a state of the common shape above, or None if it has another."""
    num_states = len(states)
    if not num_states:
        return None
    first = states[0]
    if type(first) is not dict:
        return None
    # Every state a plain dict with as many keys as the first; each of the first's keys is looked
    # up in all of them below, so all hold the same keys.
    if sum(map(len, states)) != num_states * len(first) or list(map(type, states)).count(dict) != num_states:
        return None
    parts: List[Tuple[str, torch.dtype, str, int, int, int]] = []
    addresses: List[int] = []
    try:
        for key in first:
            if type(key) is not str:
                return None
            column = list(map(itemgetter(key), states))
            if list(map(type, column)).count(torch.Tensor) != num_states:
                if set(map(type, column)) <= _PLAIN_VALUES:
                    continue
                return None
            storages = list(map(_UNTYPED_STORAGE, column))
            sizes = list(map(len, storages))  # `len` of an untyped storage is its `nbytes()`
            addresses += map(_STORAGE_ADDRESS, storages)
            dtypes = list(map(_DTYPE, column))
            dtype = dtypes[0]
            if dtypes.count(dtype) != num_states:
                return None
            if list(map(_IS_CPU, column)).count(True) == num_states:
                device = "cpu"
            else:
                devices = list(map(_DEVICE, column))
                if devices.count(devices[0]) != num_states:
                    return None
                device = _device_name(devices[0])
                if device == "meta" or device == "cpu":
                    return None  # no memory, or some but not all on the CPU: `_count` sorts it out
            part_bytes = sum(sizes)
            element_size = dtype.itemsize
            if not element_size:
                part_elements = 0
            elif not gcd(*sizes) % element_size:
                # The element size divides every size: the whole elements of all the storages are
                # the elements of their total.
                part_elements = part_bytes // element_size
            else:
                part_elements = sum(size // element_size for size in sizes)
            parts.append((key, dtype, device, part_bytes, part_elements, num_states))
    except (KeyError, NotImplementedError, RuntimeError, TypeError):
        return None  # a key some state lacks, a storage that cannot be read (sparse): `_count`'s case
    # No address twice (at most one 0, a storage without memory): every storage counts once.
    if not parts or len(set(addresses)) != len(addresses):
        return None
    # Every state holds a tensor of each tensor key, none passed over: each is a parameter with state.
    return _summarise(parts, num_states)


# A sparse tensor has no storage of its own; these hold its data, per layout.
_SPARSE_COMPONENTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _with_sparse_components(found: List[Tuple[int, str, torch.Tensor]]) -> Optional[List[Tuple[int, str, torch.Tensor]]]:
    """`found` with each sparse tensor replaced by the dense tensors holding its indices and
    values (views, no copies), in place so that parameters stay in order; None if none is sparse."""
    expanded: List[Tuple[int, str, torch.Tensor]] = []
    any_sparse = False
    for owner, key, tensor in found:
        names = _SPARSE_COMPONENTS.get(tensor.layout)
        if names is None:
            expanded.append((owner, key, tensor))
            continue
        any_sparse = True
        expanded.extend((owner, key, getattr(tensor, name)()) for name in names)
    return expanded if any_sparse else None


def measure_optimizer_state(optimizer: Any) -> StateMeasurement:
    """Measure the bytes an optimizer's state really holds.

    Unwraps accelerate's `AcceleratedOptimizer`, DeepSpeed's wrappers and transformers'
    `LayerWiseDummyOptimizer`; counts tensor subclasses by the storage inside them, a DTensor by its
    local shard, and each storage once; walks dicts, lists and objects inside the state; passes
    over plain Python values and meta tensors; counts a sparse tensor by the storages of its indices
    and values. Reads metadata only and adds no entry to `optimizer.state`.

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
    states = _all_states(optimizer)
    measured = _count_columns(states)
    if measured is not None:
        return measured
    found = _state_tensors(states)
    try:
        return _count(found)
    except (NotImplementedError, RuntimeError):
        # A sparse tensor has no storage to ask for. Rare, so it is looked for only once asking
        # failed: the common path stays free of a per-tensor layout check.
        expanded = _with_sparse_components(found)
        if expanded is None:
            raise
        return _count(expanded)
