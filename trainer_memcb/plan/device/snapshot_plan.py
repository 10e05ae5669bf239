"""A recorded snapshot beside the planned step: `trainer-memcb snapshot FILE --plan PLAN`.

PLAN is the planned step as a snapshot (`trainer-memcb estimate ... --write-snapshot PLAN`, device
0's trace); FILE a real `_dump_snapshot` (the callback's `memory_snapshot_dir=`, say). For each of
FILE's devices, against the plan, each side's figures over its trace:

- `reserved_peak_bytes`, `segments_created`, `segments_freed`: the real trace's, as
  `replay_snapshot` reads them (from the segments alive when recording began, rebuilt, and the
  segment events);
- `allocated_peak_bytes`: the most bytes allocated, as the trace's events count them (requested
  bytes: an `alloc` adds its size, a `free_completed` takes it away), from those allocated when
  recording began (rebuilt with the segments);
- `first_over`: where they part: the first event of the real trace after which its reserved or
  allocated bytes exceed the plan's peak of the same figure (null when it never does; action
  `"start"` at index 0 when they already did when recording began);
- `planned_peak_parts`: the plan's allocated bytes at its peak, by the part its frames name
  (largest first). A real trace's frames are Python's and name no part, so only the plan's side
  has parts.

The two traces need not cover the same steps: the plan's covers two training steps, a real one what
was recorded (the callback's `snapshot_steps`). Nothing here changes either snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from trainer_memcb.plan.device.alloc_conf import parse_alloc_conf
from trainer_memcb.plan.device.snapshot_file import Snapshot
from trainer_memcb.plan.device.snapshot_replay import _GROW, _SHRINK, _rebuild_start, recorded_alloc_conf

__all__ = ["Exceeded", "PartBytes", "PlanComparison", "StepFigures", "compare_with_plan"]


@dataclass(frozen=True)
class StepFigures:
    """One side's figures over its trace."""

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    segments_created: int
    segments_freed: int


@dataclass(frozen=True)
class Exceeded:
    """The first real event after which a figure exceeds the plan's peak of it."""

    event_index: int
    action: str
    figure: str  # "reserved" or "allocated"
    real_bytes: int
    planned_bytes: int


@dataclass(frozen=True)
class PartBytes:
    """A part's allocated bytes at the plan's allocated peak."""

    part: str
    bytes: int


@dataclass(frozen=True)
class PlanComparison:
    """A real device's trace beside the planned step."""

    planned: StepFigures
    real: StepFigures
    first_over: Optional[Exceeded]
    planned_peak_parts: Tuple[PartBytes, ...]


def _walk(snapshot: Snapshot, device: int) -> Tuple[StepFigures, Sequence[Tuple[int, int]], Tuple[PartBytes, ...]]:
    """The figures of `device`'s trace, the (reserved, allocated) bytes at its start and after each event, and the
    allocated bytes by part at the allocated peak (parts named by the plan's frames only)."""
    trace = snapshot.device_traces[device]
    start = _rebuild_start(snapshot, device, trace, parse_alloc_conf(recorded_alloc_conf(snapshot.allocator_settings)))
    parts = snapshot.plan_parts[device] if device < len(snapshot.plan_parts) else ()
    reserved = reserved_peak = start.reserved
    allocated = allocated_peak = sum(requested for *_, blocks in start.segments for *_, requested in blocks)
    by_part: Dict[str, int] = {"(alive when recording began)": allocated} if allocated else {}
    part_of: Dict[int, str] = {}
    at_peak = dict(by_part)
    created = freed = 0
    after = [(reserved, allocated)]  # when recording began
    for index, (action, addr, size, _) in enumerate(trace):
        if action in _GROW:
            reserved += size
            created += 1
            reserved_peak = max(reserved_peak, reserved)
        elif action in _SHRINK:
            reserved -= size
            freed += 1
        elif action == "alloc":
            allocated += size
            part = part_of[addr] = parts[index] if index < len(parts) and parts[index] else "(unnamed)"
            by_part[part] = by_part.get(part, 0) + size
            if allocated > allocated_peak:
                allocated_peak, at_peak = allocated, dict(by_part)
        elif action == "free_completed":
            allocated -= size
            part = part_of.pop(addr, "(alive when recording began)")
            by_part[part] = by_part.get(part, 0) - size
        after.append((reserved, allocated))
    peak_parts = tuple(PartBytes(part, value) for part, value in
                       sorted(at_peak.items(), key=lambda item: (-item[1], item[0])) if value)
    return StepFigures(reserved_peak, allocated_peak, created, freed), after, peak_parts


def compare_with_plan(real: Snapshot, plan: Snapshot, plan_device: int = 0) -> Dict[int, PlanComparison]:
    """Each device of `real` that recorded events -> its comparison with `plan`'s device `plan_device`.

    Example:
        >>> from trainer_memcb import read_snapshot
        >>> real = read_snapshot("tests/data/snapshots/silmont2000__mem_snapshot_b61be4.pickle")
        >>> compare_with_plan(real, real)[0].first_over is None
        True
    """
    planned, _, planned_parts = _walk(plan, plan_device)
    compared = {}
    for device, trace in enumerate(real.device_traces):
        if not trace:
            continue
        figures, after, _ = _walk(real, device)
        first_over = None
        for position, (reserved, allocated) in enumerate(after):
            index, action = (0, "start") if position == 0 else (position - 1, trace[position - 1][0])
            if reserved > planned.reserved_peak_bytes:
                first_over = Exceeded(index, action, "reserved", reserved, planned.reserved_peak_bytes)
            elif allocated > planned.allocated_peak_bytes:
                first_over = Exceeded(index, action, "allocated", allocated, planned.allocated_peak_bytes)
            if first_over is not None:
                break
        compared[device] = PlanComparison(planned, figures, first_over, planned_parts)
    return compared
