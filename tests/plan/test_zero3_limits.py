"""ZeRO-3's prefetch, live-parameter limit and offload in the step plan: the coordinator's decisions
on a small trace worked by hand from DeepSpeed 0.19.8's `PartitionedParameterCoordinator`, and the
planned bytes of the tiny Llama for the settings tests/training/test_zero_runs_more.py holds to
real runs."""

from __future__ import annotations

import pytest

from test_engines import buffers_beyond_transformers_5s, build
from trainer_memcb.plan.step.engines.zero3_fetch import FetchCoordinator
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.answers.step_memory import plan_step_memory


def test_coordinator_prefetches_within_the_live_limit_and_keeps_a_use_it_passed_over():
    # The model's use, three modules of 10 values each in forward, the model's pre-backward, the
    # three in reverse; bucket 10, at most 25 values whole, every parameter released at once.
    forward = [("A", ["a"]), ("B", ["b"]), ("C", ["c"])]
    trace = [("model", [])] + forward + [("model", [])] + forward[::-1]
    coordinator = FetchCoordinator(trace, {"a": 10, "b": 10, "c": 10}, set(), prefetch_bucket_size=10,
                                   max_live_parameters=25, max_reuse_distance=0)
    fetched, released = [], []
    for index in range(len(trace)):
        fetched.append(coordinator.fetch())
        if trace[index][1]:
            released.append(coordinator.release(index))
    # Each use prefetches the next parameter; C's forward passes over its own backward use (whole)
    # and prefetches B's; the model's pre-backward has 5 values of room and takes A's (10, over
    # it: the bucket is filled until at least the room); C's backward, 30 whole, prefetches nothing.
    assert fetched == [["a"], ["b"], ["c"], ["b"], ["a"], [], [], []]
    # C stays whole from its forward to its backward: a prefetch marked that use fetched.
    assert released == [["a"], ["b"], [], ["c"], ["b"], ["a"]]
    assert coordinator.n_available == 0


def _plan(seq_len, **zero):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": dict(stage=3, overlap_comm=True, reduce_bucket_size=64 * 64, **zero)}
    settings = resolve_settings(deepspeed=config, world_size=2, batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=seq_len, settings=settings, device_type="cpu", model_states=False)
    assert plan.settings.engine == "zero" and plan.step.problem is None, plan.step.problem
    return plan


# zero_step_profile.py's zero3-limits: every parameter partitioned, released after its forward.
LIMITS = dict(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=8192,
              stage3_max_live_parameters=20_000)


@pytest.mark.parametrize("change, peak, whole", [
    # The real run's settings (real: 4,643,305 on both processes, 21 bytes of scalars more): at the
    # peak, in lm_head's backward, lm_head (16,384 values, kept whole from its forward), the final
    # norm and the last down_proj (prefetched: 64 + 8,192 values, the prefetch stopped at the
    # live limit), each whole beside its half partition: 6 bytes a value.
    ({}, 4_643_284, 6 * (16_384 + 64 + 8_192)),
    # No prefetch: each module fetches its own on demand, and the peak moves to before lm_head's
    # fetch, nothing whole.
    (dict(stage3_prefetch_bucket_size=0), 4_544_724, 0),
    # No live limit: each prefetch passes over whole parameters and marks their uses fetched, so
    # nothing is released and every parameter is whole at the peak (the plan's figure; no real
    # run of this one).
    (dict(stage3_max_live_parameters=10 ** 9), 5_004_756, 6 * 115_008),
])
def test_zero3_fetch_limits_set_the_whole_parameters_at_the_backward_peak(change, peak, whole):
    plan = _plan(128, **dict(LIMITS, **change))
    assert plan.step.peak_bytes == peak + buffers_beyond_transformers_5s()
    assert plan.step.peak_parts.get("unsharded_parameters", 0) == whole


def test_zero3_offload_keeps_the_fp32_gradient_partition_on_the_host():
    # zero_step_profile.py's zero3-offload (real: 2,287,077 on both processes, 17 bytes more): the
    # fp32 sub-group gradient (57,504 values) is on the host beside the master and the state, and
    # so are the 16-bit gradient partition and, with offload_param, the 16-bit parameter partitions
    # (57,504 values each: `offload_buffers`).
    plan = _plan(16, stage3_prefetch_bucket_size=int(0.9 * 64 * 64), stage3_param_persistence_threshold=640,
                 offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    assert plan.step.host_bytes == {"master_weights": 230_016, "optimizer_state": 460_040, "fp32_gradients": 230_016,
                               "offload_buffers": 2 * 230_016}
    assert plan.step.peak_bytes == 1_366_988 - 2 * 230_016 + buffers_beyond_transformers_5s()


def test_zero3_plan_warns_nothing_of_its_own_hooks():
    # The release hooks sit on every module with parameters, the embedding among them, whose input
    # (token ids) needs no gradient; torch warns for such a full backward hook, which is the plan's
    # own probe and nothing the user did.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _plan(16, **LIMITS)
    assert [str(w.message) for w in caught if "Full backward hook" in str(w.message)] == []
