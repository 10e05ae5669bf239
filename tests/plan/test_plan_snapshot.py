"""`plan_snapshot(plan)`: a step plan in PyTorch's snapshot format, read back by torch's own
`_memory_viz` and by `replay_snapshot` to the plan's figures; `step_series(plan)`, what the page draws."""

from __future__ import annotations

import collections
import doctest
import io
import pickle
import pickletools

import pytest
import torch.cuda._memory_viz as memory_viz

import trainer_memcb
from trainer_memcb.plan.answers import plan_snapshot as plan_snapshot_module
from trainer_memcb.plan.answers.plan_snapshot import plan_snapshot, step_series, storage_parts
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.device.snapshot_file import read_snapshot
from trainer_memcb.plan.device.snapshot_replay import replay_snapshot
from trainer_memcb.plan.optimizers.whatif import build_meta_model

from helpers import installed_version

TINY = "examples/models/tiny-distilbert"
# On transformers 4.x (the oldest releases allowed) the tiny DistilBERT's step holds 4 bytes less at
# its peak and its snapshot one allocation fewer (a 0-dim scalar transformers 5 makes and keeps; not
# traced further).
OLDEST_TRANSFORMERS = installed_version("transformers") < (5,)
SCALAR = 0 if OLDEST_TRANSFORMERS else 4
EVENTS = 1612 if OLDEST_TRANSFORMERS else 1613  # 16 allocations and their frees the memory-efficient backward makes
MiB = 1024 ** 2


def planned(**flags):
    flags = {"batch_size": 2, "seq_len": 8, "optimizer": "adamw_torch", **flags}
    return plan_step_memory(lambda: build_meta_model(TINY), model_states=False, **flags)[0]


@pytest.fixture(scope="module")
def cuda_plan():
    return planned()


@pytest.fixture(scope="module")
def snapshot(cuda_plan):
    return plan_snapshot(cuda_plan)


def plain(value) -> bool:
    """Only what a dump holds: dicts with string keys, lists, strings, whole numbers, floats, booleans."""
    if isinstance(value, dict):
        return all(isinstance(key, str) and plain(item) for key, item in value.items())
    if isinstance(value, list):
        return all(plain(item) for item in value)
    return isinstance(value, (str, int, float, bool))


def test_the_snapshot_is_the_plans_two_steps_in_torchs_format(cuda_plan, snapshot):
    assert set(snapshot) == {"segments", "device_traces", "allocator_settings"}
    assert plain(snapshot)
    [trace] = snapshot["device_traces"]
    assert len(trace) == EVENTS
    assert collections.Counter(event["action"] for event in trace) == {
        "alloc": EVENTS - 2 * 479 - 7, "free_requested": 479, "free_completed": 479, "segment_alloc": 7}
    assert all(set(event) == {"action", "addr", "size", "stream", "frames"} for event in trace)
    # The first event: the allocator takes its first 2 MiB segment for the model's first parameter.
    assert trace[0] == {"action": "segment_alloc", "addr": 2 * MiB, "size": 2 * MiB, "stream": 0, "frames": [
        {"filename": "<plan>", "line": 0, "name": "setup: parameters"},
        {"filename": "<plan>", "line": 0, "name": "step 1"}]}
    names = collections.Counter(event["frames"][0]["name"] for event in trace)
    assert names["backward: activations"] == 168 and names["forward: cuda_workspaces"] == 4
    assert {event["frames"][1]["name"] for event in trace} == {"step 1", "step 2"}
    # The segments at the end: the reserved bytes, and the blocks allocated are those still alive.
    assert sum(segment["total_size"] for segment in snapshot["segments"]) == cuda_plan.device.reserved_peak_bytes \
        == 33_554_432
    for segment in snapshot["segments"]:
        assert sum(block["size"] for block in segment["blocks"]) == segment["total_size"]
        for block in segment["blocks"]:
            assert block["state"] in ("active_allocated", "inactive")
            assert bool(block["frames"]) == (block["state"] == "active_allocated")
    assert snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == ""
    assert snapshot["allocator_settings"]["expandable_segments"] is False


def test_the_pickle_names_no_global_and_reads_back_to_the_plans_figures(cuda_plan, snapshot, tmp_path):
    data = pickle.dumps(snapshot)
    opcodes = {op.name for op, _, _ in pickletools.genops(io.BytesIO(data))}
    assert not opcodes & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ"}
    path = tmp_path / "plan.pickle"
    path.write_bytes(data)
    assert read_snapshot(path).allocator_settings is not None
    [device] = replay_snapshot(path).devices
    assert device.real == device.replayed
    assert (device.real.reserved_peak_bytes, device.real.segments_created, device.real.segments_freed) == (
        cuda_plan.device.reserved_peak_bytes, 7, 0)
    assert device.first_divergence is None and device.start_reserved_bytes == 0


def test_torchs_memory_viz_reads_it(snapshot):
    lines = memory_viz.segments(snapshot, format_flamegraph=lambda text: text)
    # Each block's frames, outermost first: the step, then the phase and the part.
    assert "stream_0;seg_2097152;active_allocated;<plan>:0:step 1;<plan>:0:setup: parameters " in lines
    assert memory_viz.memory(snapshot, format_flamegraph=lambda text: text).startswith("stream_0;")
    page = memory_viz.trace_plot(snapshot)
    assert "Active Memory Timeline" in page
    # trace_plot and segment_plot embed the snapshot pickled again: the same dict.
    assert memory_viz.segment_plot(snapshot)


def test_with_expandable_segments_the_dump_says_so_and_reads_back_equal(tmp_path):
    plan = planned(alloc_conf="expandable_segments:True")
    snapshot = plan_snapshot(plan)
    assert snapshot["allocator_settings"]["expandable_segments"] is True
    assert {segment["is_expandable"] for segment in snapshot["segments"]} == {True}
    path = tmp_path / "plan.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    [device] = replay_snapshot(path).devices
    assert device.alloc_conf == "expandable_segments:True"
    assert device.real == device.replayed and device.first_divergence is None
    assert device.real.reserved_peak_bytes == plan.device.reserved_peak_bytes == 33_554_432


def test_a_cpu_plan_has_no_allocator_to_snapshot():
    plan = planned(device_type="cpu")
    with pytest.raises(ValueError, match="only a CUDA plan has a caching allocator"):
        plan_snapshot(plan)
    series = step_series(plan)
    # No allocator: the series is the timeline's bytes, its peak the plan's (the second step's).
    assert series.reserved_peak_bytes is None and {point.reserved for point in series.points} == {None}
    assert series.peak.total == plan.step.peak_bytes == 8_059_856 + SCALAR
    assert "cuda_workspaces" not in series.parts


def test_the_series_is_the_replay_by_part(cuda_plan):
    series = step_series(cuda_plan)
    assert series.reserved_peak_bytes == cuda_plan.device.reserved_peak_bytes
    # The most alive at once is the plan's peak with CUDA's cuBLAS workspaces, which the trace does not make.
    assert series.peak.total == cuda_plan.step.peak_bytes + cuda_plan.device.cuda_workspace_bytes == 28_213_200 + SCALAR
    assert series.peak.phase == "step 2, " + cuda_plan.step.peak_phase
    by_part = dict(zip(series.parts, series.peak.parts))
    assert {part: by_part.get(part, 0) for part in cuda_plan.step.peak_parts} == cuda_plan.step.peak_parts
    assert [name for _, name in series.phases] == [
        f"step {step}, {phase}" for step in (1, 2) for phase in ("setup", "forward", "backward", "optimizer step")]
    thin = step_series(cuda_plan, max_points=50)
    assert len(thin.points) == 50 and max(point.total for point in thin.points) == series.peak.total
    assert max(point.reserved for point in thin.points) == series.reserved_peak_bytes


def test_each_storage_has_the_part_the_peak_counts_it_in(cuda_plan):
    timeline = cuda_plan.timeline
    parts = storage_parts(timeline, cuda_plan.step.peak_phase)
    assert set(parts) == set(timeline.sizes)
    assert cuda_plan.step.peak_phase == "optimizer step"
    peak = timeline.optimizer_step
    for serial in peak.storages:
        assert parts[serial] == timeline.part_of(serial, peak.saved)


def test_the_public_name_and_its_example():
    assert trainer_memcb.plan_snapshot is plan_snapshot and "plan_snapshot" in trainer_memcb.__all__
    result = doctest.testmod(plan_snapshot_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0
