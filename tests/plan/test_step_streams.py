"""The step plan's CUDA streams: each engine's allocations on the stream the engine makes them on,
and the allocator replay's per-stream pools, on tiny Llamas.

No GPU runs here: which allocation is on which stream is read from the sources (torch 2.13's
`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py` and `_fsdp_param_group.py`, DDP's
`reducer.cpp`, ProcessGroupNCCL's `collective`), and the FSDP2 plan finds it by running the real
`fully_shard` on the CPU, whose `torch.cpu.stream` sets the current stream as `torch.cuda.stream`
would. The reserved figures are the allocator model's (`tests/plan/device/` replays real traces
with side streams through it).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections import Counter

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

from helpers import tiny_llama_config
from trainer_memcb.plan.answers.plan_snapshot import plan_snapshot
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.answers.step_replay import replay_step, step_allocations
from trainer_memcb.plan.device.caching_allocator import CachingAllocatorModel
from trainer_memcb.plan.device.snapshot_replay import replay_snapshot
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.engines.fsdp2 import FSDP2_STREAMS
from trainer_memcb.plan.step.engines.zero import REDUCTION_STREAM, ZERO3_STREAMS
from trainer_memcb.plan.step.trace import trace_step

# Figures counted on torch 2.13 and transformers 5 (tests/plan/test_step_replay.py says why the
# oldest releases differ: model buffers, and torch 2.6's fake process group cannot all-gather).
pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
    or int(transformers.__version__.split(".")[0]) < 5,
    reason="figures counted on torch 2.13 and transformers 5")

MiB = 1024 ** 2
SMALL_SEGMENT = 2 * MiB  # kSmallBuffer: a request of at most 1 MiB takes a 2 MiB segment
COPY_IN, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = 1, 2, 3, 4
# The tiny Llama (hidden 64, 2 layers, vocab 256): FSDP2 groups each decoder layer (41,088
# parameters) and the root (embedding and head 2 x 16,384, final norm 64: 32,832).
LAYER, ROOT = 41_088, 32_832


def build():
    config = tiny_llama_config("sdpa", vocab_size=256, max_position_embeddings=2048)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def traced(**given):
    settings = resolve_settings(batch_size=2, seq_len=16, optimizer="adamw_torch", device_type="cuda", **given)
    return trace_step(build(), settings, args=None, step_dtype=torch.float32)


def on_streams(timeline):
    """(stream, part, bytes) -> how many storages, for those off the default stream and the engine's buffers."""
    return Counter((timeline.streams.get(serial, 0), timeline.tags.get(serial, "-"), nbytes)
                   for serial, nbytes in timeline.sizes.items()
                   if timeline.streams.get(serial) or timeline.tags.get(serial) == "engine_buffers")


def segments_by_stream(timeline):
    """The segments the allocator holds after the two steps (nothing is released: the most), by stream."""
    model = CachingAllocatorModel("")
    for event, _ in step_allocations(timeline):
        if event[0] == "alloc":
            model.malloc(*event[1:])
        elif event[0] == "free":
            model.free(event[1])
    assert model.reserved == model.reserved_peak
    return Counter((segment.stream, segment.pool, segment.total_size) for segment in model.segments())


@pytest.fixture(scope="module")
def fsdp2():
    return traced(world_size=2, sharding="fsdp-full-shard")


def test_fsdp2_gathers_on_its_copy_in_stream_and_reduces_onto_its_reduce_scatter_stream(fsdp2):
    assert fsdp2.stream_names == FSDP2_STREAMS
    assert FSDP2_STREAMS[COPY_IN] == "all_gather_copy_in_stream"
    assert on_streams(fsdp2) == {
        # `foreach_all_gather`: the all-gather output (the whole group: the world's shards) is allocated
        # under `device_handle.stream(all_gather_copy_in_stream)`, each group's twice (its forward's
        # unshard and its backward's, both through `get_all_gather_streams`).
        (COPY_IN, "engine_buffers", 4 * LAYER): 4, (COPY_IN, "engine_buffers", 4 * ROOT): 2,
        # `foreach_reduce`: the reduce-scatter input on the current (default) stream, once per group.
        (0, "engine_buffers", 4 * LAYER): 2, (0, "engine_buffers", 4 * ROOT): 1,
        # ... its output, the group's sharded gradients (half of it on 2), under the reduce-scatter stream.
        (REDUCE_SCATTER, "-", 4 * LAYER // 2): 2, (REDUCE_SCATTER, "-", 4 * ROOT // 2): 1}
    # The all-gather stream runs the collective into the copy-in stream's buffer: it allocates nothing
    # (a synchronous collective of ProcessGroupNCCL runs on the current stream and makes no tensor),
    # and the unsharded parameters are made in the copy-out, on the default stream.
    assert ALL_GATHER not in fsdp2.streams.values()
    # The timeline's own allocator events name the stream of each of those storages.
    assert {event[1]: event[3] for event in fsdp2.allocations() if len(event) == 4} == dict(fsdp2.streams)
    assert not any(fsdp2.streams.get(serial) for serial, part in fsdp2.tags.items() if part == "unsharded_parameters")


def test_under_hsdp_and_bf16_the_casts_follow_the_streams_too():
    timeline = traced(world_size=4, sharding="fsdp-full-shard", replicate=2, precision="autocast-bf16")
    bf16_layer, bf16_root = 2 * LAYER // 2, 2 * ROOT // 2  # a rank's bf16 shard (sharded 2-way)
    assert on_streams(timeline) == {
        # The shards' bf16 casts (`_get_param_all_gather_inputs`) and the bf16 all-gather output, on the copy-in stream.
        (COPY_IN, "-", bf16_layer): 4, (COPY_IN, "-", bf16_root): 2,
        (COPY_IN, "engine_buffers", 2 * bf16_layer): 4, (COPY_IN, "engine_buffers", 2 * bf16_root): 2,
        (0, "engine_buffers", 2 * bf16_layer): 2, (0, "engine_buffers", 2 * bf16_root): 1,
        # The bf16 reduce-scatter output on the reduce-scatter stream; HSDP's all-reduce runs on the
        # all-reduce stream, which is then the post-reduce stream where `_to_dtype_if_needed` makes
        # the fp32 sharded gradients.
        (REDUCE_SCATTER, "-", bf16_layer): 2, (REDUCE_SCATTER, "-", bf16_root): 1,
        (ALL_REDUCE, "-", 2 * bf16_layer): 2, (ALL_REDUCE, "-", 2 * bf16_root): 1}


def test_fsdp2_reserves_a_small_segment_for_each_of_its_streams(fsdp2):
    one_stream = dataclasses.replace(fsdp2, streams={})
    # On one stream: the cuBLAS and cuBLASLt workspaces of both handles (19,136,512 bytes) in one
    # 20 MiB segment, every other block (none above 1 MiB) in two small segments.
    assert segments_by_stream(one_stream) == {(0, "large", 20 * MiB): 1, (0, "small", SMALL_SEGMENT): 2}
    # With the streams: the default stream's segments are the same, and the all-gather outputs (of
    # 164,352 and 131,328 bytes: small blocks) cannot take the default stream's cached small blocks: `get_free_block` serves a request only
    # from blocks of its own stream, so the copy-in stream makes a 2 MiB segment of its own; and
    # the sharded gradients (82,176 + 82,176 + 65,664 bytes, alive to the step) another on the
    # reduce-scatter stream.
    assert segments_by_stream(fsdp2) == {(0, "large", 20 * MiB): 1, (0, "small", SMALL_SEGMENT): 2,
                                         (COPY_IN, "small", SMALL_SEGMENT): 1,
                                         (REDUCE_SCATTER, "small", SMALL_SEGMENT): 1}
    with_streams, without = replay_step(fsdp2, alloc_conf=""), replay_step(one_stream, alloc_conf="")
    assert (with_streams.reserved_peak_bytes, without.reserved_peak_bytes) == (29_360_128, 25_165_824)
    assert with_streams.reserved_peak_bytes - without.reserved_peak_bytes == 2 * SMALL_SEGMENT
    # The same blocks handed out: only where they lie differs.
    assert with_streams.allocated_peak_bytes == without.allocated_peak_bytes == 20_872_704


def test_ddp_allocates_on_the_default_stream_alone():
    timeline = traced(world_size=2, sharding="ddp")
    # reducer.cpp: the buckets are made at construction on the current stream (`at::empty`: the
    # comm-optimized pool is off unless DDP_DISABLE_COMM_MEM=0), each gradient is
    # copied into its bucket view on the autograd engine's (the default) stream, and the
    # all-reduce works in place on the bucket; ProcessGroupNCCL runs that asynchronous collective on
    # its own stream and stashes the bucket until `wait` (TORCH_NCCL_AVOID_RECORD_STREAMS is the
    # default: no `record_stream`), allocating nothing through the caching allocator. So DDP's plan
    # reserves what one stream does.
    assert timeline.streams == {} and timeline.stream_names == {}
    replay = replay_step(timeline, alloc_conf="")
    assert replay.reserved_peak_bytes == replay_step(dataclasses.replace(timeline, streams={})).reserved_peak_bytes \
        == 27_262_976


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_overlap_comm_makes_the_gradient_partition_on_its_reduction_stream(stage):
    def zero(overlap_comm):
        return traced(world_size=2, hidden_size=64, deepspeed={"zero_optimization": {
            "stage": stage, "overlap_comm": overlap_comm, "reduce_bucket_size": "auto"}})

    overlapped, plain = zero(True), zero(False)
    # deepspeed 0.19.8 stage_1_and_2.py `reduce_ipg_grads`: with overlap_comm the copies into this
    # rank's partition run under `get_accelerator().stream(self.reduction_stream)`, where
    # `copy_grads_in_partition` makes `grads_in_partition` (half of the 115,008 fp32 gradients with
    # the group's padding: 230,144 bytes); the two reduce buckets (4,096 values each) are made on the
    # default stream by `setup_buckets`, from the gradient hook.
    assert overlapped.stream_names == {REDUCTION_STREAM: "reduction_stream"}
    assert on_streams(overlapped) == {(REDUCTION_STREAM, "gradients", 230_144): 1, (0, "engine_buffers", 16_384): 2}
    # Without overlap_comm the reduction runs on the current stream: one stream, one bucket.
    assert plain.streams == {} and on_streams(plain) == {(0, "engine_buffers", 16_384): 1}
    # The partition is a small block that the default stream's cached ones cannot serve: a 2 MiB
    # segment of the reduction stream's own.
    one_stream = dataclasses.replace(overlapped, streams={})
    assert segments_by_stream(overlapped) - segments_by_stream(one_stream) == {
        (REDUCTION_STREAM, "small", SMALL_SEGMENT): 1}
    assert segments_by_stream(one_stream) - segments_by_stream(overlapped) == {}
    assert (replay_step(overlapped, alloc_conf="").reserved_peak_bytes,
            replay_step(one_stream, alloc_conf="").reserved_peak_bytes) == (27_262_976, 25_165_824)


# ZeRO-3's streams (ZERO3_STREAMS) and the settings tests/training/test_zero_runs_more.py holds to real
# runs (zero_step_profile.py's zero3-limits): every parameter partitioned, released after each use.
ALLGATHER, REDUCE_AND_PARTITION = 1, 2
ZERO3_LIMITS = dict(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                    stage3_prefetch_bucket_size=8192, stage3_max_live_parameters=20_000)


def zero3(**zero):
    return traced(world_size=2, hidden_size=64, deepspeed={"zero_optimization": dict(
        stage=3, reduce_bucket_size="auto", **ZERO3_LIMITS, **zero)})


def most_on_stream(timeline, stream):
    """The most bytes a stream's blocks (512-byte rounded) held at one moment of the timeline."""
    alive, most = {}, 0
    for event in timeline.events:
        serial = event if event >= 0 else ~event
        if timeline.streams.get(serial) == stream:
            if event >= 0:
                alive[serial] = -(-timeline.sizes[serial] // 512) * 512
            else:
                del alive[serial]
            most = max(most, sum(alive.values()))
    return most


@pytest.fixture(scope="module")
def zero3_overlapped():
    return zero3()  # overlap_comm left unset: DeepSpeedZeroConfig makes it true for stage 3


def test_zero3_gathers_each_parameter_whole_on_its_allgather_stream(zero3_overlapped):
    timeline = zero3_overlapped
    assert timeline.stream_names == ZERO3_STREAMS == {ALLGATHER: "allgather_stream",
                                                      REDUCE_AND_PARTITION: "reduce_and_partition_stream"}
    # deepspeed 0.19.8: parameter_offload.py makes `__allgather_stream` (a new stream with
    # overlap_comm) for the PartitionedParameterCoordinator, whose `__all_gather_params_` calls
    # `all_gather_coalesced` under `get_accelerator().stream(self.__allgather_stream)` and whose
    # `fetch_sub_module` waits on the handle under that stream too, where
    # `AllGatherCoalescedHandle.wait` makes `param.data` (`torch.cat` of the gathered partitions; a
    # view of `_all_gather_sequential`'s `param_buffer` for one parameter). So every whole parameter
    # is on the all-gather stream. The plan counts a parameter whole with its half partition beside
    # it (fp32: 4 + 2 bytes a value): q/k/v/o (4,096 values), gate/up/down (8,192), the norms (64),
    # the embedding and lm_head (16,384); each gathered for its forward and again for its backward
    # (`stage3_max_reuse_distance` 0): 2 x 2 layers x 4, 2 x 2 x 3, 2 x 5 and 2 x 2 storages.
    assert on_streams(timeline) == {
        (ALLGATHER, "unsharded_parameters", 6 * 4_096): 16, (ALLGATHER, "unsharded_parameters", 6 * 8_192): 12,
        (ALLGATHER, "unsharded_parameters", 6 * 64): 10, (ALLGATHER, "unsharded_parameters", 6 * 16_384): 4,
        # The reduce bucket (`ipg_buckets`, made at init): the default stream.
        (0, "engine_buffers", 16_384): 1}
    whole = {serial for serial, part in timeline.tags.items() if part == "unsharded_parameters"}
    assert set(timeline.streams) == whole
    # The reduce-and-partition stream (stage3.py) allocates nothing the plan holds: autograd makes
    # each gradient on the default stream, `__add_grad_to_ipg_bucket` copies it into the bucket and
    # `partition_grads` into the 16-bit gradient partition (`grad_partitions_flat_buffer`), both made
    # at init on the default stream; `reduce_scatter_coalesced`'s own temporaries are not modelled.
    assert REDUCE_AND_PARTITION not in timeline.streams.values()
    # The timeline's own allocator events name the stream of each of those storages.
    assert {event[1]: event[3] for event in timeline.allocations() if len(event) == 4} == dict(timeline.streams)


def test_zero3_streams_move_blocks_and_no_byte():
    overlapped, plain = zero3(overlap_comm=True), zero3(overlap_comm=False)
    # Without overlap_comm the all-gather stream is the default stream (`default_stream()`).
    assert plain.streams == {} and plain.stream_names == {}
    # The streams change where the blocks lie, not what is alive when: the CPU figures (the
    # timeline's events and sizes) are the same with and without them.
    assert (overlapped.events, overlapped.sizes) == (plain.events, plain.sizes)
    assert overlapped.streams


def test_zero3_reserves_a_small_segment_for_its_allgather_stream(zero3_overlapped):
    timeline = zero3_overlapped
    one_stream = dataclasses.replace(timeline, streams={})
    # The whole parameters are small blocks (at most 98,304 bytes), at most 197,632 bytes of them
    # at once (lm_head, the final norm and the last layer's four attention projections, prefetched);
    # on their own stream they cannot take the default stream's cached small blocks
    # (`get_free_block` serves a request from its own stream's blocks only): one 2 MiB small
    # segment of the all-gather stream's own. The default stream's segments are the same as with
    # one stream: the blocks the whole parameters left there are taken by others.
    assert most_on_stream(timeline, ALLGATHER) == 197_632 < SMALL_SEGMENT
    assert segments_by_stream(one_stream) == {(0, "large", 20 * MiB): 1, (0, "small", SMALL_SEGMENT): 2}
    assert segments_by_stream(timeline) - segments_by_stream(one_stream) == {(ALLGATHER, "small", SMALL_SEGMENT): 1}
    assert segments_by_stream(one_stream) - segments_by_stream(timeline) == {}
    with_streams, without = replay_step(timeline, alloc_conf=""), replay_step(one_stream, alloc_conf="")
    assert (with_streams.reserved_peak_bytes, without.reserved_peak_bytes) == (27_262_976, 25_165_824)
    assert with_streams.reserved_peak_bytes - without.reserved_peak_bytes == SMALL_SEGMENT
    # The same blocks handed out: only where they lie differs.
    assert with_streams.allocated_peak_bytes == without.allocated_peak_bytes == 20_844_032


def test_the_cuda_plan_reports_the_per_stream_figure_and_its_snapshot_reads_back_equal(tmp_path):
    settings = resolve_settings(world_size=2, sharding="fsdp-full-shard", batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cuda", model_states=False)
    assert plan.step.problem is None
    assert plan.device.reserved_peak_bytes == replay_step(plan.timeline).reserved_peak_bytes
    assert plan.device.reserved_peak_bytes - replay_step(
        dataclasses.replace(plan.timeline, streams={})).reserved_peak_bytes == 2 * SMALL_SEGMENT
    snapshot = plan_snapshot(plan)
    streams = Counter(segment["stream"] for segment in snapshot["segments"])
    assert streams == {0: 3, COPY_IN: 1, REDUCE_SCATTER: 1}
    path = tmp_path / "plan.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    [device] = replay_snapshot(path).devices
    assert device.real == device.replayed and device.first_divergence is None
    assert device.real.reserved_peak_bytes == plan.device.reserved_peak_bytes


def test_the_cuda_zero3_plan_reports_its_allgather_stream_and_its_snapshot_reads_back_equal(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": dict(stage=3, reduce_bucket_size=64 * 64,
                                                                              **ZERO3_LIMITS)}
    settings = resolve_settings(deepspeed=config, world_size=2, batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cuda", model_states=False)
    assert plan.settings.engine == "zero" and plan.step.problem is None
    one_stream = replay_step(dataclasses.replace(plan.timeline, streams={}))
    assert plan.device.reserved_peak_bytes - one_stream.reserved_peak_bytes == SMALL_SEGMENT
    snapshot = plan_snapshot(plan)
    assert Counter(segment["stream"] for segment in snapshot["segments"]) == {0: 3, ALLGATHER: 1}
    path = tmp_path / "plan.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    [device] = replay_snapshot(path).devices
    assert device.real == device.replayed and device.first_divergence is None
    assert device.real.reserved_peak_bytes == plan.device.reserved_peak_bytes
