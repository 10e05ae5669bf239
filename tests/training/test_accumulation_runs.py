"""The step plan with gradient accumulation against real runs, per process: the Trainer itself in one
process (4 micro-batches) and under torchrun on 2 CPU processes with DDP (2), and the engines' own
loops on 2 processes (2 micro-batches): DDP and FSDP2 under accelerate's `no_sync`
(tests/dist_scripts/engine_step_profile.py), DeepSpeed ZeRO-1, 2 and 3 with its accumulation
boundary (zero_step_profile.py), fp32, the tiny Llama of tests/plan/test_engines.py.

The real figure is the most bytes alive during the third optimizer step as torch's MemTracker (or
FSDPMemTracker) counts them, as in test_engine_runs.py and test_trainer_engine_runs.py; each
micro-batch has a batch of its own. Every run's peak is in a micro-batch after the first (the
plan's `peak_micro_batch`), where the gradients of the ones before it are alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import requires_torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan"))
from test_engines import build  # noqa: E402
from test_engine_runs import ZERO_SCALARS, _launch  # noqa: E402

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402

pytestmark = pytest.mark.slow

BATCH, SEQ = 2, 16


def plan(seq_len=SEQ, **flags):
    settings = resolve_settings(**flags)
    step, _ = plan_step_memory(build, seq_len=seq_len, settings=settings, device_type="cpu", model_states=False)
    assert step.step.problem is None, step.step.problem
    return step


def read(out_dir, row, processes=2):
    runs = [json.load(open(os.path.join(out_dir, row, f"rank{rank}.json"))) for rank in range(processes)]
    assert all("error" not in run for run in runs), runs
    return runs


# -- the Trainer ------------------------------------------------------------------------------------

# What the Trainer's loop holds beside the plan, by the rules of test_trainer_engine_runs.py: one
# collated batch (int64 input_ids, attention_mask and labels, 3 x 2 x 16 x 8 = 768 bytes), the next
# one, which accelerate's dataloader fetches ahead (on the host: on a GPU it is not on the device;
# every micro-batch of the step, which `Trainer.get_batch_samples` fetches before the first runs and
# keeps to its end, is in the plan); with a process group, `_prepare_input`'s copy of input_ids (`cpu:0` against `cpu`, 256
# bytes, saved by the embedding for backward); and 16 bytes of 0-dim scalars (the ddp-view row's:
# a peak in backward).
COLLATED_BATCH = 3 * BATCH * SEQ * 8
INPUT_IDS_COPY = BATCH * SEQ * 8
SCALARS = 16


def trainer_extra(process_group):
    return COLLATED_BATCH + (INPUT_IDS_COPY if process_group else 0) + SCALARS


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """`trainer_engine_step.py one-acc4` in one process without torchrun (WORLD_SIZE=1: the Trainer
    makes no process group and does not wrap the model)."""
    import test_distributed

    out_dir = str(tmp_path_factory.mktemp("one-process-run"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RANK="0",
               WORLD_SIZE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [test_distributed.REPO_ROOT, env.get("PYTHONPATH")]))
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    script = os.path.join(test_distributed.SCRIPTS_DIR, "trainer_engine_step.py")
    done = subprocess.run([sys.executable, script, out_dir, "one-acc4"], env=env, cwd=out_dir, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return read(out_dir, "one-acc4", processes=1)[0]


def test_trainer_with_accumulation_4_in_one_process_peaks_at_the_plan_and_its_batches(one_process_run):
    run = one_process_run
    assert (run["model_wrapped"], run["global_step"], run["world_size"]) == ("LlamaForCausalLM", 3, 1)
    settings = resolve_settings(run["training_args"], world_size=1)
    assert (settings.gradient_accumulation_steps, settings.sources["gradient_accumulation_steps"]) == (4, "training args")
    step, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu", model_states=False)
    # The second micro-batch's backward, every gradient of the first alive and the four micro-batches'
    # batches: 2,273,056 (the third and the last read the same); without accumulation the plan said
    # 2,004,888, 13% under the real run.
    assert (step.settings.gradient_accumulation_steps, step.step.peak_micro_batch, step.step.peak_phase) == (4, 2, "backward")
    assert step.step.micro_batch_peak_bytes == [[1, 1_851_552], [2, 2_273_056], [4, 2_273_056]]
    # Real 2,273,840 = 2,273,056 + 768 (the next collated batch) + 16.
    assert run["peak_bytes"] == step.step.peak_bytes + trainer_extra(process_group=False), (step.step.peak_bytes, run["peak_bytes"])
    assert plan(batch_size=BATCH, optimizer="adamw_torch").step.peak_bytes == 2_004_888


@pytest.fixture(scope="module")
def trainer_ddp_run(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("trainer-ddp-accumulation"))
    _launch("trainer_engine_step.py", out_dir, ["ddp-acc2"])
    return read(out_dir, "ddp-acc2")


def test_trainers_ddp_with_accumulation_2_peaks_at_the_plan_per_process(trainer_ddp_run):
    assert [r["model_wrapped"] for r in trainer_ddp_run] == ["DistributedDataParallel"] * 2
    settings = resolve_settings(trainer_ddp_run[0]["training_args"], world_size=2)
    step, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu", model_states=False)
    assert (step.settings.engine, step.settings.gradient_accumulation_steps, step.step.peak_micro_batch) == ("ddp", 2, 2)
    # Real 2,732,760 on both = 2,731,720 (with the reducer's used-parameter maps) + 1,040.
    peaks = [r["peak_bytes"] for r in trainer_ddp_run]
    assert peaks == [step.step.peak_bytes + trainer_extra(process_group=True)] * 2, (step.step.peak_bytes, peaks)


# -- the engines' own loops -----------------------------------------------------------------------

ENGINES = {"ddp-acc2": dict(sharding="ddp"), "ddp-view-acc2": dict(sharding="ddp", gradient_as_bucket_view=True),
           "fsdp2-acc2": dict(sharding="fsdp-full-shard"), "fsdp2-sgo-acc2": dict(sharding="fsdp-shard-grad-op")}
# FSDP2's last micro-batch reduce-scatters: now and then (two processes of six here) gloo's work still
# holds a collective's buffers at that micro-batch's peak, 49,152 bytes more than the plan's, by timing
# (test_engine_runs.py's LATE_COLLECTIVE_BUFFER, the same effect); each process reads the plan or that.
LATE_REDUCE_SCATTER = 49_152


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("accumulating-engines"))
    _launch("engine_step_profile.py", out_dir, [f"{engine}-memtracker" for engine in ENGINES])
    return {engine: [run["peak_bytes"] for run in read(out_dir, f"{engine}-memtracker")] for engine in ENGINES}


@requires_torch("2.13", "the FSDP2 plan needs torch 2.13's fake collectives (tests/plan/test_engines.py)")
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engines_with_accumulation_2_peak_per_process_at_the_plan(engine_runs, engine):
    step = plan(world_size=2, batch_size=BATCH, optimizer="adamw_torch", gradient_accumulation_steps=2,
                **ENGINES[engine])
    assert step.step.peak_micro_batch == 2
    # ddp and ddp-view 2,731,552 (with accumulation the gradients are fresh tensors beside the
    # buckets until the last micro-batch, with or without the bucket view); fsdp2 1,967,648 (the
    # first micro-batch's unsharded gradients kept); fsdp2-sgo 2,165,428; each with both
    # micro-batches' batches.
    peaks = engine_runs[engine]
    late = LATE_REDUCE_SCATTER if engine == "fsdp2-acc2" else 0
    assert all(real in (step.step.peak_bytes, step.step.peak_bytes + late) for real in peaks), (step.step.peak_bytes, peaks)


ZERO_ROWS = ("zero1-acc2", "zero2-acc2", "zero3-acc2", "zero2-offload-acc2")


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("accumulating-zero"))
    _launch("zero_step_profile.py", out_dir, [f"{row}-memtracker" for row in ZERO_ROWS])
    return {row: read(out_dir, f"{row}-memtracker") for row in ZERO_ROWS}


@pytest.mark.parametrize("row", ZERO_ROWS)
def test_zero_with_accumulation_2_peaks_per_process_at_the_plan(zero_runs, row):
    runs = zero_runs[row]
    # The run's own DeepSpeed config (gradient_accumulation_steps 2), at its 64 tokens: the peak is
    # then in the second micro-batch's backward for ZeRO-1 (the whole gradients accumulated, and
    # the bucket kept from the first) and ZeRO-2 (the first micro-batch's gradient partition kept),
    # in the first for ZeRO-3 (its gradient partition is accumulated in place: every micro-batch
    # peaks alike).
    plans = [plan(seq_len=run["seq_len"], deepspeed=run["deepspeed_config"], world_size=2, rank=rank,
                  batch_size=BATCH, optimizer="adamw_torch") for rank, run in enumerate(runs)]
    # With offload_optimizer the device's peak is in the first micro-batch too: the gradients go to
    # the host as they are reduced.
    first = row in ("zero3-acc2", "zero2-offload-acc2")
    assert {(p.settings.gradient_accumulation_steps, p.step.peak_micro_batch) for p in plans} == {(2, 1 if first else 2)}
    # zero1 3,315,668, zero2 3,069,396, zero3 3,315,668 on both; zero2-offload 3,660,500 with its host
    # parts (on the CPU one memory with the device's), among them the host buffers the partition's
    # gradients accumulate in (230,144 bytes: its parameters' whole sizes). The real runs read
    # DeepSpeed's 0-dim scalars more, as without accumulation (test_engine_runs.py).
    scalars = ZERO_SCALARS[row.replace("-acc2", "")]
    figures = [p.step.peak_bytes + sum(p.step.host_bytes.values()) for p in plans]
    assert [run["peak_bytes"] for run in runs] == [figure + scalars for figure in figures], \
        (figures, [run["peak_bytes"] for run in runs])
