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


# ZeRO-2 on 4 processes: the plan is wrong for rank 0. It makes the gradient partition
# (`grads_in_partition`, 115,200 bytes) at the first reduction of backward, the lm_head's, while
# the activations are still alive (trainer_memcb/plan/engines/zero.py `_reduce`); DeepSpeed 0.19.8
# makes it at the first bucket reduction that holds a parameter of the process's own partition
# (`reduce_ipg_grads` → `copy_grads_in_partition`, only for `is_param_in_current_partition`): for
# rank 0 (embed_tokens, layer 0's q, k, v and norms) at the end of backward. The plan's backward
# peak, 1,318,292, is that of rank 3's moment with rank 0's partition; rank 0's real backward holds
# 115,200 fewer (1,203,092 by the plan's parts), below the optimizer step, where its real peak is:
# 1,265,180, the plan's optimizer-step peak (1,265,164) and the 16 bytes of scalars. On 2
# processes the peak is in the optimizer step either way, so the plan read right there. Tried with
# `_reduce` patched for the run (outside the package) to make the partition at the first reduction
# of a parameter overlapping rank 0's partition (`_in_partition`, as the offload path computes it):
# the plan reads 1,265,164 in the optimizer step, rank 0's real peak less the 16 bytes; ZeRO-1 on 4
# (1,397,520) and ZeRO-1 and 2 on 2 processes (2,069,196 each) unchanged.
ZERO2_PLAN_WRONG = ("the plan makes ZeRO-2's gradient partition at the first reduction of backward; DeepSpeed "
                    "makes it at the first reduction of a parameter in the process's own partition, for rank 0 at "
                    "the end of backward: on 4 processes the plan's backward peak is 53,112 bytes above rank 0's "
                    "real peak, which is in the optimizer step")


@pytest.mark.xfail(strict=True, reason=ZERO2_PLAN_WRONG)
def test_zero2_peak_on_four_processes_equals_rank_0s(runs):
    plan = device_and_host(plan_of(runs["zero2"][0]))
    assert runs["zero2"][0]["peak_bytes"] == plan + ZERO_SCALARS["zero2"]


def test_zero2_each_process_peaks_at_the_plans_optimizer_step_or_backward_by_its_partition(runs):
    # What each process really reads, from the plan's two phases: ranks 0 and 1 (gradient partition
    # 115,200) peak in the optimizer step, the plan's figure there and the scalars; rank 2 too, its
    # gradient partition 16,384 larger (the straddling half); rank 3 holds the lm_head, so its
    # gradient partition is made at the lm_head's reduction, as the plan makes rank 0's, and it
    # peaks in backward at the plan's backward moment, its partition 16,384 larger.
    plan = plan_of(runs["zero2"][0])
    assert plan.peak_phase == "backward"
    scalars = ZERO_SCALARS["zero2"]
    optimizer, backward = plan.optimizer_step_peak_bytes, plan.peak_bytes
    expected = [optimizer + scalars, optimizer + scalars, optimizer + scalars + STRADDLING_HALF,
                backward + scalars + STRADDLING_HALF]
    peaks = [run["peak_bytes"] for run in runs["zero2"]]
    assert peaks == expected, (optimizer, backward, peaks)
