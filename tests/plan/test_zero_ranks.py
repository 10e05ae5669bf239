"""The step plan of one process among several: DeepSpeed ZeRO-1/2 split each param group's flat
buffer by values, so each rank's partition holds other parameters, and what its process keeps and
when it makes its gradient partition differ by rank (`StepSettings.rank`, the command's --rank).
The figures are those the real runs read on 4 CPU processes, the 16 bytes of DeepSpeed's scalars
apart (tests/training/test_zero_runs_wide.py holds them to the runs); here they are held without a
launch, with why each differs from rank 0's."""

from __future__ import annotations

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist_scripts"))
from helpers import requires_torch  # noqa: E402
from test_engines import buffers_beyond_transformers_5s, build  # noqa: E402
from zero_step_profile import ROWS  # noqa: E402  (the real runs' own DeepSpeed configs)

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402

WORLD = 4
# The figures below are with transformers 5's model buffers; 4.57 keeps 32 bytes more of them.
BUFFERS = buffers_beyond_transformers_5s()
ATTENTION_WEIGHT = 64 * 64 * 4  # q, k, v, o of the tiny Llama: 16,384 bytes each


@functools.lru_cache(maxsize=None)  # a plan read by two tests is made once
def plan_for(row, rank):
    settings = resolve_settings(deepspeed=ROWS[row], world_size=WORLD, rank=rank, batch_size=2,
                                optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.problem is None, plan.step.problem
    return plan


def test_zero1_each_rank_peaks_at_its_own_partitions_first_bucket_reduction():
    # Partitions of the decay group's 114,688 values, 28,672 each: rank 0 embed_tokens and layer
    # 0's q, k, v; rank 1 layer 0's o, gate, up, down; rank 2 layer 1's q to half of its up; rank 3
    # the rest and the lm_head. ZeRO-1 keeps the gradients whole to the end of backward, then
    # walks them through the bucket (4,096 values): each of q, k, v, o is copied in (its own
    # storage freed), a larger one is kept whole, and ZeRO-1 frees none of another partition's.
    # The gradient partition is made at the reduction of the bucket holding the rank's first own
    # gradient: rank 0 at the embedding's, with every gradient whole; ranks 1 and 2 once layer 0's
    # q, k, v and o (rank 2: layer 1's q instead of layer 0's o) are in the bucket, 4 of them
    # gone, rank 2's partition a half up_proj (16,384) larger; rank 3's first own gradient comes
    # so late that it peaks at the end of backward, without its partition.
    # (Rank 2 reads rank 1's figure: tests/training/test_zero_runs_wide.py holds all four to runs.)
    peaks = [plan_for("zero1", rank).step.peak_bytes for rank in (0, 1, 3)]
    assert peaks == [figure + BUFFERS for figure in (1_397_520, 1_331_984, 1_290_516)]
    assert peaks[0] - peaks[1] == 4 * ATTENTION_WEIGHT


def test_zero2_the_rank_holding_the_head_makes_its_partition_at_the_first_reduction_of_backward():
    # Rank 0 peaks in the optimizer step; rank 3's partition, made at the lm_head's reduction (the
    # first of backward), lives beside backward's activations, where it peaks.
    plans = [plan_for("zero2", rank) for rank in (0, 3)]
    assert [plan.step.peak_bytes for plan in plans] == [1_265_164 + BUFFERS, 1_334_676 + BUFFERS]
    assert [plan.step.peak_phase for plan in plans] == ["optimizer step", "backward"]


def test_zero2_with_offload_the_rank_holding_the_head_copies_its_gradient_slice_to_fp64_for_its_norm():
    plans = [plan_for("zero2-offload", rank) for rank in (0, 3)]
    host = [plan.step.peak_bytes + sum(plan.step.host_bytes.values()) for plan in plans]
    # set_norm_for_param_grad_in_gpu: the lm_head's 16,384 values in fp64 (131,072 bytes) and the
    # 8-byte norm kept, at the moment of that reduction.
    assert host == [1_637_652 + BUFFERS, 1_695_260 + BUFFERS]


@requires_torch("2.13", "the FSDP2 plan needs torch 2.13's fake collectives (tests/plan/test_engines.py)")
def test_fsdp2_on_an_uneven_split_the_last_rank_holds_less_optimizer_state_and_no_second_copy_of_its_shards():
    # Over 3 processes the tiny Llama's 64- and 128-row weights split 22/22/20 and 43/43/42. Every
    # process's shard storage is padded to chunk 0's size, but AdamW makes its moments like the
    # unpadded shard, so rank 2 holds 16,464 bytes less state. (Before FSDP2's lazy init was let
    # see, under fake tensors, that a shard was unchanged, rank 2's plan held every shard twice,
    # 156,088 bytes more: tests/training/test_engine_runs_uneven.py holds all three to real runs.)
    plans = [plan_step_memory(build, seq_len=16, settings=resolve_settings(
        world_size=3, rank=rank, batch_size=2, optimizer="adamw_torch", sharding="fsdp-full-shard"),
        device_type="cpu", model_states=False)[0] for rank in (0, 2)]
    assert [plan.step.peak_bytes for plan in plans] == [1_385_648 + BUFFERS, 1_369_184 + BUFFERS]
    assert plans[0].step.peak_parts["optimizer_state"] - plans[1].step.peak_parts["optimizer_state"] == 16_464
    assert plans[0].step.peak_parts["other"] == plans[1].step.peak_parts["other"] == 8_204


@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_outside_the_world_is_refused_naming_what_is_allowed(rank):
    with pytest.raises(ValueError, match=rf"rank={rank} is not a process of world_size=4: expected 0 to 3"):
        resolve_settings(world_size=4, rank=rank, sharding="zero2")


def test_the_rank_is_among_the_settings_the_plan_says_it_used():
    plan = plan_for("zero2", 3)
    assert ["rank", 3, "flag"] in [list(row) for row in plan.settings.used]
    assert any(note.startswith("ZeRO-2: the figures of rank 3's process") for note in plan.step.notes), plan.step.notes
