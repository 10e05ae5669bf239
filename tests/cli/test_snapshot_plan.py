"""`trainer-memcb snapshot FILE --plan PLAN`, run as the console script runs it: a real snapshot
(`tests/data/snapshots/EoR_NN.pickle`) beside the plan that `estimate --write-snapshot` writes for
`examples/models/tiny-distilbert --batch-size 2 --seq-len 8`. Exact figures."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import installed_version
from test_snapshot_command import ROOT, SNAPSHOTS, run as run_snapshot
from trainer_memcb.plan.device.snapshot_file import read_snapshot
from trainer_memcb.plan.device.snapshot_plan import PartBytes, StepFigures, compare_with_plan

# The plan's temporaries ("other") at its allocated peak are 4 bytes fewer with the oldest supported
# release (transformers 4.57.1, torch 2.6) than with transformers 5: not traced further here.
OTHER = 1_803_268 if (installed_version("transformers") or (0,)) >= (5,) else 1_803_264
PLANNED = {"reserved_peak_bytes": 33_554_432, "allocated_peak_bytes": 26_409_936 + OTHER, "segments_created": 7,
           "segments_freed": 0}
# The plan's allocated peak by part: they sum to its allocated peak (28,213,204 with transformers 5).
PLANNED_PARTS = [{"part": "cuda_workspaces", "bytes": 19_136_512}, {"part": "optimizer_state", "bytes": 3_636_400},
                 {"part": "gradients", "bytes": 1_818_120}, {"part": "parameters", "bytes": 1_818_120},
                 {"part": "other", "bytes": OTHER}, {"part": "batch_and_buffers", "bytes": 784}]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("plan") / "tiny-plan.pickle"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "trainer_memcb", "estimate", str(ROOT / "examples/models/tiny-distilbert"),
                           "--batch-size", "2", "--seq-len", "8", "--write-snapshot", str(path)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    return path


def test_json_puts_the_plan_beside_the_real_trace_and_validates(plan_file) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    done = run_snapshot(str(SNAPSHOTS / "EoR_NN.pickle"), "--plan", str(plan_file), "--json")
    assert (done.returncode, done.stderr) == (0, "")
    document = json.loads(done.stdout)
    with open(ROOT / "docs" / "snapshot.schema.json", encoding="utf-8") as handle:
        jsonschema.validate(document, json.load(handle))
    (device,) = document["devices"]
    assert device["plan"] == {
        "planned": PLANNED,
        # 24 MiB reserved before the trace starts; 7 segments more, to 128 MiB.
        "real": {"reserved_peak_bytes": 134_217_728, "allocated_peak_bytes": 108_258_676, "segments_created": 7,
                 "segments_freed": 0},
        # Recording began at 24 MiB reserved, within the plan's 32 MiB; the first segment made
        # (20 MiB) takes it to 44 MiB.
        "first_over": {"event_index": 1, "action": "segment_alloc", "figure": "reserved", "real_bytes": 46_137_344,
                       "planned_bytes": 33_554_432},
        "planned_peak_parts": PLANNED_PARTS}
    assert device["real"]["reserved_peak_bytes"] == device["plan"]["real"]["reserved_peak_bytes"]


def test_without_plan_the_document_has_no_plan_key() -> None:
    done = run_snapshot(str(SNAPSHOTS / "EoR_NN.pickle"), "--json")
    assert "plan" not in json.loads(done.stdout)["devices"][0]


def test_the_table(plan_file) -> None:
    done = run_snapshot(str(SNAPSHOTS / "EoR_NN.pickle"), "--plan", str(plan_file))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("device 0: planned against real")
    assert [" ".join(line.split()) for line in lines[start + 3:start + 6]] == [
        f"planned 32.0 MiB (33,554,432) 26.9 MiB ({PLANNED['allocated_peak_bytes']:,}) 7 0",
        "real 128.0 MiB (134,217,728) 103.2 MiB (108,258,676) 7 0",
        "first over the plan: event 1 (segment_alloc): reserved 44.0 MiB (46,137,344) exceeds the plan's peak "
        "32.0 MiB (33,554,432)"]
    assert "cuda_workspaces 18.2 MiB (19,136,512)" in [" ".join(line.split()) for line in lines]


def test_the_plan_beside_itself_never_parts(plan_file) -> None:
    plan = read_snapshot(str(plan_file))
    (comparison,) = compare_with_plan(plan, plan).values()
    assert comparison.real == comparison.planned == StepFigures(**PLANNED)
    assert comparison.first_over is None
    assert comparison.planned_peak_parts == tuple(PartBytes(**part) for part in PLANNED_PARTS)
    assert sum(part["bytes"] for part in PLANNED_PARTS) == PLANNED["allocated_peak_bytes"]


def test_a_plan_that_is_not_a_snapshot_is_one_line(tmp_path) -> None:
    bad = tmp_path / "plan.pickle"
    bad.write_bytes(b"not a pickle")
    done = run_snapshot(str(SNAPSHOTS / "EoR_NN.pickle"), "--plan", str(bad))
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1 and str(bad) in done.stderr
