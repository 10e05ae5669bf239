"""ZeRO-3's fetch limits and offload against real runs (tests/dist_scripts/zero_step_profile.py,
DeepSpeed's own engine on 2 CPU processes, gloo), judged by torch's MemTracker as
test_engine_runs.py's ZeRO rows are (see the note there on why not the profiler). One launch for
both rows, about a minute here."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_engine_runs import _tracked, build  # noqa: E402

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.step_memory import plan_step_memory  # noqa: E402

pytestmark = pytest.mark.slow

ROWS = ("zero3-limits", "zero3-offload")
# The real peak less the plan's, the same on both processes in every launch here (zero3-limits four
# launches, zero3-offload seven):
# zero3-limits 4,643,305 real, 4,643,284 planned: the 21 bytes of DeepSpeed's 0-dim scalars that
# test_engine_runs.py's ZERO_SCALARS gives for zero3 (its peak in backward too). zero3-offload
# (offload_optimizer and offload_param to the CPU) 2,287,077 real, 2,287,060 planned: 17 bytes,
# small storages the fake step does not make, of the same kind (not matched to DeepSpeed's
# allocations one by one). offload_param adds nothing on the CPU: the row read 2,287,077 with
# offload_optimizer alone too, in three launches.
REAL_LESS_PLAN = {"zero3-limits": 21, "zero3-offload": 17}


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    return _tracked("zero_step_profile.py", tmp_path_factory, ROWS)


def plan_of(run):
    """The plan from the run's own DeepSpeed config and sequence length, host parts included (on
    the CPU they are in the memory the tracker counts)."""
    settings = resolve_settings(deepspeed=run["deepspeed_config"], world_size=run["world_size"], batch_size=2,
                                optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=run["seq_len"], settings=settings, device_type="cpu", model_states=False)
    assert plan.engine == "zero" and plan.problem is None, plan.problem
    return plan.peak_bytes + sum(plan.host_bytes.values())


@pytest.mark.parametrize("row", ROWS)
def test_zero3_peak_per_process_equals_memtrackers_on_the_real_run(zero3_runs, row):
    plan = plan_of(zero3_runs[row][0])
    peaks = [run["peak_bytes"] for run in zero3_runs[row]]
    assert peaks == [plan + REAL_LESS_PLAN[row]] * len(peaks), (plan, peaks)
