"""The `trainer-memcb snapshot --json` document and its JSON Schema.

The document is a frozen dataclass (`SnapshotDocument`), built from the replay's own objects
(`trainer_memcb.plan.device.snapshot_replay`); `snapshot_schema()` reads its schema from the
classes' fields with `trainer_memcb.utils.json_schema`, so a key added or renamed in the classes
changes the schema with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from trainer_memcb.plan.device.snapshot_replay import (
    Divergence,
    SegmentFigures,
    SnapshotReplay,
    WhatIf,
)

__all__ = ["SNAPSHOT_SCHEMA", "DeviceDocument", "SnapshotDocument", "snapshot_document",
           "snapshot_schema"]

# Raised by one when a key changes meaning or goes away (a key added keeps it).
SNAPSHOT_SCHEMA = "trainer-memcb/snapshot/1"


@dataclass(frozen=True)
class DeviceDocument:
    """One device's trace: its events and streams, the real and the replayed reserved figures,
    where they first part (null when they agree), and the what-ifs."""

    device: int
    events: int
    streams: Tuple[int, ...]
    real: SegmentFigures
    replayed: SegmentFigures
    first_divergence: Optional[Divergence]
    what_if: Tuple[WhatIf, ...]


@dataclass(frozen=True)
class SnapshotDocument:
    """A recorded memory snapshot replayed through the caching allocator model, per device."""

    schema: str
    devices: Tuple[DeviceDocument, ...]


def snapshot_document(replay: SnapshotReplay) -> SnapshotDocument:
    """The `--json` document of a replay."""
    return SnapshotDocument(SNAPSHOT_SCHEMA, tuple(
        DeviceDocument(d.device, d.events, d.streams, d.real, d.replayed, d.first_divergence,
                       d.what_if) for d in replay.devices))


def snapshot_schema() -> Dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `trainer-memcb snapshot --json`."""
    from trainer_memcb.utils.json_schema import JSON_SCHEMA_DIALECT, object_schema

    defs: Dict[str, Any] = {}
    document = object_schema(SnapshotDocument, defs)
    document["properties"]["schema"] = {"const": SNAPSHOT_SCHEMA}
    return {"$schema": JSON_SCHEMA_DIALECT, **document, "$defs": defs}
