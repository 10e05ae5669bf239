"""The step plan per engine against real runs: torchrun on 2 CPU processes (gloo), one measured
step each (tests/dist_scripts/engine_step_profile.py for DDP and FSDP2, zero_step_profile.py for
DeepSpeed ZeRO, fp32), per process.

One launch runs every DDP engine, one every ZeRO row, one every FSDP2 engine (25 to 75 s each on
this machine). The plan is rank 0's (the fullest: its shards hold the padded rows); the real figure
is the most bytes alive during the third real step as torch's memory tracker counts them (see
below), counted from before the model was made, so that what the engine allocates when it wraps
the model (DDP's buckets, DeepSpeed's flat partitions and optimizer state) is in it."""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers import requires_torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan"))
from test_engines import build  # noqa: E402

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402

# Real runs (torchrun jobs, or a dozen Trainer evaluations): minutes here, run by .ci/run.
pytestmark = pytest.mark.slow

ENGINES = {"ddp": dict(sharding="ddp"), "ddp-view": dict(sharding="ddp", gradient_as_bucket_view=True)}


def _launch(script, out_dir, engines, processes=None):
    """Run `script OUT_DIR ENGINE...` under torchrun on `processes` (test_distributed's 2 unless given)."""
    import subprocess

    import test_distributed

    processes = processes or test_distributed.PROCESSES

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [test_distributed.REPO_ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", os.path.join(test_distributed.SCRIPTS_DIR, script),
               out_dir, *engines]
    # 600 s: a 4-process launch took 300 s here beside other jobs.
    done = subprocess.run(command, env=env, cwd=out_dir, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


def _tracked(script, tmp_path_factory, rows, processes=None):
    """Each row's `ROW-memtracker` run: torch's MemTracker on the real step, per process."""
    import test_distributed

    processes = processes or test_distributed.PROCESSES
    out_dir = str(tmp_path_factory.mktemp("tracked-runs"))
    _launch(script, out_dir, [f"{row}-memtracker" for row in rows], processes)
    return {row: [json.load(open(os.path.join(out_dir, f"{row}-memtracker", f"rank{rank}.json")))
                  for rank in range(processes)] for row in rows}


# The judge of every real run below is torch's MemTracker (torch.distributed._tools.mem_tracker),
# not torch.profiler: on the CPU the profiler records memory events on the thread it was started
# on only, and gloo's worker thread drops the last reference to the tensors DDP's reducer and
# DeepSpeed hand their collectives (and makes gloo's own temporaries), by timing; the fence of
# tests/dist_scripts/_gloo_fence.py covers the Python collectives only. Its running sum drifted
# here: DDP 460,236 bytes above the plan on one process in half the launches; ZeRO-3 66,705 to
# 423,000 above; ZeRO-2 with offload 33,036 above on rank 0 in one launch of three. The tracker
# follows each storage made under it to its end by a weak reference, whichever thread drops it,
# and read the same on both processes in every launch here (three to five per ZeRO row, four for DDP).
@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """The DDP and FSDP2 rows (below), each under its tracker, in one launch: most of a launch's
    time is its processes' start."""
    return _tracked("engine_step_profile.py", tmp_path_factory, list(ENGINES) + list(FSDP2_ENGINES))


@pytest.fixture(scope="module")
def ddp_tracked(engine_runs):
    return {engine: engine_runs[engine] for engine in ENGINES}


def plan_of(engine):
    settings = resolve_settings(world_size=2, batch_size=2, optimizer="adamw_torch", **ENGINES[engine])
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    return plan


@pytest.mark.parametrize("engine", list(ENGINES))
def test_ddp_peak_per_process_equals_memtrackers_on_the_real_run(ddp_tracked, engine):
    plan = plan_of(engine)
    assert plan.settings.engine == "ddp"
    # Both processes, to the byte, in every launch here: ddp 2,464,920, with gradient_as_bucket_view
    # 2,270,752 (the profiler read up to 460,236 bytes more on one process).
    peaks = [run["peak_bytes"] for run in ddp_tracked[engine]]
    assert peaks == [plan.step.peak_bytes] * len(peaks), (plan.step.peak_bytes, peaks)


# -- DeepSpeed ZeRO (tests/dist_scripts/zero_step_profile.py): one launch for every row --------------

ZERO_ROWS = ("zero1", "zero1-overlap", "zero2", "zero2-overlap", "zero2-offload", "zero3-no-overlap", "zero3")


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    return _tracked("zero_step_profile.py", tmp_path_factory, ZERO_ROWS)


def zero_plan_of(run, rank=0):
    # The plan reads the run's own DeepSpeed config, as a user hands it over, for the process asked.
    settings = resolve_settings(deepspeed=run["deepspeed_config"], world_size=run["world_size"], rank=rank,
                                batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.settings.engine == "zero" and plan.step.problem is None, plan.step.problem
    # On the CPU the offloaded parts are in the same memory the tracker counts.
    return plan.step.peak_bytes + sum(plan.step.host_bytes.values())


# What the fake step does not make, found by comparing the sizes of the storages alive at the
# plan's peak and at the tracker's (zero2, zero2-offload, zero3; the other rows read the same
# totals): a few of DeepSpeed's 0-dim scalars. ZeRO-2 (peak in the optimizer step) and ZeRO-2 with
# offload (in backward): four fp32 ones, 16 bytes. ZeRO-3 (in backward): 21 bytes, one 8-byte and
# three 4-byte scalars and the 1-byte `inf_or_nan_tracker` (stage3.py __init__). Every other byte is
# the plan's (ZeRO-1/2's 16-bit parameters are views of two flat buffers there, 458,752 and 1,280
# bytes, where the plan has one storage per parameter: the same bytes).
ZERO_SCALARS = {"zero1": 16, "zero1-overlap": 16, "zero2": 16, "zero2-overlap": 16, "zero2-offload": 16,
                "zero3-no-overlap": 21, "zero3": 21}
# ZeRO-2 with offload: rank 0's partition holds the embedding and the first layers, rank 1's the
# lm_head, whose 16,384-value gradient's fp64 copy for its norm (`set_norm_for_param_grad_in_gpu`,
# 131,072 bytes, and its 8-byte norm) sets that process's peak: its plan is 57,608 bytes above
# rank 0's, as its real run reads in every launch. The other rows' partitions peak alike.
RANK1_OFFLOAD_EXTRA = 57_608


@pytest.mark.parametrize("row", ZERO_ROWS)
def test_zero_peak_per_process_equals_memtrackers_on_the_real_run(zero_runs, row):
    plans = [zero_plan_of(run, rank) for rank, run in enumerate(zero_runs[row])]
    peaks = [run["peak_bytes"] for run in zero_runs[row]]
    assert peaks == [plan + ZERO_SCALARS[row] for plan in plans], (plans, peaks)
    assert plans[1] - plans[0] == (RANK1_OFFLOAD_EXTRA if row == "zero2-offload" else 0)


# -- FSDP2 ------------------------------------------------------------------------------------------

# FSDP2 against torch's FSDPMemTracker on the real run (gloo, 2 processes, the third step), not the
# profiler: on the CPU, torch.profiler records memory events on the threads it was started on only
# (a tensor made on the main thread and freed on another stays alive in its sum; one made on
# another is never seen), and gloo's worker threads drop the last reference to the tensors FSDP2
# hands its collectives, by timing. Its sum therefore drifts: 0.5 to 1.0 MB above the plan here,
# different on each process and launch, with 168 bytes of tensors Python could still reach at the
# measured step's start beside the states. The tracker follows each storage by its tensors'
# lifetimes and FSDP2's resizes, and reads the same on both processes and on every step.
FSDP2_ENGINES = {"fsdp2": dict(sharding="fsdp-full-shard"), "fsdp2-sgo": dict(sharding="fsdp-shard-grad-op")}
# The real peak less the plan's, measured: shard-grad-op 0 (1,704,628 both); full shard 256 bytes
# (1,622,048 against 1,621,792), from the first real step on. The same tracker on the plan's fake
# step reads 1,621,788 (the plan's 4-byte num_items_in_batch apart, as in tests/plan/test_engines.py),
# so the 256 bytes are the real run's. By storage sizes at the two peaks (the plan's own tracker run
# over the real step reads 1,622,048 too): the real one holds one layer's flat all-gather buffer
# (164,352 bytes) where the plan's holds that layer's unsharded parameters but one 64-value norm
# weight (4 x 16,384 + 3 x 32,768 + 256 = 164,096): the same step, its peak a moment apart around
# one all-gather, as gloo's and the fake group's collectives order their buffers' lives.
FSDP2_REAL_LESS_PLAN = {"fsdp2": 256, "fsdp2-sgo": 0}
# The tensors a collective was handed are held by gloo's work until its worker thread is done with
# them, so now and then one is freed later than in the fake step, which completes at once: in one
# launch of six here one process of the full shard read 1,786,144, the plan and one layer's
# collective buffer (41,088 fp32 values: 164,352 bytes), and in about one launch of ten both did.
# Real memory, held by timing: each process reads one of the two exact figures, the plan and the
# difference above or the plan and one such buffer.
LATE_COLLECTIVE_BUFFER = 164_352


@pytest.fixture(scope="module")
def fsdp2_tracked_peaks(engine_runs):
    return {engine: [run["peak_bytes"] for run in engine_runs[engine]] for engine in FSDP2_ENGINES}


@requires_torch("2.13", "the FSDP2 plan needs torch 2.13's fake collectives (tests/plan/test_engines.py)")
@pytest.mark.parametrize("engine", list(FSDP2_ENGINES))
def test_fsdp2_peak_per_process_equals_fsdp_memtrackers_on_the_real_run(fsdp2_tracked_peaks, engine):
    settings = resolve_settings(world_size=2, batch_size=2, optimizer="adamw_torch", **FSDP2_ENGINES[engine])
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.settings.engine == "fsdp2"
    peaks = fsdp2_tracked_peaks[engine]
    on_time, late = plan.step.peak_bytes + FSDP2_REAL_LESS_PLAN[engine], plan.step.peak_bytes + LATE_COLLECTIVE_BUFFER
    assert all(real in (on_time, late) for real in peaks), (plan.step.peak_bytes, peaks)
