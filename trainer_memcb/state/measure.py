"""Measure the bytes an optimizer's state really holds, from tensor metadata alone.

Nothing here copies a tensor, reads a value (`.item()`), synchronises a device or talks to other
processes: sizes, dtypes, devices and storage addresses are all metadata on the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from math import gcd
from operator import attrgetter, itemgetter
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from trainer_memcb.state.registry import state_of
from trainer_memcb.state.unwrap import inner_optimizers

__all__ = ["StateMeasurement", "measure_optimizer_state", "dtype_name"]

# Containers inside a state are walked this deep at most; real ones (GaLore's projector objects,
# lists of tensors) are one or two levels deep, and the limit keeps a cyclic object finite.
_MAX_NESTING = 6


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`, the spelling used in every breakdown."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


# Per dtype, its name, worked out once: a handful of dtypes, named at every measurement.
_DTYPE_NAMES: Dict[torch.dtype, str] = {}


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
    it (`trainer_memcb.state.registry`): in `optimizer.state` unless its rule declares another place, as
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
# Most states are one plain dict per parameter, with the same keys for every parameter (or for
# each of a few groups of them: bitsandbytes keeps 8-bit and 32-bit states side by side), each key
# holding plain tensors of one dtype on one device, or plain numbers (bitsandbytes' `step`). A key
# of such a group is a column; its tensors are all different storages, or one and the same tensor
# throughout (bitsandbytes' quantization maps, shared by every 8-bit state). Such a state is read a
# column at a time, each metadata read mapped over the whole column by C code rather than stepped
# through by the interpreter: the same reads as `_count` (every tensor's storage, its size and
# address, its dtype and device, at every call: nothing about a tensor is remembered between calls), with the
# same figures in the same order. Anything else returns None and goes to `_count`, which handles
# every case.

_UNTYPED_STORAGE = torch.Tensor.untyped_storage
_STORAGE_ADDRESS = torch.UntypedStorage.data_ptr
_DTYPE = attrgetter("dtype")
_IS_CPU = attrgetter("is_cpu")
_DEVICE = attrgetter("device")
# Values that hold no tensor memory and that `_collect_value` passes over.
_PLAIN_VALUES = frozenset({type(None), bool, int, float, complex, str, bytes})


# The last list of counted addresses found to hold no address twice. The callback measures the same
# state at every logged step, and between two steps its storages stay where they are: comparing
# the new list with this one, int by int, costs a tenth of building the set that finds a repeat.
# Only the values are remembered, never a tensor or what it was, so nothing here can go stale.
_distinct_addresses: List[List[int]] = [[]]


class _NotColumns(Exception):
    """The state is not of the shape the column reading handles."""


class _Column(NamedTuple):
    """The tensors one key holds in one group of states with the same keys."""

    position: Tuple[int, int]  # (first state, key's place in it): where `_count` meets it first
    key: str
    dtype: torch.dtype
    device: str
    sizes: List[int]
    addresses: List[int]
    shared: Optional[torch.Tensor]  # the one tensor held by every state of the group, or None


def _column(states: Sequence[Any], key: Any, position: Tuple[int, int]) -> Optional[_Column]:
    """Column `key` of `states`; None for a column of plain numbers (no memory). Raises
    `_NotColumns` for anything else, and KeyError where a state lacks the key."""
    if type(key) is not str:
        raise _NotColumns
    count = len(states)
    column = list(map(itemgetter(key), states))
    if list(map(type, column)).count(torch.Tensor) != count:
        if set(map(type, column)) <= _PLAIN_VALUES:
            return None
        raise _NotColumns
    # One tensor throughout (or a column of one), by identity only: `list.count` would compare the
    # tensors' values. Distinct tensors almost always differ at the ends already.
    shared = None
    if column[-1] is column[0] and (count == 1 or list(map(id, column)).count(id(column[0])) == count):
        shared = column[0]
    if shared is not None and count > 1:
        column = [shared]  # the same tensor throughout: read it once
        count = 1
    storages = list(map(_UNTYPED_STORAGE, column))
    dtypes = list(map(_DTYPE, column))
    if dtypes.count(dtypes[0]) != count:
        raise _NotColumns
    if list(map(_IS_CPU, column)).count(True) == count:
        device = "cpu"
    else:
        devices = list(map(_DEVICE, column))
        if devices.count(devices[0]) != count:
            raise _NotColumns
        device = _device_name(devices[0])
        if device == "meta" or device == "cpu":
            raise _NotColumns  # no memory, or some but not all on the CPU: `_count` sorts it out
    return _Column(position=position, key=key, dtype=dtypes[0], device=device,
                   sizes=list(map(len, storages)),  # `len` of an untyped storage is its `nbytes()`
                   addresses=list(map(_STORAGE_ADDRESS, storages)), shared=shared)


def _columns(states: Sequence[Any]) -> Tuple[List[_Column], List[Tuple[int, int]]]:
    """The tensor columns of `states`, and per group of states with the same keys, (its first
    state, its number of states). Raises `_NotColumns` or KeyError for another shape."""
    first = states[0]
    if sum(map(len, states)) == len(states) * len(first):
        try:  # one group, the common case: every state has the first one's keys
            columns = [_column(states, key, (0, place)) for place, key in enumerate(first)]
            return [column for column in columns if column is not None], [(0, len(states))]
        except KeyError:
            pass
    members: Dict[Tuple[Any, ...], List[int]] = {}
    for index, layout in enumerate(map(tuple, states)):
        group = members.get(layout)
        if group is None:
            members[layout] = [index]
        else:
            group.append(index)
    found: List[_Column] = []
    groups: List[Tuple[int, int]] = []
    for layout, indices in members.items():
        group_states = list(map(states.__getitem__, indices))
        for place, key in enumerate(layout):
            column = _column(group_states, key, (indices[0], place))
            if column is not None:
                found.append(column)
        groups.append((indices[0], len(indices)))
    return found, groups


def _count_columns(states: Sequence[Any]) -> Optional[StateMeasurement]:
    """The measurement of a state of the shape above, or None if it has another."""
    if not states or list(map(type, states)).count(dict) != len(states):
        return None
    try:
        columns, groups = _columns(states)
    except (_NotColumns, KeyError, NotImplementedError, RuntimeError, TypeError):
        return None  # another shape, or a storage that cannot be read (sparse): `_count`'s case
    if not columns:
        return None
    # Columns come in the order `_count` meets them: groups by their first state, keys in place.
    # A tensor held throughout a column counts once, where `_count` meets it first.
    shared = [column for column in columns if column.shared is not None]
    counted = columns
    if shared:
        first_seen: Dict[int, _Column] = {}
        counted = [column for column in columns
                   if column.shared is None or first_seen.setdefault(id(column.shared), column) is column]
    # No address twice among the storages counted (at most one 0, a storage without memory), so
    # `_count` would skip none of them.
    addresses: List[int] = []
    for column in counted:
        addresses += column.addresses
    if addresses != _distinct_addresses[0]:  # compared by value: the same list, the same answer
        if len(set(addresses)) != len(addresses):
            return None
        _distinct_addresses[0] = addresses
    # A state has state if it holds a storage counted: every state of a group with a column of
    # distinct storages; in a group whose tensors are all held throughout, only its first state,
    # and only if it is where one of them is met first.
    if not shared and len(groups) == 1:
        num_params_with_state = groups[0][1]
    else:
        holding: Dict[int, bool] = {}  # group's first state -> whether it has a column of distinct storages
        for column in counted:
            first = column.position[0]
            holding[first] = holding.get(first, False) or column.shared is None
        num_params_with_state = sum(count if holding[first] else 1 for first, count in groups if first in holding)
    # One part per column: `_summarise` adds up parts of the same key, dtype or device itself, in
    # the order they first come, which is the order `_count` meets them.
    parts: List[Tuple[str, torch.dtype, str, int, int, int]] = []
    for column in counted:
        sizes = column.sizes
        column_bytes = sum(sizes)
        element_size = column.dtype.itemsize
        if not element_size:
            column_elements = 0
        elif not gcd(*sizes) % element_size:
            # The element size divides every size: the whole elements of all the storages are the
            # elements of their total.
            column_elements = column_bytes // element_size
        else:
            column_elements = sum(size // element_size for size in sizes)
        parts.append((column.key, column.dtype, column.device, column_bytes, column_elements, len(sizes)))
    return _summarise(parts, num_params_with_state)


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

    Examples:
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
