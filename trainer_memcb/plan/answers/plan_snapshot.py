"""The planned step in PyTorch's memory-snapshot format, and as a series to draw.

`plan_snapshot(plan)` runs again the allocator replay a CUDA step plan reports
(`trainer_memcb.plan.answers.step_replay`: the timeline's allocations over two training steps,
under the settings and the limit its `ReplayOptions` hold) with the allocator's trace recorded, and
returns what `torch.cuda.memory._snapshot()` returns for a real run (`_dump_snapshot` pickles it):

- `segments`: the allocator's segments at the end of step 2, each with its blocks (address, size,
  requested size, state, and for an allocated block the frames of its allocation);
- `device_traces`: one list, device 0's events in order, as `_record_memory_history()` records
  them: `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free` (and with
  expandable segments `segment_map`, `segment_unmap`), each with `addr`, `size`, `stream` and
  `frames`. The plan knows no Python stack: each event's frames name the part the storage belongs
  to and the phase, innermost first, as torch orders frames:
  `[{"filename": "<plan>", "line": 0, "name": "backward: activations"}, {"filename": "<plan>",
  "line": 0, "name": "step 2"}]`. A replay that runs out of memory (a `per_process_memory_fraction`
  the step exceeds) ends with torch's `oom` event, the device's free bytes in `device_free` and
  `addr` (where torch puts them);
- `allocator_settings`: the replayed `PYTORCH_CUDA_ALLOC_CONF`, keyed as the dump keys it.

Only dicts, lists, strings, numbers and booleans: `pickle.dump` of it names no global, so
`trainer_memcb.read_snapshot` (which refuses every global), `torch.cuda._memory_viz` and
pytorch.org/memory_viz read it. `step_series(plan)` is the same two steps as a series of bytes by
part and the reserved bytes, to draw (on the CPU, the timeline's bytes alone: no allocator).

Each storage's part: the part the step's figures give it (`Timeline.part_of`): an engine's name,
else parameters, gradients, optimizer state, batch and buffers; activations are a moment's (saved
for backward then), so a storage alive at the step's peak takes the part it has there (as
`peak_parts` counts it; one alive at another phase's peak, the part it has there), and any other storage made in the forward and alive when the backward
begins is an activation; everything else is "other" (temporaries). CUDA's cuBLAS and cuBLASLt
workspaces, which the trace does not make, are `cuda_workspaces`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from trainer_memcb.plan.answers.step_plan import StepMemoryPlan
from trainer_memcb.plan.answers.step_replay import ReplayOptions, step_allocations
from trainer_memcb.plan.device.alloc_conf import SIZE_MAX, AllocConf
from trainer_memcb.plan.device.caching_allocator import CachingAllocatorModel, OutOfMemory
from trainer_memcb.plan.step.timeline import Timeline

__all__ = ["PLAN_FRAME_FILE", "SeriesPoint", "StepSeries", "plan_snapshot", "snapshot_allocator_settings",
           "step_series", "storage_parts"]

# The `filename` of every frame the plan writes: no source file made these allocations.
PLAN_FRAME_FILE = "<plan>"
# The part of CUDA's cuBLAS and cuBLASLt workspaces (`trainer_memcb.plan.device.cuda_kernels`).
WORKSPACES = "cuda_workspaces"
# The block states of `DeviceCachingAllocator::snapshot` (torch/csrc/cuda/memory_snapshot.cpp).
_ALLOCATED, _PENDING, _INACTIVE = "active_allocated", "active_pending_free", "inactive"


def storage_parts(timeline: Timeline, peak_phase: Optional[str] = None) -> Dict[int, str]:
    """Each storage of `timeline` (by serial number) -> its part (see the module docstring); a
    storage alive at more than one phase's peak takes the part it has at the step's peak (in
    `peak_phase`, the plan's `step.peak_phase`), else at forward and backward's."""
    peaks = [timeline.forward_backward] + [peak for _, peak in timeline.micro_batch_peaks]
    if timeline.optimizer_step is not None:
        at_optimizer = peak_phase is not None and peak_phase == timeline.optimizer_step.phase
        peaks.insert(0 if at_optimizer else len(peaks), timeline.optimizer_step)
    at_peak: Dict[int, frozenset] = {}
    for peak in peaks:
        for serial in peak.storages:
            at_peak.setdefault(serial, peak.saved)
    forward, backward = timeline.phase_starts.get("forward"), timeline.phase_starts.get("backward")
    made_in_forward: set = set()
    if forward is not None and backward is not None:
        for event in timeline.events[forward:backward]:
            if event >= 0:
                made_in_forward.add(event)
            else:
                made_in_forward.discard(~event)
    forward_alive = frozenset(made_in_forward)
    return {serial: timeline.part_of(serial, at_peak.get(serial, forward_alive)) for serial in timeline.sizes}


def _phase_frames(where: str, part: str) -> List[Dict[str, Any]]:
    """The frames of an event "step N, PHASE" of `part`, innermost first."""
    step, _, phase = where.partition(", ")
    return [{"filename": PLAN_FRAME_FILE, "line": 0, "name": f"{phase}: {part}"},
            {"filename": PLAN_FRAME_FILE, "line": 0, "name": step}]


def _part_of_key(key: Any, parts: Dict[int, str]) -> str:
    """The part of an allocation key of `step_allocations`: a serial, (2, serial) in step 2, or a
    workspace ("cublas" or "cublaslt", handle)."""
    if isinstance(key, tuple):
        return WORKSPACES if key[0] in ("cublas", "cublaslt") else parts[key[1]]
    return parts[key]


def snapshot_allocator_settings(conf: AllocConf) -> Dict[str, Any]:
    """`allocator_settings` as `_dump_snapshot` writes them (torch 2.6 and later,
    torch/csrc/cuda/memory_snapshot.cpp): the text, `max_split_size` in bytes (-1 unset),
    `roundup_power2_divisions` keyed by the interval's start in MiB."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": conf.text,
        "max_split_size": -1 if conf.max_split_size_bytes == SIZE_MAX else conf.max_split_size_bytes,
        "garbage_collection_threshold": float(conf.garbage_collection_threshold),
        "expandable_segments": bool(conf.expandable_segments),
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "roundup_power2_divisions": {str(1 << index): int(divisions)
                                     for index, divisions in enumerate(conf.roundup_power2_divisions)},
    }


def _replay_calls(plan: StepMemoryPlan) -> Tuple[Timeline, ReplayOptions, List[Tuple[tuple, str]]]:
    timeline, options = plan.timeline, plan.replay_options
    if plan.settings.device_type != "cuda":
        raise ValueError(f"the step is planned for device type {plan.settings.device_type!r}: only a CUDA plan has "
                         "a caching allocator, whose snapshot this is")
    if timeline is None or options is None:
        raise ValueError("the step plan has no traced step to replay"
                         + (f" ({plan.step.problem})" if plan.step.problem else ""))
    calls = step_allocations(timeline, compute_capability=options.compute_capability,
                             empty_cache_steps=options.empty_cache_steps)
    return timeline, options, calls


def _segment_entry(segment: Any, frames_of: Dict[Any, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """One segment at the end, with its blocks, as `_snapshot()` writes it (an allocated block with
    the frames of its allocation)."""
    blocks = [{"address": block.address, "size": block.size, "requested_size": block.requested_bytes,
               "state": _ALLOCATED if block.allocated else (_PENDING if block.pending_free else _INACTIVE),
               "frames": frames_of.get(block.key, []) if block.allocated else []}
              for block in segment.blocks]
    return {"device": 0, "address": segment.address, "total_size": segment.total_size,
            "allocated_size": segment.allocated_size,
            "active_size": sum(block["size"] for block in blocks if block["state"] != _INACTIVE),
            "requested_size": sum(block["requested_size"] for block in blocks if block["state"] != _INACTIVE),
            "stream": segment.stream, "segment_type": segment.pool, "segment_pool_id": [0, 0],
            "is_expandable": segment.expandable, "frames": [], "blocks": blocks}


def plan_snapshot(plan: StepMemoryPlan) -> Dict[str, Any]:
    """The planned step as a `torch.cuda.memory._snapshot()` dictionary (see the module docstring).

    Args:
        plan: a CUDA step plan (`plan_step_memory(..., device_type="cuda")`) with its traced step.

    Returns:
        `{"segments": [...], "device_traces": [[...]], "allocator_settings": {...}}`: pickle it
        to get a file `trainer-memcb snapshot`, `python -m torch.cuda._memory_viz` and
        pytorch.org/memory_viz read; its reserved peak is the plan's `device.reserved_peak_bytes`.

    Raises:
        ValueError: a plan for the CPU (no caching allocator), or one with no traced step.

    Examples:
        >>> from trainer_memcb.plan.answers.step_memory import plan_step_memory
        >>> from trainer_memcb.plan.optimizers.whatif import build_meta_model
        >>> from trainer_memcb.plan.device.snapshot_replay import replay_snapshot
        >>> import pickle, tempfile, os
        >>> build = lambda: build_meta_model("examples/models/tiny-distilbert")
        >>> plan, _ = plan_step_memory(build, batch_size=2, seq_len=8, optimizer="adamw_torch", model_states=False)
        >>> snapshot = plan_snapshot(plan)
        >>> snapshot["device_traces"][0][0]["frames"][0]["name"]
        'setup: parameters'
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.pickle")
        >>> with open(path, "wb") as handle:
        ...     pickle.dump(snapshot, handle)
        >>> device = replay_snapshot(path).devices[0]
        >>> device.real == device.replayed, device.real.reserved_peak_bytes == plan.device.reserved_peak_bytes
        (True, True)
    """
    timeline, options, calls = _replay_calls(plan)
    parts = storage_parts(timeline, plan.step.peak_phase)
    model = CachingAllocatorModel(options.alloc_conf, options.device_memory, record_trace=True)
    trace = model.trace
    events: List[Dict[str, Any]] = []
    frames_of: Dict[Any, List[Dict[str, Any]]] = {}
    frames = [{"filename": PLAN_FRAME_FILE, "line": 0, "name": "empty_cache"}]

    def record(since: int, frames: List[Dict[str, Any]]) -> None:
        for action, addr, size, stream in trace[since:]:
            events.append({"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames})

    for event, where in calls:
        since = len(trace)
        kind = event[0]
        if kind == "alloc":
            frames = frames_of[event[1]] = _phase_frames(where, _part_of_key(event[1], parts))
        elif kind == "free":
            frames = _phase_frames(where, _part_of_key(event[1], parts))
        else:
            frames = _phase_frames(where, "empty_cache")
        try:
            if kind == "alloc":
                model.malloc(*event[1:])
            elif kind == "free":
                model.free(event[1])
            else:
                model.empty_cache()
        except OutOfMemory:
            record(since, frames)
            free = max(0, (options.device_memory or 0) - model.reserved)
            events.append({"action": "oom", "addr": free, "size": event[2], "stream": event[3] if len(event) > 3 else 0,
                           "device_free": free,
                           "frames": frames})
            break
        record(since, frames)
    segments = [_segment_entry(segment, frames_of) for segment in model.segments()]
    return {"segments": segments, "device_traces": [events],
            "allocator_settings": snapshot_allocator_settings(options.alloc_conf)}


@dataclass(frozen=True)
class SeriesPoint:
    """The step at one moment: after event `index`, in `phase` ("step N, PHASE"), the bytes alive
    by part (as asked, not rounded) and on CUDA the bytes the allocator reserves."""

    index: int
    phase: str
    parts: Tuple[int, ...]
    reserved: Optional[int]

    @property
    def total(self) -> int:
        return sum(self.parts)


@dataclass(frozen=True)
class StepSeries:
    """Two training steps of a plan, to draw: the parts (in the order of `SeriesPoint.parts`), the
    points (at most `max_points`: where there were more, each kept point is the fullest of its
    stretch, so the peak is among them, and its reserved bytes the stretch's most), where each
    phase begins, the peak of the bytes alive, and on CUDA the reserved peak.

    Attributes:
        events: the events the series was read from (allocations and frees of both steps).
        peak: the fullest point; `reserved_peak_bytes`: the allocator's most (None on the CPU).
    """

    parts: Tuple[str, ...]
    points: Tuple[SeriesPoint, ...]
    phases: Tuple[Tuple[int, str], ...]
    peak: SeriesPoint
    reserved_peak_bytes: Optional[int]
    events: int


def step_series(plan: StepMemoryPlan, max_points: int = 2000) -> StepSeries:
    """The plan's two steps as bytes by part over its events, with the reserved bytes on CUDA.

    On CUDA the events are the allocator replay's (`plan_snapshot`'s, the cuBLAS workspaces
    among them) and `reserved` follows the replay; on the CPU, the same two steps of the timeline
    with no allocator. The series' peak is the most bytes alive at once in the two steps: the
    plan's `step.peak_bytes` on the CPU, and with the workspaces on CUDA.

    Raises:
        ValueError: a plan with no traced step.
    """
    if max_points < 2:
        raise ValueError(f"max_points={max_points}: expected at least 2")
    timeline = plan.timeline
    if timeline is None:
        raise ValueError("the step plan has no traced step to draw"
                         + (f" ({plan.step.problem})" if plan.step.problem else ""))
    cuda = plan.settings.device_type == "cuda" and plan.replay_options is not None
    if cuda:
        _, options, calls = _replay_calls(plan)
        model: Optional[CachingAllocatorModel] = CachingAllocatorModel(options.alloc_conf, options.device_memory)
    else:
        # No allocator on the CPU: the timeline's two steps without CUDA's workspaces.
        calls = [(event, where) for event, where in step_allocations(timeline)
                 if not (event[0] == "alloc" and isinstance(event[1], tuple) and event[1][0] != 2)]
        model = None
    parts = storage_parts(timeline, plan.step.peak_phase)
    names = [name for name in dict.fromkeys(list(timeline.tags.values()) + ["parameters", "gradients",
             "optimizer_state", "activations", "batch_and_buffers", "other"]) if name not in timeline.host_parts]
    if cuda:
        names.append(WORKSPACES)
    slot = {name: index for index, name in enumerate(names)}
    alive = [0] * len(names)
    sizes: Dict[Any, Tuple[int, int]] = {}
    points: List[SeriesPoint] = []
    phases: List[Tuple[int, str]] = []
    for index, (event, where) in enumerate(calls):
        if not phases or phases[-1][1] != where:
            phases.append((index, where))
        kind = event[0]
        try:
            if kind == "alloc":
                part = _part_of_key(event[1], parts)
                if model is not None:
                    model.malloc(*event[1:])
                if part in slot:
                    sizes[event[1]] = (slot[part], event[2])
                    alive[slot[part]] += event[2]
            elif kind == "free":
                if model is not None:
                    model.free(event[1])
                at, nbytes = sizes.pop(event[1], (None, 0))
                if at is not None:
                    alive[at] -= nbytes
            elif model is not None:
                model.empty_cache()
        except OutOfMemory:
            break
        points.append(SeriesPoint(index, where, tuple(alive), model.reserved if model is not None else None))
    if not points:
        raise ValueError("the step plan's replay ran out of memory at its first allocation: nothing to draw")
    peak = max(points, key=lambda point: point.total)
    used = [index for index in range(len(names)) if any(point.parts[index] for point in points)]
    points = [SeriesPoint(p.index, p.phase, tuple(p.parts[i] for i in used), p.reserved) for p in points]
    peak = SeriesPoint(peak.index, peak.phase, tuple(peak.parts[i] for i in used), peak.reserved)
    return StepSeries(tuple(names[i] for i in used), tuple(_thinned(points, max_points)), tuple(phases), peak,
                      model.reserved_peak if model is not None else None, len(calls))


def _thinned(points: List[SeriesPoint], most: int) -> List[SeriesPoint]:
    """At most `most` points: each stretch of equal length kept as its fullest point, with the
    stretch's most reserved bytes."""
    if len(points) <= most:
        return points
    kept = []
    for number in range(most):
        stretch = points[number * len(points) // most:(number + 1) * len(points) // most]
        if not stretch:
            continue
        fullest = max(stretch, key=lambda point: point.total)
        reserved = None if fullest.reserved is None else max(point.reserved for point in stretch)
        kept.append(SeriesPoint(fullest.index, fullest.phase, fullest.parts, reserved))
    return kept
