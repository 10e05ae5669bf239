"""A memory snapshot file, read safely: what `torch.cuda.memory._dump_snapshot()` wrote.

The file is a pickle, and a pickle can name any Python global and call it while loading: a hostile
file runs a command the moment `pickle.load` meets it. A snapshot needs no global (it is dicts,
lists, strings and numbers), so `_NoGlobals.find_class` refuses every one: nothing in the file is
ever imported or called. What is kept is what the allocator's replay reads (frames are dropped):

- `segments`: the allocator's segments at the dump (`DeviceCachingAllocator::snapshot`), each with
  its blocks (address, size, requested size, state);
- `device_traces`: per device, the recorded events (`TraceEntry`: `alloc`, `free_requested`,
  `free_completed`, `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`, `oom`,
  `snapshot`), as `(action, address, bytes, stream)`;
- `allocator_settings`, where the dump has them (torch 2.6 and later).

Any file that is not such a dump (missing, a directory, not a pickle, cut short, a global named,
the wrong structure) is a `SnapshotError` whose message is one line naming the file.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["BlockRecord", "SegmentRecord", "Snapshot", "SnapshotError", "read_snapshot"]


class SnapshotError(ValueError):
    """A file that is not a memory snapshot this can read; the message is one line."""


class _NoGlobals(pickle.Unpickler):
    """An unpickler that refuses every global and every persistent id: it builds only dicts,
    lists, tuples, strings, bytes and numbers."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(f"names the Python global {module}.{name}; a memory snapshot names "
                            "none, so it is refused and nothing in it was run")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError("holds a persistent id; a memory snapshot holds none")


@dataclass(frozen=True)
class BlockRecord:
    """One block of a dumped segment: address, size, requested bytes, and torch's state
    (`active_allocated`, `active_pending_free`, `inactive`)."""

    address: int
    size: int
    requested_size: int
    state: str

    @property
    def allocated(self) -> bool:
        """Not in the cache: allocated, or freed and waiting on another stream."""
        return self.state in ("active_allocated", "active_pending_free")


@dataclass(frozen=True)
class SegmentRecord:
    """One dumped segment: one `cudaMalloc`, or one mapped range of an expandable segment."""

    device: int
    address: int
    total_size: int
    stream: int
    small: bool
    expandable: bool
    blocks: Tuple[BlockRecord, ...]


@dataclass(frozen=True)
class Snapshot:
    """A dumped snapshot, as `read_snapshot` reads it.

    Attributes:
        segments: the segments at the dump, every device's.
        device_traces: per device, its events as `(action, address, bytes, stream)`.
        allocator_settings: the allocator's settings the dump recorded, or None.
        plan_parts: per device, each event's part where its innermost frame is one the plan
            writes (`estimate --write-snapshot`: file `<plan>`, name `"PHASE: PART"`), else "";
            `()` for a dump whose frames name no part.
        release_callers: per device, for each segment release (`segment_free`,
            `segment_unmap`) recorded with its stack, who released it: "empty_cache" (the
            program's `torch.cuda.empty_cache()`, named in its frames) or "allocator" (the caching
            allocator itself, on a failed `cudaMalloc`); releases without frames are left out.
    """

    segments: Tuple[SegmentRecord, ...]
    device_traces: Tuple[Tuple[Tuple[str, int, int, int], ...], ...]
    allocator_settings: Optional[Dict[str, Any]]
    plan_parts: Tuple[Tuple[str, ...], ...] = ()
    release_callers: Tuple[Dict[int, str], ...] = ()


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _segment(raw: Any, place: str) -> SegmentRecord:
    if not isinstance(raw, dict):
        raise SnapshotError(f"{place} is not a segment (a dict)")
    try:
        blocks = tuple(BlockRecord(block["address"], block["size"],
                                   block.get("requested_size", 0), block["state"])
                       for block in raw["blocks"])
        record = SegmentRecord(raw.get("device", 0), raw["address"], raw["total_size"],
                               raw.get("stream", 0), raw["segment_type"] == "small",
                               bool(raw.get("is_expandable", False)), blocks)
    except (KeyError, TypeError, AttributeError) as error:
        raise SnapshotError(f"{place} lacks {error} or is not a segment") from None
    numbers = [record.device, record.address, record.total_size, record.stream]
    numbers += [n for b in blocks for n in (b.address, b.size, b.requested_size)]
    if not all(_whole(n) for n in numbers) or not all(isinstance(b.state, str) for b in blocks):
        raise SnapshotError(f"{place} holds a value of the wrong type")
    return record


def _event(raw: Any, place: str) -> Tuple[str, int, int, int]:
    try:
        event = (raw["action"], raw.get("addr", 0), raw.get("size", 0), raw.get("stream", 0))
    except (KeyError, TypeError, AttributeError):
        raise SnapshotError(f"{place} is not a trace event (a dict with an action)") from None
    if not isinstance(event[0], str) or not all(_whole(n) for n in event[1:]):
        raise SnapshotError(f"{place} holds a value of the wrong type")
    return event


# The `filename` of the frames the plan writes (`trainer_memcb.plan.answers.plan_snapshot.PLAN_FRAME_FILE`).
_PLAN_FRAME_FILE = "<plan>"


def _plan_part(raw: Any) -> str:
    """The part a plan's event names in its innermost frame ("backward: activations" -> "activations")."""
    frames = raw.get("frames") if isinstance(raw, dict) else None
    if isinstance(frames, list) and frames and isinstance(frames[0], dict) \
            and frames[0].get("filename") == _PLAN_FRAME_FILE and isinstance(frames[0].get("name"), str):
        return frames[0]["name"].rpartition(": ")[2]
    return ""


def _release_callers(trace: Any) -> Dict[int, str]:
    """Who released each segment of `trace` whose event holds frames (`Snapshot.release_callers`):
    a frame named after `empty_cache` (torch/cuda/memory.py's, or the allocator's `emptyCache`)
    is the program's call; any other stack is the allocator's own release inside `malloc`."""
    callers: Dict[int, str] = {}
    for index, raw in enumerate(trace):
        if not isinstance(raw, dict) or raw.get("action") not in ("segment_free", "segment_unmap"):
            continue
        frames = raw.get("frames")
        if not isinstance(frames, list) or not frames:
            continue
        names = [frame.get("name") for frame in frames if isinstance(frame, dict)]
        emptied = any(isinstance(name, str) and ("empty_cache" in name or "emptyCache" in name) for name in names)
        callers[index] = "empty_cache" if emptied else "allocator"
    return callers


def read_snapshot(path: Any) -> Snapshot:
    """Read a `torch.cuda.memory._dump_snapshot()` file without running anything in it.

    Args:
        path: the file (a `str` or `os.PathLike`).

    Returns:
        A `Snapshot`: the segments, each device's trace, the recorded allocator settings.

    Raises:
        SnapshotError: the file is missing, unreadable, not a pickle, cut short, names a Python
            global (refused before anything is imported), or is not shaped like a snapshot; the
            message is one line that starts with the file's name.
    """
    try:
        with open(path, "rb") as stream:
            data = _NoGlobals(stream).load()
        if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
            raise SnapshotError("is not a memory snapshot: no 'segments' list (write one with "
                                "torch.cuda.memory._dump_snapshot)")
        traces = data.get("device_traces", [])
        if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
            raise SnapshotError("is not a memory snapshot: 'device_traces' is not a list of lists")
        settings = data.get("allocator_settings")
        segments = tuple(_segment(raw, f"segment {index}")
                         for index, raw in enumerate(data["segments"]))
        device_traces = tuple(tuple(_event(raw, f"device {device} event {index}")
                                    for index, raw in enumerate(trace))
                              for device, trace in enumerate(traces))
        plan_parts = tuple(tuple(_plan_part(raw) for raw in trace) for trace in traces)
        if not any(part for parts in plan_parts for part in parts):
            plan_parts = ()
        release_callers = tuple(_release_callers(trace) for trace in traces)
    except SnapshotError as error:
        raise SnapshotError(f"{path}: {error}") from None
    except OSError as error:
        raise SnapshotError(f"{path}: cannot be read: {error.strerror or error}") from None
    except EOFError:
        raise SnapshotError(f"{path}: is cut short (the pickle ends before its end mark)") from None
    except RecursionError:
        raise SnapshotError(f"{path}: is nested too deeply to be a memory snapshot") from None
    except Exception as error:  # pickle's own errors are of many types (ValueError, KeyError...)
        if "truncated" in str(error):
            raise SnapshotError(f"{path}: is cut short ({error})") from None
        raise SnapshotError(f"{path}: is not a pickle this can read "
                            f"({type(error).__name__}: {error})") from None
    return Snapshot(segments, device_traces, settings if isinstance(settings, dict) else None, plan_parts,
                    release_callers)
