"""The caching allocator model against PyTorch's own expectations, to the byte.

PyTorch's tests of its allocator (`test/test_cuda.py`: `test_allocator_settings`,
`test_set_per_process_memory_fraction`, `test_raises_oom`; the divisions-0 and divisions-1
cases as torch_mlu's port of those tests carries them), its own writing (the header comment
and Note [Expandable Segments] of `c10/cuda/CUDACachingAllocator.cpp`, the `roundup_power2_divisions`
example of `docs/source/notes/cuda.rst`), and each rule of `CUDACachingAllocator.cpp` on a
timeline small enough to follow by hand.
"""

from __future__ import annotations

import pytest

import trainer_memcb
from trainer_memcb.plan.device.caching_allocator import (
    AllocatorReplay,
    allocation_size,
    replay_allocations,
    round_size,
    roundup_power2_next_division,
)
from trainer_memcb.plan.device.alloc_conf import AllocConf, parse_alloc_conf

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3


def layout(replay: AllocatorReplay) -> list:
    """Each segment as (MiB, expandable, [(block MiB, allocated), ...])."""
    return [(segment.total_size / MiB, segment.expandable,
             [(block.size / MiB, block.allocated) for block in segment.blocks])
            for segment in replay.segments]


def one_allocation(nbytes: int, conf: str = "") -> int:
    return replay_allocations([("alloc", "x", nbytes)], alloc_conf=conf).allocated_peak_bytes


def power2_div(size: int, div_factor: int) -> float:
    """test_cuda.py's own helper for the expected rounding."""
    pow2 = 1
    while pow2 < size:
        pow2 = pow2 * 2
    if pow2 == size:
        return pow2
    step = pow2 / 2 / div_factor
    ret = pow2 / 2
    while ret < size:
        ret = ret + step
    return ret


# -- PyTorch's tests ------------------------------------------------------------------------

def test_test_allocator_settings() -> None:
    nbytes = 4 * 21 * 1024 * 1024  # torch.rand(21 * 1024 * 1024) floats: 84 MiB
    nbytes_big = 4 * 100 * 1024 * 1024  # 400 MiB
    assert one_allocation(nbytes) == nbytes == 88_080_384
    assert one_allocation(nbytes, "roundup_power2_divisions:4") == power2_div(nbytes, 4)
    assert one_allocation(nbytes, "roundup_power2_divisions:4") == 96 * MiB
    # "should have reset the power2 divisions now"
    assert one_allocation(nbytes, "garbage_collection_threshold:0.5,max_split_size_mb:70") == nbytes
    array = "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"
    assert one_allocation(nbytes, array) == power2_div(nbytes, 8) == 88 * MiB
    assert one_allocation(nbytes_big, array) == power2_div(nbytes_big, 2) == 512 * MiB


def test_roundup_power2_divisions_0_and_1() -> None:
    conf = "roundup_power2_divisions:[128:1,256:0,512:4]"
    assert one_allocation(4 * 67 * MiB, conf) == 268 * MiB  # divisions 0: no power-2 rounding
    assert one_allocation(4 * 130 * MiB, conf) == power2_div(520 * MiB, 4) == 640 * MiB
    nbytes = 4 * 21 * 125 * 125  # 1,312,500 bytes
    assert one_allocation(nbytes) == one_allocation(nbytes, "roundup_power2_divisions:1") == 1_312_768


def test_set_per_process_memory_fraction() -> None:
    # A device whose memory is not a multiple of 4 MiB (as cards' totals are not): half of it,
    # rounded up to the 2 MiB a large segment is rounded to, is over half.
    total = 80 * GiB - MiB
    conf = "per_process_memory_fraction:0.5"
    ok = replay_allocations([("alloc", "tmp", int(total * 0.499)), ("free", "tmp"),
                             ("empty_cache",), ("alloc", "big", int(total * 0.5))],
                            alloc_conf=conf, device_memory=total)
    # 0.499 of the device fits; half of it does not: its 2 MiB-rounded segment passes the limit.
    assert ok.oom == ("alloc", "big", int(total * 0.5)) and ok.oom_index == 3
    assert ok.reserved_peak_bytes == allocation_size(int(total * 0.499), AllocConf())
    assert ok.reserved_bytes == 0


@pytest.mark.parametrize("conf", ["max_split_size_mb:1024", ""])
def test_raises_oom(conf: str) -> None:
    event = ("alloc", "x", 4 * 1024 ** 4)  # torch.empty(1024 * 1024 * 1024 * 1024)
    replay = replay_allocations([event], alloc_conf=conf, device_memory=80 * GiB)
    assert (replay.oom, replay.oom_index, replay.num_alloc_retries) == (event, 0, 1)
    assert replay.reserved_peak_bytes == 0


def test_more_than_an_exabyte_is_an_oom_on_any_device() -> None:
    event = ("alloc", "x", 2 ** 60)  # NativeCachingAllocator::allocate's own check
    assert replay_allocations([event]).oom == event


# -- PyTorch's writing --------------------------------------------------------------------

def test_cuda_rst_rounding_example_and_what_round_size_does_with_it() -> None:
    # cuda.rst: "the size 1200 lies between 1024 and 2048 ... rounded to 1280".
    assert roundup_power2_next_division(1200, 4) == 1280
    # round_size applies divisions only above 512 * divisions bytes: 1200 gets 512-rounding.
    assert round_size(1200, parse_alloc_conf("roundup_power2_divisions:4")) == 1536
    assert round_size(3000, parse_alloc_conf("roundup_power2_divisions:4")) == 3072
    assert round_size(2 ** 20 + 1, parse_alloc_conf("roundup_power2_divisions:4")) == 1310720


def test_requests_between_1_and_10_mib_split_a_20_mib_segment() -> None:
    # The header comment: "requests between 1MB and 10MB will allocate and split a 20MB block".
    replay = replay_allocations([("alloc", "a", 3 * MiB), ("alloc", "b", 3 * MiB)])
    assert layout(replay) == [(20.0, False, [(3.0, True), (3.0, True), (14.0, False)])]
    assert replay.num_device_alloc == 1


def test_expandable_segments_tile_a_growing_batch() -> None:
    # Note [Expandable Segments]: sizes N, then N + 1 (and N again). Without expandable
    # segments the larger tensors cannot use the cached smaller blocks.
    def step(tag: int, mib: int) -> list:
        return ([("alloc", (tag, i), mib * MiB) for i in range(3)]
                + [("free", (tag, i)) for i in range(3)])

    events = step(1, 30) + step(2, 32) + step(3, 31)
    plain = replay_allocations(events)
    assert plain.reserved_peak_bytes == (3 * 30 + 3 * 32) * MiB
    assert [segment.total_size // MiB for segment in plain.segments] == [30, 30, 30, 32, 32, 32]
    grown = replay_allocations(events, alloc_conf="expandable_segments:True")
    assert grown.reserved_peak_bytes == 100 * MiB  # five 20 MiB pages hold 3 x 32 MiB
    assert layout(grown) == [(100.0, True, [(100.0, False)])]


# -- the rules, one at a time -----------------------------------------------------------------

def test_rounding_and_the_pools() -> None:
    conf = AllocConf()
    assert [round_size(n, conf) for n in (1, 512, 513, 1000, 2 ** 20)] == [512, 512, 1024, 1024,
                                                                          2 ** 20]
    assert allocation_size(2 ** 20, conf) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(2 ** 20 + 512, conf) == 20 * MiB  # large pool below 10 MiB: 20 MiB
    assert allocation_size(10 * MiB - 512, conf) == 20 * MiB
    assert allocation_size(10 * MiB, conf) == 10 * MiB  # from 10 MiB: rounded up to 2 MiB
    assert allocation_size(10 * MiB + 512, conf) == 12 * MiB
    assert allocation_size(3 * MiB, parse_alloc_conf("large_segment_size_mb:32")) == 32 * MiB


def test_small_pool_splits_any_remainder_of_512_bytes() -> None:
    replay = replay_allocations([("alloc", "a", 1000), ("alloc", "b", 2000)])
    assert [(b.size, b.allocated) for b in replay.segments[0].blocks] == [
        (1024, True), (2048, True), (2 * MiB - 3072, False)]
    assert (replay.allocated_peak_bytes, replay.requested_peak_bytes) == (3072, 3000)


def test_large_pool_keeps_a_remainder_of_1_mib_or_less_in_the_block() -> None:
    request = 20 * MiB - MiB // 2  # 19.5 MiB: its 20 MiB segment leaves 0.5 MiB, not split
    replay = replay_allocations([("alloc", "a", request)])
    assert layout(replay) == [(20.0, False, [(20.0, True)])]
    assert replay.allocated_peak_bytes == 20 * MiB
    split = replay_allocations([("alloc", "a", 18 * MiB + 512)])  # leaves 1.5 MiB: split
    assert layout(split)[0][2] == [((18 * MiB + 512) / MiB, True), ((2 * MiB - 512) / MiB, False)]


def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    events = [("alloc", "a", 12 * MiB), ("alloc", "b", 16 * MiB), ("alloc", "c", 14 * MiB),
              ("free", "a"), ("free", "b"), ("free", "c"), ("alloc", "d", 13 * MiB)]
    replay = replay_allocations(events)
    assert [(s.total_size // MiB, s.allocated_size // MiB) for s in replay.segments] == [
        (12, 0), (16, 0), (14, 14)]  # 14 MiB block for 13 MiB: the remainder is 1 MiB, kept


def test_free_merges_with_free_neighbours() -> None:
    events = [("alloc", k, 4 * MiB) for k in "abcd"] + [("free", "a"), ("free", "c"),
                                                         ("free", "b")]
    replay = replay_allocations(events)
    assert layout(replay) == [(20.0, False, [(12.0, False), (4.0, True), (4.0, False)])]


def test_fragmentation_by_free_order() -> None:
    four = [("alloc", i, 5 * MiB) for i in range(4)]
    holes = replay_allocations(four + [("free", 0), ("free", 2), ("alloc", "x", 8 * MiB)])
    assert holes.reserved_bytes == 40 * MiB
    merged = replay_allocations(four + [("free", 0), ("free", 1), ("alloc", "x", 8 * MiB)])
    assert merged.reserved_bytes == 20 * MiB
    assert holes.allocated_bytes == merged.allocated_bytes == 18 * MiB
    # Expandable segments do not move blocks: the holes stay, the segment grows by a page.
    grown = replay_allocations(four + [("free", 0), ("free", 2), ("alloc", "x", 8 * MiB)],
                               alloc_conf="expandable_segments:True")
    assert layout(grown) == [(40.0, True, [(5.0, False), (5.0, True), (5.0, False), (5.0, True),
                                           (8.0, True), (12.0, False)])]


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    conf = "max_split_size_mb:40"
    events = [("alloc", "a", 60 * MiB), ("free", "a"), ("alloc", "b", 30 * MiB)]
    # A request below max_split_size never takes an oversize block ...
    assert layout(replay_allocations(events, alloc_conf=conf)) == [
        (60.0, False, [(60.0, False)]), (30.0, False, [(30.0, True)])]
    # ... and without max_split_size the 60 MiB block is split for it.
    assert layout(replay_allocations(events)) == [(60.0, False, [(30.0, True), (30.0, False)])]
    # A request of max_split_size or more takes a block at most max_non_split_rounding larger,
    # unsplit.
    events = [("alloc", "a", 70 * MiB), ("free", "a"), ("alloc", "b", 45 * MiB)]
    assert len(replay_allocations(events, alloc_conf=conf).segments) == 2  # 70 >= 45 + 20
    within = replay_allocations(events, alloc_conf=conf + ",max_non_split_rounding_mb:30")
    assert layout(within) == [(70.0, False, [(70.0, True)])]
    assert within.allocated_bytes == 70 * MiB


def test_oom_path_frees_oversize_blocks_before_the_whole_cache() -> None:
    events = [("alloc", "a", 60 * MiB), ("alloc", "b", 50 * MiB), ("free", "a"), ("free", "b"),
              ("alloc", "c", 100 * MiB)]
    # release_available_cached_blocks: the largest oversize blocks until 100 MiB are free.
    replay = replay_allocations(events, alloc_conf="max_split_size_mb:40",
                                device_memory=150 * MiB)
    assert (replay.oom, replay.num_alloc_retries, replay.num_device_free) == (None, 0, 2)
    assert replay.reserved_bytes == 100 * MiB and replay.reserved_peak_bytes == 110 * MiB
    # Without max_split_size: release_cached_blocks, counted as a retry.
    replay = replay_allocations(events, device_memory=150 * MiB)
    assert (replay.oom, replay.num_alloc_retries, replay.reserved_bytes) == (None, 1, 100 * MiB)


def test_oom_with_and_without_cached_blocks_to_free() -> None:
    cached = replay_allocations([("alloc", "a", 60 * MiB), ("free", "a"),
                                 ("alloc", "b", 70 * MiB)], device_memory=100 * MiB)
    assert cached.oom is None and cached.num_alloc_retries == 1
    assert (cached.reserved_bytes, cached.reserved_peak_bytes) == (70 * MiB, 70 * MiB)
    live = replay_allocations([("alloc", "a", 60 * MiB), ("alloc", "b", 70 * MiB),
                               ("free", "a")], device_memory=100 * MiB)
    assert (live.oom, live.oom_index, live.events) == (("alloc", "b", 70 * MiB), 1, 2)
    assert (live.reserved_bytes, live.allocated_bytes) == (60 * MiB, 60 * MiB)
    # Cache freed on the way to the OOM stays freed; split segments cannot be freed.
    split = replay_allocations([("alloc", "a", 3 * MiB), ("alloc", "s", 60 * MiB), ("free", "s"),
                                ("alloc", "b", 90 * MiB)], device_memory=100 * MiB)
    assert split.oom == ("alloc", "b", 90 * MiB) and split.reserved_bytes == 20 * MiB


def test_garbage_collection_frees_the_oldest_cached_blocks_first() -> None:
    events = [("alloc", "a", 60 * MiB), ("free", "a"), ("alloc", "b", 70 * MiB), ("free", "b"),
              ("alloc", "c", 80 * MiB)]
    conf = "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5"
    # 130 MiB reserved is over half of the allowed 200 MiB: a (age 2) is freed, b (age 1) kept.
    collected = replay_allocations(events, alloc_conf=conf, device_memory=400 * MiB)
    assert [s.total_size // MiB for s in collected.segments] == [70, 80]
    assert (collected.num_alloc_retries, collected.reserved_peak_bytes) == (0, 150 * MiB)
    # Without the threshold the limit is hit and the whole cache goes.
    limited = replay_allocations(events, alloc_conf="per_process_memory_fraction:0.5",
                                 device_memory=400 * MiB)
    assert (limited.num_alloc_retries, limited.reserved_bytes) == (1, 80 * MiB)
    # Without a memory fraction there is no allowed maximum and no collection, as in torch.
    unlimited = replay_allocations(events, alloc_conf="garbage_collection_threshold:0.5",
                                   device_memory=400 * MiB)
    assert unlimited.reserved_bytes == 210 * MiB


def test_expandable_segment_pages() -> None:
    conf = "expandable_segments:True"
    small = replay_allocations([("alloc", "a", 1000)], alloc_conf=conf)
    segment = small.segments[0]
    assert (segment.total_size, segment.expandable, segment.pool) == (2 * MiB, True, "small")
    assert [(b.size, b.allocated) for b in segment.blocks] == [(1024, True), (2 * MiB - 1024, False)]
    large = replay_allocations([("alloc", "a", 25 * MiB)], alloc_conf=conf)
    assert layout(large) == [(40.0, True, [(25.0, True), (15.0, False)])]
    pages = replay_allocations([("alloc", "a", 25 * MiB)], alloc_conf=conf + ",large_segment_size_mb:32")
    assert pages.reserved_bytes == 32 * MiB
    # One segment grows: a second tensor maps the next pages of the same address range.
    grown = replay_allocations([("alloc", "a", 25 * MiB), ("alloc", "b", 30 * MiB)], alloc_conf=conf)
    assert layout(grown) == [(60.0, True, [(25.0, True), (30.0, True), (5.0, False)])]


def test_empty_cache_unmaps_whole_free_pages_of_expandable_segments() -> None:
    conf = "expandable_segments:True"
    events = [("alloc", "a", 25 * MiB), ("alloc", "b", 30 * MiB), ("free", "b"), ("empty_cache",)]
    replay = replay_allocations(events, alloc_conf=conf)
    # b's free 35 MiB (25-60 MiB) holds one whole 20 MiB page, 40-60 MiB: it is unmapped, and
    # the 15 MiB before it stays mapped and cached.
    assert layout(replay) == [(40.0, True, [(25.0, True), (15.0, False)])]
    assert (replay.reserved_bytes, replay.num_device_free) == (40 * MiB, 1)
    gone = replay_allocations(events + [("free", "a"), ("empty_cache",)], alloc_conf=conf)
    assert (gone.reserved_bytes, gone.segments) == (0, ())


def test_empty_cache_frees_only_whole_segments() -> None:
    events = [("alloc", "a", 3 * MiB), ("alloc", "b", 30 * MiB), ("free", "b"), ("empty_cache",)]
    replay = replay_allocations(events)
    assert layout(replay) == [(20.0, False, [(3.0, True), (17.0, False)])]
    assert replay.reserved_peak_bytes == 50 * MiB


def test_zero_byte_tensors_take_no_block() -> None:
    replay = replay_allocations([("alloc", "e", 0), ("free", "e")])
    assert (replay.reserved_peak_bytes, replay.segments, replay.events) == (0, (), 2)


def test_keys_and_the_end_state() -> None:
    replay = replay_allocations([["alloc", ("w", 0), 5000], ("alloc", 7, 100)])
    assert [(b.key, b.requested_bytes) for b in replay.segments[0].blocks if b.allocated] == [
        (("w", 0), 5000), (7, 100)]
    assert replay.largest_free_block_bytes == 2 * MiB - 5120 - 512


@pytest.mark.parametrize("event, named", [
    (("free", "nope"), "key 'nope' is not allocated"),
    (("alloc", "x", -1), "nbytes must be a whole number of bytes >= 0"),
    (("alloc", "x", 1.5), "nbytes must be a whole number of bytes >= 0"),
    (("alloc", "x", True), "nbytes must be a whole number of bytes >= 0"),
    (("alloc", "a", 10), "key 'a' is allocated already and not freed"),
    (("malloc", "x", 10), "an event is ('alloc', key, nbytes), ('free', key) or ('empty_cache',)"),
    (("free",), "an event is"),
    ("alloc", "an event is"),
    (("alloc", ["unhashable"], 10), "the key must be hashable"),
])
def test_bad_events_raise_value_errors_that_name_them(event, named: str) -> None:
    with pytest.raises(ValueError) as raised:
        replay_allocations([("alloc", "a", 10), event])
    assert named in str(raised.value)
    assert f"event 1 {event!r}" in str(raised.value)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="device_memory must be a whole number of bytes >= 0"):
        replay_allocations([], device_memory=-1)
    with pytest.raises(ValueError, match="give device_memory too"):
        replay_allocations([], alloc_conf="per_process_memory_fraction:0.5")
    with pytest.raises(ValueError, match="backend:cudaMallocAsync is CUDA's own"):
        replay_allocations([], alloc_conf="backend:cudaMallocAsync")
    with pytest.raises(ValueError, match="unrecognized key 'expandable'"):
        replay_allocations([], alloc_conf="expandable:True")


def test_public_names() -> None:
    assert trainer_memcb.replay_allocations is replay_allocations
    assert trainer_memcb.AllocatorReplay is AllocatorReplay
    assert {"replay_allocations", "AllocatorReplay"} <= set(trainer_memcb.__all__)


@pytest.mark.parametrize("conf", [
    "", "expandable_segments:True", "max_split_size_mb:24,roundup_power2_divisions:4",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.8,max_split_size_mb:30",
    "expandable_segments:True,per_process_memory_fraction:0.9,garbage_collection_threshold:0.5",
])
def test_random_timelines_keep_the_books_straight(conf: str) -> None:
    """On seeded random timelines (out-of-memory paths and empty_cache included): the segments
    tile their address ranges without overlap, the reserved bytes are the segments' sizes,
    the allocated bytes the allocated blocks', and every live key has its block."""
    import random

    for seed in range(12):
        rng = random.Random(seed)
        events, live, key = [], [], 0
        for _ in range(400):
            roll = rng.random()
            if roll < 0.02:
                events.append(("empty_cache",))
            elif live and roll < 0.45:
                events.append(("free", live.pop(rng.randrange(len(live)))))
            else:
                events.append(("alloc", key, int(2 ** rng.uniform(0, 26))))
                live.append(key)
                key += 1
        replay = replay_allocations(events, alloc_conf=conf, device_memory=160 * MiB)
        freed = {event[1] for event in events[:replay.events] if event[0] == "free"}
        allocated_keys = {event[1] for event in events[:replay.events] if event[0] == "alloc"}
        if replay.oom is not None:
            allocated_keys.discard(replay.oom[1])
        blocks = [block for segment in replay.segments for block in segment.blocks]
        for segment in replay.segments:
            end = segment.address
            for block in segment.blocks:
                assert block.address == end and block.size > 0
                end += block.size
            assert segment.total_size == end - segment.address
        starts = sorted((s.address, s.address + s.total_size) for s in replay.segments)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(starts, starts[1:]))
        assert replay.reserved_bytes == sum(s.total_size for s in replay.segments) <= 160 * MiB
        assert replay.allocated_bytes == sum(b.size for b in blocks if b.allocated)
        nonzero = {event[1] for event in events[:replay.events] if event[0] == "alloc" and event[2]}
        assert {b.key for b in blocks if b.allocated} == (allocated_keys - freed) & nonzero
        assert replay.reserved_peak_bytes >= replay.reserved_bytes
        assert replay.allocated_peak_bytes <= replay.reserved_peak_bytes


# -- streams (CUDACachingAllocator.cpp: BlockComparatorSize orders by stream first;
#    get_free_block, recordStream, free -> insert_events, process_events,
#    release_cached_blocks -> synchronize_and_free_events) --------------------------------------

BASE = 1 << 21  # the model's first segment address


def test_a_block_freed_on_one_stream_is_not_reused_by_another() -> None:
    small = replay_allocations([("alloc", "a", 1000, 1), ("free", "a"), ("alloc", "b", 1000, 0)],
                               record_trace=True)
    assert small.trace == (
        ("segment_alloc", BASE, 2 * MiB, 1), ("alloc", BASE, 1000, 1),
        ("free_requested", BASE, 1000, 1), ("free_completed", BASE, 1000, 1),
        ("segment_alloc", BASE + 2 * MiB, 2 * MiB, 0), ("alloc", BASE + 2 * MiB, 1000, 0))
    assert small.reserved_peak_bytes == 4 * MiB
    assert [(s.stream, s.total_size) for s in small.segments] == [(1, 2 * MiB), (0, 2 * MiB)]
    large = [("alloc", "a", 30 * MiB, 1), ("free", "a"), ("alloc", "b", 30 * MiB, 0)]
    assert replay_allocations(large).reserved_peak_bytes == 60 * MiB
    # The same timeline on one stream reuses the block.
    one = [event[:3] for event in large[:1]] + [large[1], large[2][:3]]
    assert replay_allocations(one).reserved_peak_bytes == 30 * MiB
    # A stream's cached block serves that stream again.
    assert replay_allocations(large + [("alloc", "c", 30 * MiB, 1)]).reserved_peak_bytes == 60 * MiB


def test_a_recorded_stream_delays_the_free_until_its_work_has_ended() -> None:
    mib30 = 30 * MiB
    events = [("alloc", "a", mib30, 0), ("record_stream", "a", 1), ("free", "a"),
              ("alloc", "b", mib30, 0)]
    replay = replay_allocations(events, record_trace=True)
    # free_requested at the free, no free_completed: b gets a segment of its own.
    assert replay.trace == (
        ("segment_alloc", BASE, mib30, 0), ("alloc", BASE, mib30, 0),
        ("free_requested", BASE, mib30, 0),
        ("segment_alloc", BASE + mib30, mib30, 0), ("alloc", BASE + mib30, mib30, 0))
    assert (replay.reserved_peak_bytes, replay.allocated_bytes) == (2 * mib30, mib30)
    assert [(b.allocated, b.pending_free) for s in replay.segments for b in s.blocks] == [
        (False, True), (True, False)]
    # Stream 1's work ends; the next malloc polls the event (process_events) and reuses a.
    replay = replay_allocations(events + [("synchronize", 1), ("alloc", "c", mib30, 0)],
                                record_trace=True)
    assert replay.trace[5:] == (("free_completed", BASE, mib30, 0), ("alloc", BASE, mib30, 0))
    assert replay.reserved_peak_bytes == 2 * mib30
    # Without the synchronize the event is outstanding: c needs a third segment.
    assert replay_allocations(events + [("alloc", "c", mib30, 0)]).reserved_peak_bytes == 3 * mib30
    # A use recorded on the allocation stream itself is ignored (recordStream).
    same = [("alloc", "a", mib30, 0), ("record_stream", "a", 0), ("free", "a"),
            ("alloc", "b", mib30, 0)]
    assert replay_allocations(same).reserved_peak_bytes == mib30
    # A block waiting on its events is not merged with its free neighbours.
    split = replay_allocations([("alloc", "x", 2 * MiB, 0), ("alloc", "y", 2 * MiB, 0),
                                ("record_stream", "x", 2), ("free", "x"), ("free", "y")])
    assert layout(split) == [(20.0, False, [(2.0, False), (18.0, False)])]
    assert [b.pending_free for b in split.segments[0].blocks] == [True, False]


def test_empty_cache_releases_every_streams_segments_and_waits_for_the_events() -> None:
    events = [("alloc", "a", 30 * MiB, 0), ("alloc", "b", 40 * MiB, 1), ("alloc", "c", 1000, 2),
              ("record_stream", "a", 3), ("free", "a"), ("free", "b"), ("free", "c"),
              ("empty_cache",)]
    replay = replay_allocations(events, record_trace=True)
    top = BASE + 70 * MiB
    assert replay.trace[-4:] == (
        ("free_completed", BASE, 30 * MiB, 0),
        ("segment_free", BASE, 30 * MiB, 0), ("segment_free", BASE + 30 * MiB, 40 * MiB, 1),
        ("segment_free", top, 2 * MiB, 2))
    assert (replay.reserved_peak_bytes, replay.reserved_bytes, replay.segments) == (
        72 * MiB, 0, ())


def test_a_failed_cudamalloc_releases_other_streams_cache_and_retries() -> None:
    events = [("alloc", "a", 30 * MiB, 1), ("free", "a"), ("alloc", "b", 40 * MiB, 0)]
    replay = replay_allocations(events, device_memory=60 * MiB, record_trace=True)
    assert replay.oom is None and replay.num_alloc_retries == 1
    assert replay.trace[-3:] == (("segment_free", BASE, 30 * MiB, 1),
                                 ("segment_alloc", BASE + 30 * MiB, 40 * MiB, 0),
                                 ("alloc", BASE + 30 * MiB, 40 * MiB, 0))
    assert (replay.reserved_peak_bytes, replay.reserved_bytes) == (40 * MiB, 40 * MiB)
    # release_available_cached_blocks frees only the requesting stream's oversize blocks
    # (largest first, until enough): on stream 0 two of 30 MiB make room for 40 MiB without the
    # whole release; on stream 1 they are not stream 0's, so the whole cache goes (a retry).
    conf = "max_split_size_mb:25"
    for stream, retries in ((0, 0), (1, 1)):
        cached = [("alloc", "a", 30 * MiB, stream), ("alloc", "c", 30 * MiB, stream),
                  ("free", "a"), ("free", "c"), ("alloc", "b", 40 * MiB, 0)]
        replay = replay_allocations(cached, alloc_conf=conf, device_memory=70 * MiB)
        assert (replay.num_alloc_retries, replay.num_device_free, replay.reserved_bytes) == (
            retries, 2, 40 * MiB)


def test_each_stream_grows_its_own_expandable_segment() -> None:
    conf = "expandable_segments:True"
    same = replay_allocations([("alloc", "a", 30 * MiB, 0), ("alloc", "b", 30 * MiB, 0)],
                              alloc_conf=conf)
    two = replay_allocations([("alloc", "a", 30 * MiB, 0), ("alloc", "b", 30 * MiB, 1)],
                             alloc_conf=conf)
    assert same.reserved_peak_bytes == 60 * MiB  # 20 MiB pages, one segment
    assert two.reserved_peak_bytes == 80 * MiB  # 40 MiB mapped on each stream's segment
    assert [(s.stream, s.total_size) for s in two.segments] == [(0, 40 * MiB), (1, 40 * MiB)]


@pytest.mark.parametrize("event, named", [
    (("alloc", "x", 10, -1), "a stream is a whole number >= 0"),
    (("record_stream", "a", "s"), "a stream is a whole number >= 0"),
    (("synchronize", True), "a stream is a whole number >= 0"),
    (("record_stream", "nope", 1), "key 'nope' is not allocated"),
    (("synchronize",), "('synchronize', stream)"),
])
def test_bad_stream_events(event, named: str) -> None:
    with pytest.raises(ValueError) as raised:
        replay_allocations([("alloc", "a", 10), event])
    assert named in str(raised.value) and f"event 1 {event!r}" in str(raised.value)
