"""ZeRO-3's fetch limits, offload and bf16 against real runs (tests/dist_scripts/zero_step_profile.py,
DeepSpeed's own engine on 2 CPU processes, gloo), judged by torch's MemTracker as
test_engine_runs.py's ZeRO rows are (see the note there on why not the profiler). One launch for
every row, about a minute and a half here."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_engine_runs import _tracked, build  # noqa: E402

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402

pytestmark = pytest.mark.slow

ROWS = ("zero3-limits", "zero3-offload", "zero3-bf16")
# The real peak less the plan's, the same on both processes in every launch here (zero3-limits four
# launches, zero3-offload seven):
# zero3-limits 4,643,305 real, 4,643,284 planned: the 21 bytes of DeepSpeed's 0-dim scalars that
# test_engine_runs.py's ZERO_SCALARS gives for zero3 (its peak in backward too). zero3-offload
# (offload_optimizer and offload_param to the CPU) 2,287,077 real, 2,287,060 planned: 17 bytes,
# small storages the fake step does not make, of the same kind (not matched to DeepSpeed's
# allocations one by one). offload_param adds nothing on the CPU: the row read 2,287,077 with
# offload_optimizer alone too, in three launches.
# zero3-bf16 (ZeRO-3 in bf16, seq 16) 1,617,273 real, 1,617,228 planned, in four launches: its
# peak is in the optimizer step (Adam's temporaries beside the sub-group's fp32 gradient), the 45
# bytes storages the fake step does not make, matched one by one to the tracker's at its peak: five
# fp64 0-dim norms, 40 bytes (stage3.py `get_grad_norm_direct` two, `combine_grad_norm_groups` one,
# `step`'s `_global_grad_norm` and the previous step's, which engine.py `_take_model_step` holds
# until `optimizer.step()` returns), the 1-byte `inf_or_nan_tracker` (stage3.py __init__) and the
# 4-byte one-value tensor of this harness's collective fence (`_gloo_fence.install`). The whole norm
# weights (5 x 64 bf16, 640 bytes) are not alive then: `step` releases every parameter first, the
# persistent ones too (`_partition_all_parameters`); before the plan modelled it, it read 595 above.
REAL_LESS_PLAN = {"zero3-limits": 21, "zero3-offload": 17, "zero3-bf16": 45}


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    return _tracked("zero_step_profile.py", tmp_path_factory, ROWS)


def plan_of(run):
    """The plan from the run's own DeepSpeed config and sequence length, host parts included (on
    the CPU they are in the memory the tracker counts)."""
    settings = resolve_settings(deepspeed=run["deepspeed_config"], world_size=run["world_size"], batch_size=2,
                                optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=run["seq_len"], settings=settings, device_type="cpu", model_states=False)
    assert plan.settings.engine == "zero" and plan.step.problem is None, plan.step.problem
    return plan.step.peak_bytes + sum(plan.step.host_bytes.values())


@pytest.mark.parametrize("row", ROWS)
def test_zero3_peak_per_process_equals_memtrackers_on_the_real_run(zero3_runs, row):
    plan = plan_of(zero3_runs[row][0])
    peaks = [run["peak_bytes"] for run in zero3_runs[row]]
    assert peaks == [plan + REAL_LESS_PLAN[row]] * len(peaks), (plan, peaks)
