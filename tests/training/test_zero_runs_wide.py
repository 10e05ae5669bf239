"""DeepSpeed ZeRO's step plan against real runs on 4 CPU processes (gloo): ZeRO-1, ZeRO-2 and
ZeRO-2 with `offload_optimizer`, one measured step each (tests/dist_scripts/zero_step_profile.py),
each process's peak as torch's MemTracker reads it (why not the profiler:
tests/training/test_engine_runs.py), the plan made with world_size=4 from the run's own DeepSpeed
config.

One launch runs every row: 113 to 160 s on this machine, shared (the whole file 150 to 236 s,
2m15 of CPU), most of it the four processes' imports (each row 20 to 30 s). ZeRO-3 is left out to keep it
short: on 4 processes every process read 1,482,025 in each of three launches, the plan and the 21
bytes of scalars it reads on 2 (`ZERO_SCALARS`), since stage 3 splits each parameter
`ceil(numel / 4)` ways, the same on every process.

Every process is checked, not rank 0's alone. The plan is rank 0's; ZeRO-1 and 2 split the flat
16-bit group of the Trainer's two param groups into 4 equal partitions, by values, not by
parameters, so the processes hold different parameters, and their peaks differ by what their
partitions hold (below)."""

from __future__ import annotations

import functools

import pytest

from test_engine_runs import ZERO_SCALARS, _tracked, build

from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step_memory import plan_step_memory

# A torchrun job of 4 processes: 2.5 to 4 minutes here with the plans, run by .ci/run.
pytestmark = pytest.mark.slow

PROCESSES = 4
ROWS = ("zero1", "zero2", "zero2-offload")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _tracked("zero_step_profile.py", tmp_path_factory, ROWS, processes=PROCESSES)


def _hashable(value):
    return tuple(sorted((k, _hashable(v)) for k, v in value.items())) if isinstance(value, dict) else value


def _unhashable(value):
    return {k: _unhashable(v) for k, v in value} if isinstance(value, tuple) else value


def plan_of(run):
    assert run["world_size"] == PROCESSES
    return _plan(_hashable(run["deepspeed_config"]))


@functools.lru_cache(maxsize=None)  # each row's plan is read by several tests
def _plan(config):
    # The plan reads the run's own DeepSpeed config, as a user hands it over.
    settings = resolve_settings(deepspeed=_unhashable(config), world_size=PROCESSES, batch_size=2,
                                optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.engine == "zero" and plan.problem is None, plan.problem
    return plan


def device_and_host(plan):
    """The plan's peak with its host parts: on the CPU the offloaded parts are in the same memory."""
    return plan.peak_bytes + sum(plan.host_bytes.values())


# What the 4 partitions hold (DeepSpeed 0.19.8 stage_1_and_2.py: each group's flat buffer split by
# values, `get_data_parallel_partitions`): of the decay group's 114,688 values 28,672 each, of the
# no-decay group's five norms (320 values) 80 each:
#   rank 0: embed_tokens, layer 0's q, k, v; layer 0's two norms
#   rank 1: layer 0's o, gate, up, down; layer 0's post-attention norm, layer 1's input norm
#   rank 2: layer 1's q, k, v, o, gate and half of its up; layer 1's two norms
#   rank 3: the other half of layer 1's up, its down, lm_head; layer 1's post-attention norm, the final norm
# The gradient partition DeepSpeed copies the reduced gradients into (`copy_grads_in_partition`:
# `grads_in_partition`, the whole of every parameter that overlaps the partition) is 28,800 values
# on ranks 0 and 1 (115,200 bytes, the plan's) and 32,896 on ranks 2 and 3 (131,584): layer 1's
# up_proj straddles their boundary and is counted whole on both.
ATTENTION_WEIGHT = 64 * 64 * 4  # q, k, v, o: 16,384 bytes
GRAD_PARTITION_RANK0 = 28_800 * 4
STRADDLING_HALF = 4096 * 4  # the half of layer 1's up_proj ranks 2 and 3 each count beside their own: 16,384
EMBEDDING_OUTPUT_GRAD = 2 * 16 * 64 * 4  # the gradient of the embedding's output, batch 2 x 16 x 64: 8,192

# The real peak less the plan's, per rank, measured in each of three launches here (rank 0's is the
# plan and `ZERO_SCALARS`, as on 2 processes). Found by the sizes of the storages alive at each
# process's tracker peak against rank 0's (a MemTracker that keeps the live storages and their
# allocating frames at its peak, on the same script).
# ZeRO-1 without overlap_comm keeps every gradient whole to the end of backward; then
# `reduce_gradients` walks the parameters in the group's order (embed_tokens first), copying each
# gradient into the reduce bucket (its own storage freed) but those of more values than the bucket
# (4,096: the embeddings and the MLP weights), which are reduced in place and kept; the gradient
# partition is made at the first bucket reduction that holds a parameter of the process's own
# partition (`reduce_ipg_grads` → `copy_grads_in_partition`), the peak of ranks 0 to 2:
# - rank 0 (1,397,536): at the embedding's reduction, every whole gradient alive (460,032), the plan's moment;
# - rank 1 (1,332,000): at layer 0's o_proj, its q, k, v and o gradients gone into the bucket: 4 x 16,384 fewer;
# - rank 2 (1,332,000): at layer 1's q_proj, layer 0's q, k, v, o and layer 1's q gone (5 x 16,384
#   fewer), its gradient partition 16,384 larger (the straddling half);
# - rank 3 (1,290,532): its first own parameter (layer 1's up_proj) comes later, when less is alive
#   than at the end of backward, which is its peak instead: no gradient partition yet (115,200
#   fewer), the embedding's gradient being made (65,536, in place of the one rank 0 holds) with
#   the gradient of the embedding's output (8,192) and a 4-byte scalar of backward beside it.
# ZeRO-2 with offload: the plan's on ranks 0 to 2; rank 3 holds the lm_head, whose 16,384-value
# gradient's fp64 copy for its norm (`set_norm_for_param_grad_in_gpu`, 131,072 bytes, and its
# 8-byte norm) sets that process's peak: 57,608 above, as rank 1's on 2 processes
# (`RANK1_OFFLOAD_EXTRA` there), by the same storages.
REAL_LESS_PLAN = {
    "zero1": [ZERO_SCALARS["zero1"], ZERO_SCALARS["zero1"] - 4 * ATTENTION_WEIGHT,
              ZERO_SCALARS["zero1"] - 5 * ATTENTION_WEIGHT + STRADDLING_HALF,
              ZERO_SCALARS["zero1"] - GRAD_PARTITION_RANK0 + EMBEDDING_OUTPUT_GRAD + 4],
    "zero2-offload": [ZERO_SCALARS["zero2-offload"]] * 3 + [ZERO_SCALARS["zero2-offload"] + 57_608],
}


@pytest.mark.parametrize("row", list(REAL_LESS_PLAN))
def test_zero_peak_on_four_processes_equals_memtrackers_on_each(runs, row):
    plan = device_and_host(plan_of(runs[row][0]))
    peaks = [run["peak_bytes"] for run in runs[row]]
    assert peaks == [plan + extra for extra in REAL_LESS_PLAN[row]], (plan, peaks)


# ZeRO-2 on 4 processes: DeepSpeed 0.19.8 makes the gradient partition (`grads_in_partition`) at
# the first bucket reduction that holds a parameter of the process's own partition
# (`reduce_ipg_grads` → `copy_grads_in_partition`, only for `is_param_in_current_partition`), as the
# plan does (trainer_memcb/plan/engines/zero.py `_reduce`): for rank 0 (embed_tokens, layer 0's q,
# k, v and norms) at the end of backward, so rank 0 peaks in the optimizer step, 1,265,164 planned
# and 1,265,180 real (the scalars). Planned at the first reduction of backward, the lm_head's, the
# figure was 53,112 bytes above rank 0's, the partition counted beside backward's activations.
def test_zero2_peak_on_four_processes_equals_rank_0s(runs):
    plan = plan_of(runs["zero2"][0])
    assert plan.peak_phase == "optimizer step"
    assert runs["zero2"][0]["peak_bytes"] == device_and_host(plan) + ZERO_SCALARS["zero2"] == 1_265_180


def test_zero2_each_process_peaks_at_the_plans_optimizer_step_or_backward_by_its_partition(runs):
    # What each process really reads, from the plan's two phases: ranks 0 and 1 (gradient partition
    # 115,200) peak in the optimizer step, the plan's figure there and the scalars; rank 2 too, its
    # gradient partition 16,384 larger (the straddling half); rank 3 holds the lm_head, so its
    # gradient partition (131,584) is made at the lm_head's reduction, the first of backward, and it
    # peaks there, in backward: 1,203,092 alive at that moment of the plan (rank 0's; its parts
    # there, the partition not yet made), that partition and the scalars. The plan is rank 0's, so
    # that moment is no peak of its own (its backward peak, 1,251,988, comes at the end of backward
    # with rank 0's partition): rank 3's figure is held as measured.
    plan = plan_of(runs["zero2"][0])
    scalars = ZERO_SCALARS["zero2"]
    optimizer = plan.optimizer_step_peak_bytes
    assert (optimizer, plan.forward_backward_peak_bytes) == (1_265_164, 1_251_988)
    expected = [optimizer + scalars, optimizer + scalars, optimizer + scalars + STRADDLING_HALF,
                1_203_092 + GRAD_PARTITION_RANK0 + STRADDLING_HALF + scalars]
    peaks = [run["peak_bytes"] for run in runs["zero2"]]
    assert peaks == expected, (optimizer, peaks)
