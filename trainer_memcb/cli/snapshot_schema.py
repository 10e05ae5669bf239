"""The `trainer-memcb snapshot --json` document and its JSON Schema.

The document is a frozen dataclass (`SnapshotDocument`), built from the replay's own objects
(`trainer_memcb.plan.device.snapshot_replay`); `snapshot_schema()` reads its schema from the
classes' fields with `trainer_memcb.utils.json_schema`, so a key added or renamed in the classes
changes the schema with it. It is committed as `docs/snapshot.schema.json`, and a test holds the
file to it. To write it again:

    python -m trainer_memcb.cli.snapshot_schema > docs/snapshot.schema.json
"""

from __future__ import annotations

from dataclasses import dataclass
import json
import sys
from typing import Any, Dict, Optional, Tuple

from trainer_memcb.plan.device.snapshot_plan import PlanComparison
from trainer_memcb.plan.device.snapshot_replay import (
    Divergence,
    SegmentFigures,
    SnapshotReplay,
    WhatIf,
)

__all__ = ["SNAPSHOT_SCHEMA", "DeviceDocument", "SnapshotDocument", "snapshot_document", "snapshot_json",
           "snapshot_schema", "snapshot_schema_json"]

# Raised whenever the document changes shape (a key added, removed or renamed, a type changed): the
# schema file, whose `additionalProperties: false` refuses any key it does not name, changes with it.
SNAPSHOT_SCHEMA = "trainer-memcb/snapshot/2"


@dataclass(frozen=True)
class DeviceDocument:
    """One device's trace: its events and streams, the device memory it was replayed on and where
    that came from ("given", "oom event", "retry bursts" with the range they allow, or "unknown"
    and null), the real and the replayed reserved figures, where they first part (null when they
    agree), and the what-ifs; with `--plan`, the trace beside the planned step (`plan`, only then)."""

    device: int
    events: int
    streams: Tuple[int, ...]
    capacity_bytes: Optional[int]
    capacity_source: str
    capacity_range_bytes: Optional[Tuple[int, int]]
    real: SegmentFigures
    replayed: SegmentFigures
    first_divergence: Optional[Divergence]
    what_if: Tuple[WhatIf, ...]
    plan: Optional[PlanComparison] = None


@dataclass(frozen=True)
class SnapshotDocument:
    """A recorded memory snapshot replayed through the caching allocator model, per device."""

    schema: str
    devices: Tuple[DeviceDocument, ...]


def snapshot_document(replay: SnapshotReplay,
                      plans: Optional[Dict[int, PlanComparison]] = None) -> SnapshotDocument:
    """The `--json` document of a replay, with each device's comparison with the plan (`--plan`)."""
    return SnapshotDocument(SNAPSHOT_SCHEMA, tuple(
        DeviceDocument(d.device, d.events, d.streams, d.capacity_bytes, d.capacity_source, d.capacity_range_bytes,
                       d.real, d.replayed, d.first_divergence, d.what_if, (plans or {}).get(d.device))
        for d in replay.devices))


def snapshot_json(document: SnapshotDocument) -> Dict[str, Any]:
    """The document as JSON data: a device's `plan` key only where it has one."""
    from dataclasses import asdict

    data = asdict(document)
    for device in data["devices"]:
        if device["plan"] is None:
            del device["plan"]
    return data


def snapshot_schema() -> Dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `trainer-memcb snapshot --json`."""
    from trainer_memcb.utils.json_schema import JSON_SCHEMA_DIALECT, object_schema

    defs: Dict[str, Any] = {}
    document = object_schema(SnapshotDocument, defs)
    defs["DeviceDocument"] = object_schema(DeviceDocument, defs, optional=["plan"])
    defs["DeviceDocument"]["properties"]["plan"] = {"$ref": "#/$defs/PlanComparison"}  # left out, never null
    document["properties"]["schema"] = {"const": SNAPSHOT_SCHEMA}
    return {"$schema": JSON_SCHEMA_DIALECT, **document, "$defs": defs}


def snapshot_schema_json() -> str:
    """`snapshot_schema()` as the committed file holds it."""
    return json.dumps(snapshot_schema(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(snapshot_schema_json())
