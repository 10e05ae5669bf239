"""Real memory snapshots (`tests/data/snapshots/`, their provenance in its README) read safely and
replayed through the allocator model: each replays to its real reserved peak and segments."""

from __future__ import annotations

import os
import pathlib
import pickle
import random
from typing import Optional

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


def _recorded_with_frames(tmp_path: pathlib.Path, calls: list, capacity: Optional[int], release_frame: str,
                          alloc_conf: Optional[str] = None, skip: int = 0) -> str:
    """A snapshot file of `calls` (`("alloc", key, bytes)`, `("free", key)`, `("empty_cache",)`) run
    through the allocator model under `alloc_conf` on a device of `capacity` bytes, as
    `_dump_snapshot` writes one with stacks and its settings: each event's frames, a segment
    release's naming `release_frame` (the allocator's malloc, or the program's empty_cache) or, for
    an `empty_cache` call's, empty_cache; recording begun after `skip` events (the segments are the
    dump's, at the end)."""
    from trainer_memcb.plan.answers.plan_snapshot import snapshot_allocator_settings
    from trainer_memcb.plan.device.caching_allocator import CachingAllocatorModel

    model = CachingAllocatorModel(alloc_conf, capacity, record_trace=True)
    callers: list = []
    for call in calls:
        if call[0] == "alloc":
            model.malloc(call[1], call[2])
        elif call[0] == "free":
            model.free(call[1])
        else:
            model.empty_cache()
        callers += ["empty_cache" if call[0] == "empty_cache" else release_frame] * (len(model.trace) - len(callers))
    frame = {"filename": "train.py", "line": 1, "name": "forward"}
    events = [{"action": action, "addr": addr, "size": size, "stream": stream,
               "frames": [{"filename": "??", "line": 0, "name": caller}, frame]
               if action in ("segment_free", "segment_unmap") else [frame]}
              for (action, addr, size, stream), caller in list(zip(model.trace, callers))[skip:]]
    segments = [{"device": 0, "address": s.address, "total_size": s.total_size, "stream": s.stream,
                 "segment_type": s.pool, "is_expandable": s.expandable,
                 "blocks": [{"address": b.address, "size": b.size, "requested_size": b.requested_bytes,
                             "state": "active_allocated" if b.allocated else "inactive"} for b in s.blocks]}
                for s in model.segments()]
    path = tmp_path / f"{release_frame[:10]}-{skip}.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [events],
                                   "allocator_settings": snapshot_allocator_settings(model.conf)}))
    return str(path)


# Two bursts on a 250 MiB device: 120 MiB asked at 160 reserved, the cache released to 60 and the
# retry taken (the capacity is 180 to 280 MiB less a byte); 80 MiB asked at 230, released to 170,
# taken (250 to 310 less a byte). Together: 250 MiB to 280 MiB less a byte.
BURSTS = [("alloc", "a", 100 * MiB), ("alloc", "b", 60 * MiB), ("free", "a"), ("alloc", "c", 120 * MiB),
          ("alloc", "d", 50 * MiB), ("free", "b"), ("alloc", "e", 80 * MiB)]


def test_the_capacity_is_taken_from_release_and_retry_bursts(tmp_path: pathlib.Path) -> None:
    path = _recorded_with_frames(tmp_path, BURSTS, 250 * MiB,
                                 "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, "
                                 "unsigned long, CUstream_st*)")
    assert read_snapshot(path).release_callers == ({6: "allocator", 13: "allocator"},)
    device = replay_snapshot(path).devices[0]
    assert (device.capacity_source, device.capacity_range_bytes) == ("retry bursts", (250 * MiB, 280 * MiB - 1))
    # Replayed on the least capacity they allow, the model releases and retries where the GPU did.
    assert device.capacity_bytes == 250 * MiB and device.first_divergence is None
    assert device.real == device.replayed == SegmentFigures(250 * MiB, 5, 2)
    # Without a capacity, the model takes the requests without releasing: it parts at the first burst.
    unlimited = replay_snapshot(path, device_memory=10 * 1024 * MiB).devices[0]
    assert unlimited.first_divergence is not None and unlimited.first_divergence.event_index == 6
    assert "released its cache to retry a failed cudaMalloc" in unlimited.first_divergence.reason


def test_releases_the_program_asked_for_are_no_burst(tmp_path: pathlib.Path) -> None:
    # The same events, their releases' frames naming empty_cache: the program's call, not a failed cudaMalloc.
    path = _recorded_with_frames(tmp_path, BURSTS, 250 * MiB, "empty_cache")
    assert read_snapshot(path).release_callers == ({6: "empty_cache", 13: "empty_cache"},)
    device = replay_snapshot(path).devices[0]
    assert (device.capacity_source, device.capacity_range_bytes, device.capacity_bytes) == ("unknown", None, None)


def _random_calls(seed: int, count: int = 400) -> list:
    """Allocations of small (under 1 MiB) and large (2 to 90 MiB) sizes, frees of any live one,
    and now and then the program's empty_cache(): a mixed run."""
    draw, live, calls = random.Random(seed), [], []
    for index in range(count):
        if draw.random() < 0.03:
            calls.append(("empty_cache",))
        elif live and draw.random() < 0.45:
            calls.append(("free", live.pop(draw.randrange(len(live)))))
        else:
            size = draw.choice([draw.randrange(1, 900_000), draw.randrange(2 * MiB, 90 * MiB)])
            calls.append(("alloc", index, size))
            live.append(index)
    return calls


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True",
                                        "expandable_segments:True,roundup_power2_divisions:4", "max_split_size_mb:64"])
@pytest.mark.parametrize("skip", [0, 150, 300, 500])
def test_a_trace_begun_mid_run_replays_from_its_rebuilt_start(tmp_path: pathlib.Path, alloc_conf: str,
                                                               skip: int) -> None:
    # The allocator model (exact on the real snapshots above) writes the traces; recording begins
    # after `skip` events, so the start is rebuilt from the dump's segments with the trace undone:
    # expandable segments' mapped ranges among them (unmapped by empty_cache, mapped again), and
    # under max_split_size_mb the oversize blocks, each its whole segment.
    for seed in range(10):
        path = _recorded_with_frames(tmp_path, _random_calls(seed), None, "empty_cache", alloc_conf, skip)
        device = replay_snapshot(path).devices[0]
        assert device.first_divergence is None, (seed, device.first_divergence)
        assert device.replayed == device.real, seed
