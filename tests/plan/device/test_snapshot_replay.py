"""Real memory snapshots (`tests/data/snapshots/`, their provenance in its README) read safely and
replayed through the allocator model: each replays to its real reserved peak and segments."""

from __future__ import annotations

import os
import pathlib
import pickle

import pytest

import trainer_memcb
from trainer_memcb.plan.device.snapshot_file import SnapshotError, read_snapshot
from trainer_memcb.plan.device.snapshot_replay import (
    SegmentFigures,
    WhatIf,
    recorded_alloc_conf,
    replay_snapshot,
)

SNAPSHOTS = pathlib.Path(__file__).parents[2] / "data" / "snapshots"
MiB = 1024 ** 2

# file -> (events, streams, reserved when recording began, real = replayed figures, the
# expandable-segments what-if's reserved peak), measured from the files.
EXPECTED = {
    "silmont2000__mem_snapshot_b61be4.pickle":
        (97, (0,), 0, SegmentFigures(3_781_165_056, 9, 0), 3_797_942_272),
    "EoR_NN.pickle":
        (5803, (0,), 24 * MiB, SegmentFigures(134_217_728, 7, 0), 113_246_208),
    "Wedsonlin__results_medium_512_training_memory_snapshot_61dcd1.pickle":
        (22332, (0,), 12_593_397_760, SegmentFigures(12_660_506_624, 1, 0), 12_677_283_840),
    "kkaitlyn111__memory_2.7b_forward_f5e121.pickle":
        (8694, (0,), 51_849_986_048, SegmentFigures(51_849_986_048, 178, 742), 51_849_986_048),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_real_snapshot_replays_to_its_real_segments(name: str) -> None:
    events, streams, start, figures, expandable_peak = EXPECTED[name]
    replay = replay_snapshot(SNAPSHOTS / name)
    (device,) = replay.devices
    assert (device.events, device.streams, device.start_reserved_bytes) == (events, streams, start)
    assert device.real == figures
    assert device.replayed == figures
    # The segments created and freed, in order, at the GPU's sizes and addresses.
    assert device.first_divergence is None
    assert (device.alloc_conf, device.capacity_bytes, device.capacity_source) == ("", None, "unknown")
    assert device.what_if == (WhatIf("expandable_segments:True", None, expandable_peak, False),)


def test_the_real_figures_are_the_segment_events_from_the_rebuilt_start() -> None:
    snapshot = read_snapshot(SNAPSHOTS / "kkaitlyn111__memory_2.7b_forward_f5e121.pickle")
    trace = snapshot.device_traces[0]
    at_dump = sum(segment.total_size for segment in snapshot.segments)
    grown = sum(size for action, _, size, _ in trace if action == "segment_alloc")
    shrunk = sum(size for action, _, size, _ in trace if action == "segment_free")
    device = replay_snapshot(snapshot).devices[0]
    assert device.start_reserved_bytes == at_dump - grown + shrunk
    # empty_cache() at the start released 742 segments: the peak is the start.
    assert trace[0][0] == "segment_free" and device.real.reserved_peak_bytes == at_dump - grown + shrunk


def test_what_ifs_and_a_capacity_that_runs_out() -> None:
    path = SNAPSHOTS / "EoR_NN.pickle"
    replay = replay_snapshot(path, what_ifs=[(None, 100 * MiB), ("expandable_segments:True", 110 * MiB)])
    assert replay.devices[0].what_if[1:] == (
        WhatIf("", 100 * MiB, 88 * MiB, True),
        WhatIf("expandable_segments:True", 110 * MiB, 108 * MiB, False))
    # The recording's device given too small: the replay runs out where the GPU did not.
    device = replay_snapshot(path, device_memory=100 * MiB).devices[0]
    assert device.capacity_source == "given" and device.first_divergence is not None
    assert "out of memory" in device.first_divergence.reason or "the GPU did" in device.first_divergence.reason


def test_recorded_settings_as_alloc_conf() -> None:
    assert recorded_alloc_conf(None) == ""
    assert recorded_alloc_conf({"expandable_segments": True, "max_split_size": 256 * MiB,
                                "roundup_power2_divisions": {"1": 0}}) == (
        "expandable_segments:True,max_split_size_mb:256")


def test_a_hostile_pickle_is_refused_and_nothing_runs(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "hostile.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Hostile()]]}))
    with pytest.raises(SnapshotError, match=r"names the Python global (posix|os)\.system"):
        read_snapshot(path)
    assert not marker.exists()


@pytest.mark.parametrize("content, says", [
    (b"not a pickle", "is not a pickle this can read"),
    (pickle.dumps({"segments": [], "device_traces": [[]]})[:-5], "is cut short"),
    (pickle.dumps([1, 2]), "no 'segments' list"),
    (pickle.dumps({"segments": [{"address": 1}], "device_traces": []}), "segment 0 lacks"),
    (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": "x"}]]}),
     "device 0 event 0 holds a value of the wrong type"),
    (b"", "is cut short"),
])
def test_bad_files_are_one_line(tmp_path: pathlib.Path, content: bytes, says: str) -> None:
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as raised:
        read_snapshot(path)
    assert says in str(raised.value) and str(raised.value).startswith(str(path))
    assert "\n" not in str(raised.value)
    for missing in (tmp_path / "none.pickle", tmp_path):
        with pytest.raises(SnapshotError, match="cannot be read"):
            read_snapshot(missing)


def test_public_names() -> None:
    assert trainer_memcb.read_snapshot is read_snapshot
    assert trainer_memcb.replay_snapshot is replay_snapshot
    assert {"read_snapshot", "replay_snapshot"} <= set(trainer_memcb.__all__)
