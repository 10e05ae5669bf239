"""`trainer-memcb snapshot FILE` run as the console script runs it, on a real snapshot."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest

SNAPSHOTS = pathlib.Path(__file__).parents[1] / "data" / "snapshots"
ROOT = pathlib.Path(__file__).parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "trainer_memcb", "snapshot", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_json_holds_the_exact_figures_and_validates() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from trainer_memcb.cli.snapshot_schema import SNAPSHOT_SCHEMA, snapshot_schema

    done = run(str(SNAPSHOTS / "EoR_NN.pickle"), "--json", "--alloc-conf",
               "expandable_segments:True", "--device-memory", "110MiB")
    assert (done.returncode, done.stderr) == (0, "")
    document = json.loads(done.stdout)
    with open(ROOT / "docs" / "snapshot.schema.json", encoding="utf-8") as handle:
        committed = json.load(handle)
    assert committed == snapshot_schema(), \
        "write it again: python -m trainer_memcb.cli.snapshot_schema > docs/snapshot.schema.json"
    jsonschema.validate(document, committed)
    assert document == {"schema": SNAPSHOT_SCHEMA, "devices": [{
        "device": 0, "events": 5803, "streams": [0],
        "capacity_bytes": None, "capacity_source": "unknown", "capacity_range_bytes": None,
        "real": {"reserved_peak_bytes": 134_217_728, "segments_created": 7, "segments_freed": 0},
        "replayed": {"reserved_peak_bytes": 134_217_728, "segments_created": 7, "segments_freed": 0},
        "first_divergence": None,
        "what_if": [
            {"alloc_conf": "expandable_segments:True", "device_memory_bytes": None,
             "reserved_peak_bytes": 113_246_208, "oom": False},
            {"alloc_conf": "expandable_segments:True", "device_memory_bytes": 115_343_360,
             "reserved_peak_bytes": 113_246_208, "oom": False}]}]}


def test_the_table_and_a_gpu_what_if() -> None:
    done = run(str(SNAPSHOTS / "silmont2000__mem_snapshot_b61be4.pickle"), "--gpu", "a100-40gb")
    assert done.returncode == 0 and done.stderr == ""
    assert "real      3.52 GiB (3,781,165,056)" in done.stdout
    assert "replayed  3.52 GiB (3,781,165,056)" in done.stdout
    assert "first divergence: none" in done.stdout


def test_bad_files_are_one_line_and_exit_1(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    hostile = tmp_path / "hostile.pickle"
    hostile.write_bytes(pickle.dumps(Hostile()))
    cut = tmp_path / "cut.pickle"
    cut.write_bytes((SNAPSHOTS / "EoR_NN.pickle").read_bytes()[:5000])
    for path, says in ((hostile, "names the Python global"), (cut, "is cut short"),
                       (tmp_path, "cannot be read"), (tmp_path / "none", "cannot be read")):
        done = run(str(path))
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.startswith(f"trainer-memcb: {path}: {says}")
        assert done.stderr.count("\n") == 1
    assert not marker.exists()
    done = run(str(hostile), "--alloc-conf", "nope:1")
    assert done.returncode == 2 and done.stderr.startswith("trainer-memcb: error:")


def test_a_capacity_from_release_and_retry_bursts_is_said_with_its_range(tmp_path: pathlib.Path) -> None:
    # The allocator's own releases (its frames name DeviceCachingAllocator::malloc) on a 250 MiB device.
    from plan.device.test_snapshot_replay import BURSTS, _recorded_with_frames

    path = _recorded_with_frames(tmp_path, BURSTS, 250 * 2**20, "DeviceCachingAllocator::malloc")
    done = run(path, "--json")
    device = json.loads(done.stdout)["devices"][0]
    assert (device["capacity_bytes"], device["capacity_source"], device["capacity_range_bytes"]) == (
        262_144_000, "retry bursts", [262_144_000, 293_601_279])
    assert device["first_divergence"] is None
    done = run(path)
    assert done.returncode == 0
    assert ("device memory 250.0 MiB (262,144,000), the least its release-and-retry bursts allow (they allow up "
            "to 280.0 MiB (293,601,279)); first divergence: none") in " ".join(done.stdout.split())
