"""The step plan per engine against real runs: torchrun on 2 CPU processes (gloo), one profiled
step each (tests/dist_scripts/engine_step_profile.py for DDP, zero_step_profile.py for DeepSpeed
ZeRO, fp32), per process.

One launch runs every DDP engine, one every ZeRO row (about 40 s each on this machine). The plan is rank 0's (the fullest:
its shards hold the padded rows); the profiler's figure is the most bytes alive during the second
real step, counted from before the model was made, so that what the engine allocates when it wraps
the model (DDP's buckets) is in it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers import requires_torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan"))
from test_engines import build  # noqa: E402

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.step_memory import plan_step_memory  # noqa: E402

# Real runs (torchrun jobs, or a dozen Trainer evaluations): minutes here, run by .ci/run.
pytestmark = pytest.mark.slow

ENGINES = {"ddp": dict(sharding="ddp"), "ddp-view": dict(sharding="ddp", gradient_as_bucket_view=True)}


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory):
    import test_distributed

    out_dir = str(tmp_path_factory.mktemp("engine-runs"))
    _launch("engine_step_profile.py", out_dir, list(ENGINES))
    peaks = {}
    for engine in ENGINES:
        peaks[engine] = [json.load(open(os.path.join(out_dir, engine, f"rank{rank}.json")))["peak_bytes"]
                         for rank in range(test_distributed.PROCESSES)]
    return peaks


def _launch(script, out_dir, engines):
    import subprocess

    import test_distributed

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [test_distributed.REPO_ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={test_distributed.PROCESSES}", os.path.join(test_distributed.SCRIPTS_DIR, script),
               out_dir, *engines]
    done = subprocess.run(command, env=env, cwd=out_dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


def plan_of(engine):
    settings = resolve_settings(world_size=2, batch_size=2, optimizer="adamw_torch", **ENGINES[engine])
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    return plan


# Measured here over seven launches (plan; the profiler's per process): ddp 2,464,664; 2,464,740 to
# 2,465,268. ddp with gradient_as_bucket_view 2,270,496; 2,270,496 to 2,271,220. The plan is never
# above, and the gap moves from run to run: the fake trace does not see a few 0-dim scalars (as in
# the one-process comparison, tests/plan/test_step_memory.py: 12 bytes on the quietest runs), and
# gloo's asynchronous work keeps small tensors of the previous step alive for a while, by timing
# (at most 724 bytes seen). Hence 1 KiB.
TOLERANCE = 1024


@pytest.mark.parametrize("engine", list(ENGINES))
def test_ddp_peak_per_process_equals_the_profilers(real_peaks, engine):
    plan = plan_of(engine)
    assert plan.engine == "ddp"
    # Every process holds at least the plan, and one holds it within the tolerance. In about half the
    # launches here the other process read 460,236 bytes more than the plan (2,924,840 against
    # 2,464,664 once): not explained yet, and not asserted until it is.
    peaks = real_peaks[engine]
    assert all(real >= plan.peak_bytes for real in peaks), (plan.peak_bytes, peaks)
    assert min(peaks) - plan.peak_bytes <= TOLERANCE, (plan.peak_bytes, peaks)


# -- DeepSpeed ZeRO (tests/dist_scripts/zero_step_profile.py): one launch for every row --------------

ZERO_ROWS = ("zero1", "zero1-overlap", "zero2", "zero2-overlap", "zero2-offload", "zero3-no-overlap", "zero3")


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    import test_distributed

    out_dir = str(tmp_path_factory.mktemp("zero-runs"))
    _launch("zero_step_profile.py", out_dir, list(ZERO_ROWS))
    return {row: [json.load(open(os.path.join(out_dir, row, f"rank{rank}.json")))
                  for rank in range(test_distributed.PROCESSES)] for row in ZERO_ROWS}


def zero_plan_of(run):
    # The plan reads the run's own DeepSpeed config, as a user hands it over.
    settings = resolve_settings(deepspeed=run["deepspeed_config"], world_size=run["world_size"], batch_size=2,
                                optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.engine == "zero" and plan.problem is None, plan.problem
    # On the CPU the offloaded parts are in the same memory the profiler counts.
    return plan.peak_bytes + sum(plan.host_bytes.values())


# What the fake step does not make: DeepSpeed's 0-dim fp32 scalars alive at the optimizer step's
# peak (the norm of each group's gradient partition and their combination, `get_grad_norm_direct`
# and `combine_grad_norm_groups` under `scaled_global_norm`, the clip coefficient): 24 bytes in
# every launch here (the rest of the step, to the byte, as the plan has it). Exact, no tolerance.
ZERO_SCALARS = 24


@pytest.mark.parametrize("row", ["zero1", "zero1-overlap", "zero2", "zero2-overlap"])
def test_zero12_peak_on_the_closer_process_equals_the_profilers(zero_runs, row):
    plan = zero_plan_of(zero_runs[row][0])
    peaks = [run["peak_bytes"] for run in zero_runs[row]]
    # Measured over four launches: the plan 2,069,196 for each row, the closer process 2,069,220
    # every time. The other process read the same in most launches, and 32,768, 65,536 or 131,072
    # bytes more in some (with and without overlap_comm): whole multiples of the gradients larger
    # than the 4,096-value bucket (8,192-value MLP weights, 16,384-value embedding and head), that
    # DeepSpeed reduces in place (`reduce_ipg_grads`, `extra_large_param_to_reduce`), whose free
    # the profiler did not see. Not explained yet, so only the closer process is held to the plan.
    assert all(real >= plan + ZERO_SCALARS for real in peaks), (plan, peaks)
    assert min(peaks) == plan + ZERO_SCALARS, (plan, peaks)


@pytest.mark.xfail(strict=True, reason="ZeRO-3: the plan (2,056,404, in backward: every parameter whole beside its "
                   "partition, kept from forward to backward within stage3_max_reuse_distance) is 66,705 to 423,000 "
                   "bytes under the processes here (2,123,109 to 2,479,105, by launch): the prefetch is not modelled, "
                   "and gloo's reduce_scatter_tensor fallback (reduce_scatter_single) makes temporaries whose frees the "
                   "profiler misses where the ProcessGroup is called below the fenced functions")
@pytest.mark.parametrize("row", ["zero3-no-overlap", "zero3"])
def test_zero3_peak_per_process_equals_the_profilers(zero_runs, row):
    plan = zero_plan_of(zero_runs[row][0])
    peaks = [run["peak_bytes"] for run in zero_runs[row]]
    assert min(peaks) - plan <= 1024, (plan, peaks)


# ZeRO-2 with offload_optimizer (the Trainer's torch AdamW as the client optimizer): the peak is in
# backward, when the lm_head's gradient (16,384 values, more than the 4,096-value bucket) is cloned
# beside the one autograd made (`_offload_gradient_safety_enabled`). What the fake step does not
# make there: three 0-dim scalars of DeepSpeed's (the loss scale's and the reduction's, 12 bytes).
# Rank 0 only: the plan is its partition (embedding and the first layers); rank 1's holds the
# lm_head, whose gradient's fp64 copy for its norm (`set_norm_for_param_grad_in_gpu`, 131,072
# bytes) makes its peak 57,620 bytes higher, real and not planned.
OFFLOAD_SCALARS = 12


def test_zero2_offload_peak_on_rank0_equals_the_profilers(zero_runs):
    runs = zero_runs["zero2-offload"]
    plan = zero_plan_of(runs[0])
    assert runs[0]["peak_bytes"] == plan + OFFLOAD_SCALARS, (plan, [run["peak_bytes"] for run in runs])


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
# collective buffer (41,088 fp32 values: 164,352 bytes). Real memory, held by timing: the lesser
# process is held to the figure above, each process to at most one such buffer more.
LATE_COLLECTIVE_BUFFER = 164_352


@pytest.fixture(scope="module")
def fsdp2_tracked_peaks(tmp_path_factory):
    import test_distributed

    out_dir = str(tmp_path_factory.mktemp("fsdp2-runs"))
    names = [f"{engine}-memtracker" for engine in FSDP2_ENGINES]
    _launch("engine_step_profile.py", out_dir, names)
    return {engine: [json.load(open(os.path.join(out_dir, name, f"rank{rank}.json")))["peak_bytes"]
                     for rank in range(test_distributed.PROCESSES)]
            for engine, name in zip(FSDP2_ENGINES, names)}


@requires_torch("2.13", "the FSDP2 plan needs torch 2.13's fake collectives (tests/plan/test_engines.py)")
@pytest.mark.parametrize("engine", list(FSDP2_ENGINES))
def test_fsdp2_peak_per_process_equals_fsdp_memtrackers_on_the_real_run(fsdp2_tracked_peaks, engine):
    settings = resolve_settings(world_size=2, batch_size=2, optimizer="adamw_torch", **FSDP2_ENGINES[engine])
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.engine == "fsdp2"
    peaks = fsdp2_tracked_peaks[engine]
    assert min(peaks) == plan.peak_bytes + FSDP2_REAL_LESS_PLAN[engine], (plan.peak_bytes, peaks)
    assert all(real - plan.peak_bytes <= LATE_COLLECTIVE_BUFFER for real in peaks), (plan.peak_bytes, peaks)
