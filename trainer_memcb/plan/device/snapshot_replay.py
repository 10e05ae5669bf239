"""A recorded snapshot replayed through the caching allocator model: real against replayed, and what-ifs.

For each device of a `Snapshot` (`snapshot_file.read_snapshot`):

- **the start, rebuilt**: recording rarely begins with an empty allocator. The segments alive when
  it began are the dump's segments with the trace's segment events undone (a `segment_alloc`
  removed, a `segment_free` put back); the blocks allocated then are those the trace frees
  without having allocated them (their size is `round_size` of the requested bytes, grown to the
  next block where the large pool would not have split the rest, `should_split`), and those
  still allocated at the dump that the trace never allocated (their size from the dump).
- **real**: the reserved bytes over the trace, from that start and the segment events
  (`segment_alloc`/`segment_map` add, `segment_free`/`segment_unmap` take away), and their peak.
- **replayed**: the trace's allocations (`alloc`) and completed frees (`free_completed`, so a free
  delayed by `record_stream` completes where the GPU completed it) through
  `CachingAllocatorModel` under the recorded settings, new segments placed at the addresses the
  GPU's `cudaMalloc` returned while the two agree (addresses only break ties between free blocks
  of one size). A run of `segment_free` events followed by no new segment is the program's
  `torch.cuda.empty_cache()` (which records no event of its own) and is replayed as one. The
  segments the model creates and frees are matched against the real ones, in order: the first
  that differs is `first_divergence`.
- **what-ifs**: the same allocations, from the same start, under other settings or another
  device size: the reserved peak and whether the trace would have run out of memory.

The device's capacity: what the caller gives; else, from the trace's `oom` event (torch records
the device's free bytes in its address field, `DeviceCachingAllocator::malloc`), the reserved
bytes then plus that; else from its release-and-retry bursts: where a `cudaMalloc` of S bytes
failed at R bytes reserved, the allocator released cached segments (a run of releases its frames
name no `empty_cache` for) down to R' and the retry took S, so the capacity is at least R' + S and
below R + S; the bursts' bounds together give a range, and the replay takes its least (the most the
trace shows the device surely had). Without frames a burst cannot be told from the program's
`empty_cache()` followed by a new segment, nor with a `garbage_collection_threshold` (whose
releases come before any `cudaMalloc` fails): then the capacity is unknown (no limit).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from trainer_memcb.plan.device.alloc_conf import AllocConf, parse_alloc_conf
from trainer_memcb.plan.device.caching_allocator import (
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    CachingAllocatorModel,
    OutOfMemory,
    round_size,
)
from trainer_memcb.plan.device.snapshot_file import Snapshot, read_snapshot

__all__ = ["Divergence", "DeviceReplay", "SegmentFigures", "SnapshotReplay", "WhatIf",
           "recorded_alloc_conf", "replay_snapshot"]

MiB = 1024 ** 2
_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")
Event = Tuple[str, int, int, int]


@dataclass(frozen=True)
class SegmentFigures:
    """The reserved peak over the trace, and the segments created and freed in it (with
    expandable segments, the mappings and unmappings)."""

    reserved_peak_bytes: int
    segments_created: int
    segments_freed: int


@dataclass(frozen=True)
class Divergence:
    """Where the replay first parts from the real trace: the real event's index and action, and why."""

    event_index: int
    action: str
    reason: str


@dataclass(frozen=True)
class WhatIf:
    """The same allocations under `alloc_conf` on a device of `device_memory_bytes` (None: no
    limit): the reserved peak, and whether they would run out of memory."""

    alloc_conf: str
    device_memory_bytes: Optional[int]
    reserved_peak_bytes: int
    oom: bool


@dataclass(frozen=True)
class DeviceReplay:
    """One device's trace, real and replayed.

    Attributes:
        device: the device's index.
        events: the events recorded.
        streams: the streams the events name.
        alloc_conf: the recorded settings as a `PYTORCH_CUDA_ALLOC_CONF` string ("" for torch's
            defaults, and when the dump recorded none).
        settings_recorded: whether the dump recorded its allocator settings.
        capacity_bytes: the device memory the replay was given, or None.
        capacity_source: where it came from: "given", "oom event", "retry bursts" or "unknown".
        capacity_range_bytes: with "retry bursts", the least and the most capacity the bursts
            allow (the replay takes the least); else None.
        start_reserved_bytes: reserved when recording began (the rebuilt start).
        real: the GPU's figures; replayed: the model's.
        first_divergence: None when the replay creates and frees the real segments, in order.
        what_if: the what-ifs.
    """

    device: int
    events: int
    streams: Tuple[int, ...]
    alloc_conf: str
    settings_recorded: bool
    capacity_bytes: Optional[int]
    capacity_source: str
    start_reserved_bytes: int
    real: SegmentFigures
    replayed: SegmentFigures
    first_divergence: Optional[Divergence]
    what_if: Tuple[WhatIf, ...]
    capacity_range_bytes: Optional[Tuple[int, int]] = None


@dataclass(frozen=True)
class SnapshotReplay:
    """Every device of a snapshot that recorded events."""

    devices: Tuple[DeviceReplay, ...]


def recorded_alloc_conf(settings: Optional[Dict[str, Any]]) -> str:
    """The dump's `allocator_settings` as a `PYTORCH_CUDA_ALLOC_CONF` string (the keys the model
    reads: expandable_segments, max_split_size_mb, roundup_power2_divisions); "" for defaults."""
    if not settings:
        return ""
    parts = []
    if settings.get("expandable_segments") is True:
        parts.append("expandable_segments:True")
    max_split = settings.get("max_split_size")
    if isinstance(max_split, int) and 0 < max_split < 2 ** 63:
        parts.append(f"max_split_size_mb:{max_split // MiB}")
    divisions = settings.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and any(divisions.values()):
        text = ",".join(f"{key}:{value}" for key, value in divisions.items())
        parts.append(f"roundup_power2_divisions:[{text}]")
    return ",".join(parts)


@dataclass
class _Start:
    """The allocator's state when recording began: its `cudaMalloc` segments `(address, size,
    small, stream, blocks)`; its expandable segments, one per pool and stream, `(base, mapped
    ranges, small, stream, blocks)`; and the bytes reserved."""

    segments: List[Tuple[int, int, bool, int, List[Tuple[int, int, Any, int]]]]
    reserved: int
    expandables: List[Tuple[int, List[Tuple[int, int]], bool, int, List[Tuple[int, int, Any, int]]]] = \
        field(default_factory=list)


def _without(ranges: Dict[int, Tuple[int, int, bool]], low: int, high: int) -> None:
    """Take [low, high) out of `ranges` (start -> (end, stream, small)), splitting what it cuts."""
    for start, (end, stream, small) in list(ranges.items()):
        if end <= low or start >= high:
            continue
        del ranges[start]
        if start < low:
            ranges[start] = (low, stream, small)
        if end > high:
            ranges[high] = (end, stream, small)


def _with(ranges: Dict[int, Tuple[int, int, bool]], low: int, high: int, stream: int, small: bool) -> None:
    """Put [low, high) into `ranges`, merged with the ranges of its pool and stream it touches."""
    for start, (end, other_stream, other_small) in list(ranges.items()):
        if (other_stream, other_small) == (stream, small) and end >= low and start <= high:
            del ranges[start]
            low, high = min(low, start), max(high, end)
    ranges[low] = (high, stream, small)


def _mapped_at_start(snapshot: Snapshot, device: int, trace: Sequence[Event],
                     large_page: int) -> Dict[int, Tuple[int, int, bool]]:
    """The mapped ranges of expandable segments when recording began: the dump's, with the
    trace's mappings undone (a range's pool: the small pool's where its bytes are no whole number
    of large pages, else that of the dump's range of its stream nearest to it if that lies within
    the bytes ever mapped of it (one segment's pages lie so close; two segments' address spaces,
    each the device's memory and an eighth, lie farther apart), else the large)."""
    ranges = {s.address: (s.address + s.total_size, s.stream, s.small)
              for s in snapshot.segments if s.device == device and s.expandable}
    known = sorted((start, small, stream) for start, (_, stream, small) in ranges.items())
    span = sum(end - start for start, (end, _, _) in ranges.items()) + sum(
        size for action, _, size, _ in trace if action == "segment_map")
    for action, addr, size, stream in reversed(trace):
        if action == "segment_map":
            _without(ranges, addr, addr + size)
        elif action == "segment_unmap":
            near = [(abs(start - addr), small) for start, small, s in known
                    if s == stream and abs(start - addr) <= span]
            small = size % large_page != 0 or (min(near)[1] if near else False)
            _with(ranges, addr, addr + size, stream, small)
    return ranges


def _rebuild_start(snapshot: Snapshot, device: int, trace: Sequence[Event],
                   conf: AllocConf) -> _Start:
    alive: Dict[int, Tuple[int, int, bool, bool]] = {
        s.address: (s.total_size, s.stream, s.small, False)
        for s in snapshot.segments if s.device == device and not s.expandable}
    for action, addr, size, stream in reversed(trace):
        if action == "segment_alloc":
            alive.pop(addr, None)
        elif action == "segment_free":
            alive[addr] = (size, stream, size == K_SMALL_BUFFER, False)
    for start, (end, stream, small) in _mapped_at_start(snapshot, device, trace,
                                                        conf.large_segment_size_bytes).items():
        alive[start] = (end - start, stream, small, True)
    # Allocations alive at the start: freed in the trace before any alloc there, or allocated at
    # the dump and never allocated in the trace.
    in_trace: set = set()
    before: Dict[int, int] = {}  # addr -> requested bytes
    for action, addr, size, _ in trace:
        if action == "alloc":
            in_trace.add(addr)
        elif action == "free_completed":
            if addr in in_trace:
                in_trace.discard(addr)
            elif addr not in before:
                before[addr] = size
    exact: Dict[int, Tuple[int, int]] = {}
    for segment in snapshot.segments:
        if segment.device != device:
            continue
        for block in segment.blocks:
            if block.allocated and block.address not in in_trace and block.address not in before:
                exact[block.address] = (block.size, block.requested_size)
    starts = sorted(alive)
    rebuilt = []
    owned: Dict[int, List[int]] = {start: [] for start in starts}
    for addr in list(before) + list(exact):
        index = bisect_right(starts, addr) - 1
        if index >= 0 and addr < starts[index] + alive[starts[index]][0]:
            owned[starts[index]].append(addr)
    for start in starts:
        size, stream, small, _ = alive[start]
        end = start + size
        addrs = sorted(owned[start])
        blocks = []
        for position, addr in enumerate(addrs):
            limit = addrs[position + 1] if position + 1 < len(addrs) else end
            if addr in exact:
                nbytes, requested = exact[addr]
            else:
                requested = before[addr]
                nbytes = round_size(requested, conf)
                if nbytes >= conf.max_split_size_bytes and addr == start and not alive[start][3]:
                    # An oversize block is never split: it is its whole segment, fresh or cached.
                    nbytes = size
                rest = limit - addr - nbytes
                # should_split: the large pool keeps a remainder of 1 MiB or less in the block.
                keep = K_MIN_BLOCK_SIZE if (small or conf.expandable_segments) else K_SMALL_SIZE + 1
                if 0 < rest < keep:
                    nbytes = limit - addr
            blocks.append((addr, min(nbytes, limit - addr), addr, requested))
        rebuilt.append((start, size, small, stream, blocks))
    return _grouped_start(rebuilt, alive, trace)


def _grouped_start(rebuilt: List[Tuple[int, int, bool, int, List[Tuple[int, int, Any, int]]]],
                   alive: Dict[int, Tuple[int, int, bool, bool]], trace: Sequence[Event]) -> _Start:
    """`rebuilt`'s expandable ranges gathered into one expandable segment per pool and stream
    (the allocator makes another only when one's address space, the device's memory and an
    eighth, is full), based at the lowest address the trace or the ranges show in it (the
    allocator maps a segment from its base up: pages below the lowest range at the start were
    unmapped before); the `cudaMalloc` segments as they are."""
    segments, groups = [], {}
    for start, size, small, stream, blocks in rebuilt:
        if not alive[start][3]:
            segments.append((start, size, small, stream, blocks))
            continue
        _, ranges, _, _, owned = groups.setdefault((small, stream), [start, [], small, stream, []])
        ranges.append((start, size))
        owned.extend(blocks)
    for action, addr, _, stream in trace:
        if action in ("segment_map", "segment_unmap"):
            near = [group for group in groups.values() if group[3] == stream]
            if near:
                group = min(near, key=lambda g: abs(g[0] - addr))
                group[0] = min(group[0], addr)
    return _Start(segments, sum(alive[start][0] for start in alive), [tuple(group) for group in groups.values()])


def _driving_events(trace: Sequence[Event], callers: Optional[Dict[int, str]] = None) -> List[Tuple[int, tuple]]:
    """The program's calls, with the index of the real event: alloc, the completed frees, and
    `empty_cache` where a run of segment releases is the program's: its frames name
    `empty_cache` (`Snapshot.release_callers`), or without frames, it is followed by no new segment
    or OOM (the allocator's own releases on a failed `cudaMalloc` are followed by its retry)."""
    callers = callers or {}
    calls: List[Tuple[int, tuple]] = []
    for index, (action, addr, size, stream) in enumerate(trace):
        if action == "alloc":
            calls.append((index, ("alloc", addr, size, stream)))
        elif action == "free_completed":
            calls.append((index, ("free", addr)))
        elif action in _SHRINK:
            if index in callers:
                if callers[index] == "empty_cache" and callers.get(index + 1) != "empty_cache":
                    calls.append((index, ("empty_cache",)))  # once, at the run's last release
                continue
            following = trace[index + 1][0] if index + 1 < len(trace) else None
            if following not in _SHRINK + _GROW + ("oom",):
                calls.append((index, ("empty_cache",)))
    return calls


def _model(conf: Union[str, AllocConf], device_memory: Optional[int], start: _Start,
           record: bool) -> CachingAllocatorModel:
    model = CachingAllocatorModel(conf, device_memory, record_trace=record)
    for base, ranges, small, stream, blocks in start.expandables:
        model.add_expandable_segment(base, ranges, small, stream, blocks)
    for address, size, small, stream, blocks in start.segments:
        model.add_segment(address, size, small, stream, blocks)
    return model


def _call(model: CachingAllocatorModel, call: tuple) -> None:
    if call[0] == "alloc":
        if call[1] in model.live:  # a key the rebuilt start left alive: the replay has parted
            model.free(call[1])
        model.malloc(call[1], call[2], call[3])
    elif call[0] == "free":
        if call[1] in model.live:
            model.free(call[1])
    else:
        model.empty_cache()


def _figures(start: int, trace: Sequence[tuple]) -> SegmentFigures:
    reserved = peak = start
    created = freed = 0
    for action, _, size, _ in trace:
        if action in _GROW:
            reserved += size
            created += 1
            peak = max(peak, reserved)
        elif action in _SHRINK:
            reserved -= size
            freed += 1
    return SegmentFigures(peak, created, freed)


def _capacity_from_oom(start: int, trace: Sequence[Event]) -> Optional[int]:
    reserved = start
    for action, addr, size, _ in trace:
        if action in _GROW:
            reserved += size
        elif action in _SHRINK:
            reserved -= size
        elif action == "oom":
            return reserved + addr  # the oom event's address field is the device's free bytes
    return None


def _capacity_from_bursts(start: int, trace: Sequence[Event], callers: Dict[int, str]) -> Optional[Tuple[int, int]]:
    """The least and the most capacity the trace's release-and-retry bursts allow (module
    docstring), or None: no burst, or bursts that contradict each other."""
    low, high = 0, None
    reserved, index = start, 0
    while index < len(trace):
        action, _, size, _ = trace[index]
        if action in _SHRINK and callers.get(index) == "allocator":
            before, end = reserved, index
            while end < len(trace) and trace[end][0] in _SHRINK and callers.get(end) == "allocator":
                reserved -= trace[end][2]
                end += 1
            if end < len(trace) and trace[end][0] in _GROW:
                grown = trace[end][2]
                low = max(low, reserved + grown)
                high = before + grown - 1 if high is None else min(high, before + grown - 1)
            index = end
            continue
        if action in _GROW:
            reserved += size
        elif action in _SHRINK:
            reserved -= size
        index += 1
    if high is None or low > high:
        return None
    return low, high


def _why(real: Optional[tuple], replayed: Optional[tuple], trace: Sequence[Event],
         index: int) -> str:
    def name(op: Optional[tuple]) -> str:
        return "nothing" if op is None else f"{op[0]} of {op[2]:,} bytes on stream {op[3]}"

    reason = f"the GPU did {name(real)}, the model {name(replayed)}"
    # The GPU released where the model took nothing or grew at once: it was full, the model not.
    if real is not None and real[0] == "segment_free" and (replayed is None or replayed[0] in _GROW):
        following = [a for a, *_ in trace[index:index + 64] if a not in _SHRINK]
        if following and following[0] in _GROW:
            reason += (" (the GPU released its cache to retry a failed cudaMalloc: the device "
                       "was full; give the device's memory)")
    return reason


def _first_parting(window: List[Tuple[int, Event]], produced: List[Event], trace: Sequence[Event],
                   index: int) -> Optional[Divergence]:
    """Where the model's segment events for one driving event part from the GPU's (`window`, with
    their positions in `trace`), or None: the same action, size and stream, and for a segment's
    creation or release the same address."""
    expected = [event for _, event in window]
    for position in range(max(len(produced), len(expected))):
        real = expected[position] if position < len(expected) else None
        mine = produced[position] if position < len(produced) else None
        same = (real is not None and mine is not None
                and (real[0], real[2], real[3]) == (mine[0], mine[2], mine[3])
                and (real[0] not in ("segment_free", "segment_alloc") or real[1] == mine[1]))
        if not same:
            at = window[position][0] if position < len(window) else index
            return Divergence(at, trace[at][0], _why(real, mine, trace, at))
    return None


def _what_if(text: str, limit: Optional[int], start: Any, calls: Sequence[Tuple[int, tuple]]) -> WhatIf:
    """The same allocations under `text`'s settings and `limit`: the reserved peak, and whether it runs out."""
    what = _model(text, limit, start, record=False)
    for _, call in calls:
        try:
            _call(what, call)
        except OutOfMemory:
            return WhatIf(text, limit, what.reserved_peak, True)
    return WhatIf(text, limit, what.reserved_peak, False)


def _capacity(given: Optional[int], source: str, start: _Start, trace: Sequence[Event], callers: Dict[int, str],
              conf: AllocConf) -> Tuple[Optional[int], str, Optional[Tuple[int, int]]]:
    """The capacity the replay runs on, where it came from, and the range the retry bursts allow
    (module docstring): the one given, else the OOM event's, else the bursts' least, else None."""
    if given is not None:
        return given, source, None
    from_oom = _capacity_from_oom(start.reserved, trace)
    if from_oom is not None:
        return from_oom, "oom event", None
    bursts = None if conf.garbage_collection_threshold else _capacity_from_bursts(start.reserved, trace, callers)
    if bursts is not None:
        return bursts[0], "retry bursts", bursts
    return None, "unknown", None


def _replay_device(snapshot: Snapshot, device: int, conf_text: str,
                   device_memory: Optional[int], source: str,
                   what_ifs: Sequence[Tuple[Optional[str], Optional[int]]]) -> DeviceReplay:
    trace = snapshot.device_traces[device]
    conf = parse_alloc_conf(conf_text)
    start = _rebuild_start(snapshot, device, trace, conf)
    callers = snapshot.release_callers[device] if device < len(snapshot.release_callers) else {}
    device_memory, source, capacity_range = _capacity(device_memory, source, start, trace, callers, conf)
    calls = _driving_events(trace, callers)
    real_ops = [(index, event) for index, event in enumerate(trace)
                if event[0] in _GROW + _SHRINK]
    model = _model(conf, device_memory, start, record=True)
    top = max([s.address + s.total_size for s in snapshot.segments]
              + [addr + size for _, addr, size, _ in trace] + [model.next_addr])
    model.next_addr = top + (1 << 21)
    state = {"next": 0, "diverged": False}
    window: List[Tuple[int, Event]] = []
    used: set = set()  # the real segment_alloc events whose address the model took

    def real_address(size: int, stream: int) -> Optional[int]:
        if state["diverged"]:
            return None
        for at, (action, addr, real_size, real_stream) in window:
            if (action == "segment_alloc" and (real_size, real_stream) == (size, stream)
                    and at not in used):
                used.add(at)
                return addr
        return None

    model.segment_address = real_address
    divergence: Optional[Divergence] = None
    ops_seen = 0
    oom_at: Optional[int] = None
    for index, call in calls:
        window[:] = [(i, e) for i, e in real_ops[state["next"]:] if i <= index]
        try:
            _call(model, call)
        except OutOfMemory:
            oom_at = index
        produced = [op for op in model.trace[ops_seen:] if op[0] in _GROW + _SHRINK]
        ops_seen = len(model.trace)
        if divergence is None:
            divergence = _first_parting(window, produced, trace, index)
            state["diverged"] = divergence is not None
        state["next"] += len(window)
        if oom_at is not None:
            break
    if divergence is None:
        rest = real_ops[state["next"]:]
        if oom_at is None and rest:
            at = rest[0][0]
            divergence = Divergence(at, trace[at][0], _why(rest[0][1], None, trace, at))
        elif oom_at is not None and not any(e[0] == "oom" for e in trace):
            divergence = Divergence(oom_at, trace[oom_at][0],
                                    "the model ran out of memory where the GPU did not")
    replayed = _figures(start.reserved, model.trace)
    results = [_what_if(conf_text if alloc_conf is None else alloc_conf,
                        device_memory if memory is None else memory, start, calls)
               for alloc_conf, memory in what_ifs]
    return DeviceReplay(
        device=device,
        events=len(trace),
        streams=tuple(sorted({event[3] for event in trace})),
        alloc_conf=conf_text,
        settings_recorded=snapshot.allocator_settings is not None,
        capacity_bytes=device_memory,
        capacity_source=source,
        start_reserved_bytes=start.reserved,
        real=_figures(start.reserved, trace),
        replayed=replayed,
        first_divergence=divergence,
        what_if=tuple(results),
        capacity_range_bytes=capacity_range,
    )


def _flipped(text: str) -> str:
    conf = parse_alloc_conf(text)
    kept = [part for part in text.split(",") if part and not part.startswith("expandable_segments")]
    return ",".join(kept + [f"expandable_segments:{not conf.expandable_segments}"])


def replay_snapshot(snapshot: Union[Snapshot, Any], *, device_memory: Optional[int] = None,
                    what_ifs: Sequence[Tuple[Optional[str], Optional[int]]] = ()
                    ) -> SnapshotReplay:
    """Replay a recorded snapshot's allocations through the caching allocator model.

    Args:
        snapshot: a `Snapshot`, or the path of a `_dump_snapshot` file (read with `read_snapshot`).
        device_memory: the bytes the allocator could take from the recording's device; without
            it, from the trace's OOM event, else no limit.
        what_ifs: more what-ifs, each `(alloc_conf, device_memory)`: a
            `PYTORCH_CUDA_ALLOC_CONF` string (None: the recorded settings) and the bytes the
            allocator may take (None: the recording's capacity).

    Returns:
        A `SnapshotReplay`, one `DeviceReplay` per device that recorded events. Its what-ifs: the
        recorded settings with expandable segments switched (on if off, off if on), then
        `what_ifs`.

    Raises:
        SnapshotError: a file that is not a snapshot; ValueError: a bad `alloc_conf`.

    Example:
        >>> replay = replay_snapshot("tests/data/snapshots/silmont2000__mem_snapshot_b61be4.pickle")
        >>> figures = replay.devices[0].real
        >>> figures.reserved_peak_bytes, figures.segments_created
        (3781165056, 9)
        >>> replay.devices[0].replayed == figures, replay.devices[0].first_divergence
        (True, None)
    """
    if not isinstance(snapshot, Snapshot):
        snapshot = read_snapshot(snapshot)
    for alloc_conf, _ in what_ifs:
        if alloc_conf is not None:
            parse_alloc_conf(alloc_conf)
    conf_text = recorded_alloc_conf(snapshot.allocator_settings)
    source = "given" if device_memory is not None else "unknown"
    asked = [(_flipped(conf_text), None)] + list(what_ifs)
    devices = tuple(_replay_device(snapshot, device, conf_text, device_memory, source, asked)
                    for device, trace in enumerate(snapshot.device_traces) if trace)
    return SnapshotReplay(devices)
