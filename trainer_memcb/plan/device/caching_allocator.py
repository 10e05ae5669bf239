"""A model of PyTorch's CUDA caching allocator: what a timeline of allocations reserves.

Followed from torch 2.13's `c10/cuda/CUDACachingAllocator.cpp`, class `DeviceCachingAllocator`
(`malloc`, `free`, `round_size`, `roundup_power2_next_division`, `get_pool`,
`get_allocation_size`, `get_free_block`, `should_split`, `alloc_found_block`, `free_block`,
`try_merge_blocks`, `alloc_block`, `garbage_collect_cached_blocks`,
`release_available_cached_blocks`, `release_cached_blocks`, `release_blocks`, `release_block`,
for streams `recordStream`, `insert_events`, `process_events`, `synchronize_and_free_events`
and `BlockComparatorSize`/`BlockComparatorAddress` (stream first), and for expandable
segments `find_expandable_block`, `try_allocate_expandable_block`, `map_block`, `unmap_block`, `release_expandable_segment`, `ExpandableSegment::map/unmap`), with
the constants of `c10/core/AllocatorConfig.h`. Each rule below names the function it follows.

What is modelled: one device; its streams (0 is the default stream, and a timeline that names
no stream runs on it alone); no CUDA graphs, private pools or free-memory callbacks.

Streams, as `DeviceCachingAllocator` keeps them: the pools are ordered by stream, then size, then
address, so a cached block serves only a request on the stream it was allocated on
(`get_free_block` stops at another stream's block), and each stream grows its own expandable
segments (`find_expandable_block`). `record_stream` adds a use on another stream; freeing such a
block only records an event on each of those streams (`free` -> `insert_events`: the trace's
`free_requested`); the block stays out of the pool, and unmerged, until the streams' work has
ended (`synchronize`) and the next `malloc` polls the events (`process_events`), or until
`empty_cache` or the release-and-retry of a failed `cudaMalloc` waits for all of them
(`release_cached_blocks` -> `synchronize_and_free_events`): then `free_block` (`free_completed`).
`empty_cache` and that retry free the cached segments of every stream;
`release_available_cached_blocks` only the requesting stream's; garbage collection every stream's.
`device_memory` is what the allocator may take from the device: a `cudaMalloc` (or the mapping
of expandable pages) fails when the reserved bytes would exceed it.

Addresses: real `cudaMalloc` addresses decide which of two free blocks of one size is taken
(the pools are ordered by size, then address). Here each new segment is placed above every
earlier one, so ties go to the older segment.

Where releases differ in bytes (torch 2.6 to 2.13):
- the 1-10 MiB segment and the large pool's expandable page are `large_segment_size_mb`
  (20 MiB unless set) since that key appeared; before, the constant `kLargeBuffer` (20 MiB);
- `max_non_split_rounding_mb` (how far above a request an unsplittable cached block may be)
  defaults to the large segment's size; older releases used `kLargeBuffer`: the same 20 MiB;
- torch 2.6 split blocks in the large pool with `remaining > kSmallSize` unless expandable
  segments were on, as here; garbage collection needed `set_per_process_memory_fraction`,
  `per_process_memory_fraction` in the config is the 2.13 way to set it;
- `release_available_cached_blocks` skips blocks of expandable segments in 2.13 (older
  releases could stop at one).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from trainer_memcb.plan.device.alloc_conf import AllocConf, SIZE_MAX, as_alloc_conf

__all__ = [
    "AllocatorReplay",
    "BlockState",
    "CachingAllocatorModel",
    "SegmentState",
    "replay_allocations",
]

# c10/core/AllocatorConfig.h
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # kSmallSize: the largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: "small" allocations are packed in 2 MiB segments
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: 1 to 10 MiB requests may use the large segment
K_ROUND_LARGE = 2097152  # kRoundLarge: larger segments are rounded up to 2 MiB
# CUDACachingAllocator.cpp, NativeCachingAllocator::allocate: "Tried to allocate more than 1EB".
ONE_EXABYTE = 1152921504606846976
# No device limit given: the expandable segment's address space is sized for this much memory.
_UNBOUNDED_DEVICE = 2 ** 50


class _Block:
    """`Block`: a piece of a segment, allocated or cached."""

    __slots__ = ("size", "addr", "pool", "allocated", "prev", "next", "segment", "mapped",
                 "requested", "gc_base", "key", "stream", "stream_uses", "event_count")

    def __init__(self, size: int, addr: int, pool: "_Pool", segment: Optional["_Expandable"],
                 mapped: bool = True, stream: int = 0) -> None:
        self.stream = stream  # the allocation stream
        self.stream_uses: Optional[set] = None  # other streams recorded (recordStream)
        self.event_count = 0  # outstanding events of a free waiting on those streams
        self.size = size
        self.addr = addr
        self.pool = pool
        self.allocated = False
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None
        self.segment = segment  # the expandable segment it lies in, or None (a cudaMalloc)
        self.mapped = mapped
        self.requested = 0
        self.gc_base = 0
        self.key: Any = None  # the event's key while allocated

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Expandable:
    """`ExpandableSegment`: reserved address space, mapped in pages of `page` bytes."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, device_total: int) -> None:
        self.base = base
        self.page = page
        # ExpandableSegment::init: max_handles_ = numSegments(getReservedVirtualMemorySize),
        # the device's total memory and an eighth more (CUDAExpandableSegment).
        reserved = device_total + device_total // 8
        self.size = -(-reserved // page) * page


class _Pool:
    """`BlockPool`: the cached blocks of one pool, ordered as `BlockComparatorSize` orders them
    (stream, size, then address), and the unmapped tails of its expandable segments, ordered
    as `BlockComparatorAddress` orders them (stream, then address)."""

    __slots__ = ("is_small", "keys", "blocks", "unmapped", "unmapped_blocks", "gc_calls")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.keys: List[Tuple[int, int, int]] = []  # sorted (stream, size, addr), cached blocks
        self.blocks: Dict[int, _Block] = {}  # addr -> cached block
        self.unmapped: List[Tuple[int, int]] = []  # sorted (stream, addr) of unmapped blocks
        self.unmapped_blocks: Dict[int, _Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, block: _Block) -> None:  # BlockPool::insert_into_blocks
        block.gc_base = self.gc_calls
        insort(self.keys, (block.stream, block.size, block.addr))
        self.blocks[block.addr] = block

    def erase(self, block: _Block) -> None:
        key = (block.stream, block.size, block.addr)
        index = bisect_left(self.keys, key)
        del self.keys[index]
        del self.blocks[block.addr]

    def insert_unmapped(self, block: _Block) -> None:
        insort(self.unmapped, (block.stream, block.addr))
        self.unmapped_blocks[block.addr] = block

    def erase_unmapped(self, block: _Block) -> None:
        del self.unmapped[bisect_left(self.unmapped, (block.stream, block.addr))]
        del self.unmapped_blocks[block.addr]


@dataclass(frozen=True)
class BlockState:
    """One block of a segment: its address, size (rounded), and whether it is allocated, with
    the bytes asked for and the event key when it is; `pending_free`: freed, its stream uses
    not yet ended (torch's `active_pending_free`)."""

    address: int
    size: int
    allocated: bool
    requested_bytes: int = 0
    key: Any = None
    pending_free: bool = False


@dataclass(frozen=True)
class SegmentState:
    """A segment as `torch.cuda.memory_snapshot()` lists it: one `cudaMalloc`, or one
    contiguous mapped range of an expandable segment, with its blocks in address order."""

    address: int
    total_size: int
    allocated_size: int
    pool: str  # "small" or "large"
    expandable: bool
    blocks: Tuple[BlockState, ...]
    stream: int = 0


@dataclass(frozen=True)
class AllocatorReplay:
    """What a timeline of allocations does to the caching allocator.

    Attributes:
        reserved_peak_bytes: the most the allocator held from the device at once
            (`torch.cuda.max_memory_reserved`).
        allocated_peak_bytes: the most it handed out at once, in rounded blocks
            (`torch.cuda.max_memory_allocated`).
        requested_peak_bytes: the most asked for at once, before rounding.
        reserved_bytes: held at the end (`torch.cuda.memory_reserved`).
        allocated_bytes: handed out at the end (`torch.cuda.memory_allocated`).
        segments: the segments at the end, each with its blocks.
        oom: None, or the event at which a device of `device_memory` bytes ran out: the replay
            stops there, as the program would, with the cache already released.
        oom_index: the position of that event in the timeline (None without an OOM).
        num_alloc_retries: allocations that needed the whole cache released first.
        num_device_alloc: `cudaMalloc` calls (and mappings of expandable pages).
        num_device_free: `cudaFree` calls (and unmappings).
        events: the events replayed (up to and with the OOM one).
        trace: with `record_trace=True`, what the allocator did, as a snapshot's device trace
            records it: `(action, address, bytes, stream)` with the actions `alloc`,
            `free_requested`, `free_completed`, `segment_alloc`, `segment_free`, `segment_map`,
            `segment_unmap`; empty otherwise.
    """

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    requested_peak_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    segments: Tuple[SegmentState, ...]
    oom: Optional[tuple]
    oom_index: Optional[int]
    num_alloc_retries: int
    num_device_alloc: int
    num_device_free: int
    events: int
    trace: Tuple[tuple, ...] = ()

    @property
    def largest_free_block_bytes(self) -> int:
        """The largest cached block (`torch.cuda.memory.cache_info`'s largest, 0 if none)."""
        return max((block.size for segment in self.segments for block in segment.blocks
                    if not block.allocated), default=0)


class OutOfMemory(Exception):
    """The model's `torch.OutOfMemoryError`: no cached block fits and the device is full."""


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """`DeviceCachingAllocator::roundup_power2_next_division`: `size` rounded up to the next of
    `divisions` equal steps between the powers of two around it (1200 in 4 divisions: 1280)."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, conf: AllocConf) -> int:
    """`DeviceCachingAllocator::round_size`: at least 512 bytes, then either a multiple of 512
    or, with `roundup_power2_divisions` for the size's interval above 1 and a size above
    512 times the divisions, the next power-of-two division."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = conf.divisions_for(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int, conf: AllocConf) -> int:
    """`DeviceCachingAllocator::get_allocation_size`: the segment a rounded request that finds
    no cached block asks `cudaMalloc` for."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return conf.large_segment_size_bytes
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class CachingAllocatorModel:
    """One device's caching allocator, driven one call at a time (`malloc`, `free`,
    `empty_cache`), its statistics kept as `DeviceStats` keeps them.

    Args:
        alloc_conf: None, a `PYTORCH_CUDA_ALLOC_CONF` string, or a parsed `AllocConf`.
        device_memory: the bytes the allocator may take from the device; None for no limit.
        record_trace: keep `trace`, what the allocator did, as a snapshot's device trace
            records it (`(action, address, bytes, stream)` tuples).
    """

    def __init__(self, alloc_conf: Union[None, str, AllocConf] = None,
                 device_memory: Optional[int] = None, record_trace: bool = False) -> None:
        conf = as_alloc_conf(alloc_conf)
        if conf.backend != "native":
            raise ValueError(
                f"backend:{conf.backend} is CUDA's own stream-ordered allocator, not the caching "
                "allocator modelled here; allowed: backend:native (the default)"
            )
        if device_memory is not None and (
                isinstance(device_memory, bool) or not isinstance(device_memory, int)
                or device_memory < 0):
            raise ValueError(f"device_memory must be a whole number of bytes >= 0 or None, "
                             f"got {device_memory!r}")
        self.conf = conf
        self.device_memory = device_memory
        # DeviceCachingAllocator::setMemoryFraction (called with per_process_memory_fraction):
        # a fraction below 1 sets allowed_memory_maximum, which caps the reserved bytes and
        # turns on garbage collection.
        self.allowed_maximum: Optional[int] = None
        if conf.per_process_memory_fraction < 1.0:
            if device_memory is None:
                raise ValueError(
                    f"per_process_memory_fraction:{conf.per_process_memory_fraction} is a "
                    "fraction of the device's memory: give device_memory too"
                )
            self.allowed_maximum = int(conf.per_process_memory_fraction * device_memory)
        self.gc_active = self.allowed_maximum is not None and conf.garbage_collection_threshold > 0
        self.small = _Pool(is_small=True)
        self.large = _Pool(is_small=False)
        self.live: Dict[Any, Optional[_Block]] = {}  # key -> block (None: a 0-byte tensor)
        self.trace: Optional[List[tuple]] = [] if record_trace else None
        # cuda_events: per stream, the frees waiting on it, in order; the events of a stream
        # whose work has ended (`synchronize`) are complete and wait for process_events.
        self.cuda_events: Dict[int, List[_Block]] = {}
        self.completed_events: Dict[int, int] = {}  # stream -> how many of its events ended
        self.pending: Dict[int, _Block] = {}  # addr -> a freed block waiting on its events
        # Where a new segment lies: None, or a function (bytes, stream) -> address or None,
        # for a replay that takes the addresses a real run's cudaMalloc returned.
        self.segment_address: Any = None
        self.expandables: List[_Expandable] = []
        self.next_addr = 1 << 21  # addresses of new segments and address ranges grow upward
        self.reserved = 0  # total_allocated_memory == stats.reserved_bytes.current
        self.reserved_peak = 0
        self.allocated = 0
        self.allocated_peak = 0
        self.requested = 0
        self.requested_peak = 0
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_ooms = 0
        self.device_total = _UNBOUNDED_DEVICE if device_memory is None else device_memory
        self._max_split = conf.max_split_size_bytes
        self._max_rounding = conf.max_non_split_rounding_bytes

    # -- the public calls ------------------------------------------------------------------

    def malloc(self, key: Any, nbytes: int, stream: int = 0) -> None:
        """`NativeCachingAllocator::allocate` then `DeviceCachingAllocator::malloc` on `stream`.

        Raises:
            OutOfMemory: the device cannot hold it, the cache released first.
        """
        if self.cuda_events:
            self._process_events()
        if nbytes == 0:
            # NativeCachingAllocator::allocate: a 0-byte tensor gets no block.
            self.live[key] = None
            return
        if nbytes >= ONE_EXABYTE:
            self.num_ooms += 1
            raise OutOfMemory(nbytes)
        size = round_size(nbytes, self.conf)
        pool = self.small if size <= K_SMALL_SIZE else self.large  # get_pool
        alloc_size = allocation_size(size, self.conf)
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self.gc_active:
                self._garbage_collect()
            # alloc_block, then release enough oversize cached blocks and retry, then release
            # every unsplit cached block and retry (malloc).
            block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self.num_ooms += 1
                raise OutOfMemory(nbytes)
        if self._should_split(block, size):
            block = self._split(block, size)
        # alloc_found_block
        block.allocated = True
        block.requested = nbytes
        block.key = key
        self.live[key] = block
        self.allocated += block.size
        self.requested += nbytes
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
        if self.requested > self.requested_peak:
            self.requested_peak = self.requested
        if self.trace is not None:
            self.trace.append(("alloc", block.addr, nbytes, block.stream))

    def record_stream(self, key: Any, stream: int) -> None:
        """`recordStream` (`Tensor.record_stream`): the block is used on `stream` too; a use on
        its own allocation stream is ignored."""
        block = self.live[key]
        if block is None or stream == block.stream:
            return
        if block.stream_uses is None:
            block.stream_uses = set()
        block.stream_uses.add(stream)

    def free(self, key: Any) -> None:
        """`DeviceCachingAllocator::free`: the block's bytes stop counting as allocated; with
        uses on other streams an event is recorded on each (`insert_events`) and the block waits
        for them; else `free_block`: back to its pool, merged with the free blocks on either
        side. The segment stays reserved."""
        block = self.live.pop(key)
        if block is None:
            return
        block.allocated = False
        block.key = None
        self.allocated -= block.size
        if self.trace is not None:
            self.trace.append(("free_requested", block.addr, block.requested, block.stream))
        if block.stream_uses:
            for stream in sorted(block.stream_uses):
                self.cuda_events.setdefault(stream, []).append(block)
                block.event_count += 1
            block.stream_uses = None
            self.pending[block.addr] = block
            return
        self._free_block(block)

    def _free_block(self, block: _Block) -> None:
        """`free_block`: the block goes back to its pool, merged with free neighbours."""
        if self.trace is not None:
            self.trace.append(("free_completed", block.addr, block.requested, block.stream))
        self.requested -= block.requested
        block.requested = 0
        pool = block.pool
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour, pool)
        pool.insert(block)

    def synchronize(self, stream: int) -> None:
        """The work queued on `stream` so far has ended (`torch.cuda.Stream.synchronize`, or
        simply time passing): the events recorded on it are complete. The frees waiting on
        them complete at the next `malloc` (`process_events`) or `empty_cache`."""
        self.completed_events[stream] = len(self.cuda_events.get(stream, ()))

    def _process_events(self) -> None:
        """`process_events`: per stream, the completed events in order; a block whose last
        event completes is freed (`free_block`)."""
        for stream in list(self.cuda_events):
            done = self.completed_events.pop(stream, 0)
            if not done:
                continue
            queue = self.cuda_events[stream]
            for block in queue[:done]:
                self._event_done(block)
            del queue[:done]
            if not queue:
                del self.cuda_events[stream]

    def _synchronize_and_free_events(self) -> None:
        """`synchronize_and_free_events`: every outstanding event waited for."""
        events, self.cuda_events = self.cuda_events, {}
        self.completed_events.clear()
        for queue in events.values():
            for block in queue:
                self._event_done(block)

    def _event_done(self, block: _Block) -> None:
        block.event_count -= 1
        if block.event_count == 0:
            del self.pending[block.addr]
            self._free_block(block)

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: `emptyCache` -> `release_cached_blocks`."""
        self._release_cached_blocks()

    def add_segment(self, address: int, size: int, small: bool, stream: int,
                    allocated: Iterable[Tuple[int, int, Any, int]] = ()) -> None:
        """A `cudaMalloc` segment the allocator already held when a replay begins mid-run (a
        recorded trace rarely starts from an empty allocator): `allocated` holds its allocated
        blocks as `(address, size, key, requested bytes)` in address order; the rest of the
        segment is cached, in maximal free blocks as `free_block` leaves them. It counts as
        reserved (and in the peak), not as a `cudaMalloc` of the replay."""
        pool = self.small if small else self.large
        blocks = self._blocks_of_range(pool, None, address, size, stream, allocated)
        for before, after in zip(blocks, blocks[1:]):
            before.next, after.prev = after, before
        for block in blocks:
            if not block.allocated:
                pool.insert(block)
        self.next_addr = max(self.next_addr, address + size)
        self.reserved += size
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.requested_peak = max(self.requested_peak, self.requested)

    def add_expandable_segment(self, base: int, mapped: Sequence[Tuple[int, int]], small: bool, stream: int,
                               allocated: Iterable[Tuple[int, int, Any, int]] = ()) -> None:
        """An expandable segment the allocator already held when a replay begins mid-run: its
        address range from `base`, the `mapped` ranges `(address, bytes)` in it in address order,
        and their allocated blocks as `add_segment` takes them; the rest of each range is cached,
        the space between and after the ranges unmapped. The mapped bytes count as reserved."""
        pool = self.small if small else self.large
        page = K_SMALL_BUFFER if small else self.conf.large_segment_size_bytes
        segment = _Expandable(base, page, self.device_total)
        self.expandables.append(segment)
        pieces: List[_Block] = []
        cursor = base
        owned = sorted(allocated)
        for start, size in mapped:
            if start > cursor:
                pieces.append(_Block(start - cursor, cursor, pool, segment, mapped=False, stream=stream))
            inside = [block for block in owned if start <= block[0] < start + size]
            pieces += self._blocks_of_range(pool, segment, start, size, stream, inside)
            cursor = start + size
        if cursor < base + segment.size:
            pieces.append(_Block(base + segment.size - cursor, cursor, pool, segment, mapped=False, stream=stream))
        for before, after in zip(pieces, pieces[1:]):
            before.next, after.prev = after, before
        for block in pieces:
            if not block.mapped:
                pool.insert_unmapped(block)
            elif not block.allocated:
                pool.insert(block)
        self.next_addr = max(self.next_addr, base + segment.size)
        self.reserved += sum(size for _, size in mapped)
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.requested_peak = max(self.requested_peak, self.requested)

    def _blocks_of_range(self, pool: _Pool, segment: Optional[_Expandable], address: int, size: int, stream: int,
                         allocated: Iterable[Tuple[int, int, Any, int]]) -> List[_Block]:
        """The blocks of `size` bytes from `address`: `allocated` ones (registered as live), the
        space between them cached in maximal free blocks."""
        blocks: List[_Block] = []
        cursor = address
        for addr, nbytes, key, requested in allocated:
            if addr > cursor:
                blocks.append(_Block(addr - cursor, cursor, pool, segment, stream=stream))
            block = _Block(nbytes, addr, pool, segment, stream=stream)
            block.allocated, block.key, block.requested = True, key, requested
            blocks.append(block)
            self.live[key] = block
            self.allocated += nbytes
            self.requested += requested
            cursor = addr + nbytes
        if cursor < address + size:
            blocks.append(_Block(address + size - cursor, cursor, pool, segment, stream=stream))
        return blocks

    # -- finding a cached block --------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int, stream: int = 0) -> Optional[_Block]:
        """`get_free_block`: the smallest cached block of `stream` of at least `size` bytes (best
        fit; `lower_bound` over blocks ordered by stream, size, then address), within the
        max_split rules; a block of another stream never serves."""
        if self.gc_active:
            pool.gc_calls += 1  # the age garbage collection reads
        keys = pool.keys
        index = bisect_left(keys, (stream, size, -1))
        if index == len(keys) or keys[index][0] != stream:
            return None
        block = pool.blocks[keys[index][2]]
        if block.segment is not None:
            if self.conf.expandable_segments:
                # A block followed by unmapped space counts as the size it can grow to, so the
                # search walks on while the next block can grow to less.
                def grown(candidate: _Block) -> int:
                    following = candidate.next
                    return candidate.size + (following.size if following is not None
                                             and not following.mapped else 0)
                while (block.segment is not None and index + 1 < len(keys)
                       and keys[index + 1][0] == stream):
                    following = pool.blocks[keys[index + 1][2]]
                    if grown(following) >= grown(block):
                        break
                    index += 1
                    block = following
            else:
                # Expandable segments switched off: only blocks of cudaMalloc segments serve.
                index += 1
                while (index < len(keys) and keys[index][0] == stream
                       and pool.blocks[keys[index][2]].segment is not None):
                    index += 1
                if index == len(keys) or keys[index][0] != stream:
                    return None
                block = pool.blocks[keys[index][2]]
        max_split = self._max_split
        # Do not return an oversized block for a request below max_split_size ...
        if size < max_split and block.size >= max_split:
            return None
        # ... and let an oversized one serve a large request only within max_non_split_rounding.
        if size >= max_split and block.size >= size + self._max_rounding:
            return None
        pool.erase(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        """`should_split`: the small pool (and every pool with expandable segments) splits off
        any remainder of 512 bytes or more; the large pool only a remainder above 1 MiB, and
        never for a request of max_split_size or more."""
        remaining = block.size - size
        if block.pool.is_small or self.conf.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _split(self, block: _Block, size: int) -> _Block:
        """`alloc_found_block` with split_remainder: the front `size` bytes are handed out, the
        rest goes back to the pool as a cached block."""
        front = _Block(size, block.addr, block.pool, block.segment, stream=block.stream)
        front.prev = block.prev
        if front.prev is not None:
            front.prev.next = front
        front.next = block
        block.prev = front
        block.addr += size
        block.size -= size
        block.pool.insert(block)
        return front

    def _try_merge(self, dst: _Block, src: Optional[_Block], pool: _Pool) -> int:
        """`try_merge_blocks`: `src`, a free neighbour mapped as `dst` is, joins `dst` (not a
        block whose free waits on other streams)."""
        if src is None or src.allocated or src.event_count or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- asking the device ------------------------------------------------------------------

    def _fits(self, nbytes: int) -> bool:
        return self.device_memory is None or self.reserved + nbytes <= self.device_memory

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.num_device_alloc += 1
        if self.reserved > self.reserved_peak:
            self.reserved_peak = self.reserved

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int,
                     stream: int = 0) -> Optional[_Block]:
        """`alloc_block`: past the per-process limit it fails at once; with expandable segments
        it maps pages (`try_allocate_expandable_block`); else one `cudaMalloc(alloc_size)`."""
        if self.allowed_maximum is not None and self.reserved + alloc_size > self.allowed_maximum:
            return None
        if self.conf.expandable_segments:
            return self._allocate_expandable(pool, size, stream)
        if not self._fits(alloc_size):
            return None
        addr = None
        if self.segment_address is not None:
            addr = self.segment_address(alloc_size, stream)
        if addr is None:
            addr = self.next_addr
            self.next_addr += alloc_size
        block = _Block(alloc_size, addr, pool, None, stream=stream)
        if self.trace is not None:
            self.trace.append(("segment_alloc", addr, alloc_size, stream))
        self._grow(alloc_size)
        return block

    def _release_block(self, block: _Block) -> None:
        """`release_block`: `cudaFree` of a whole cached segment."""
        if self.trace is not None:
            self.trace.append(("segment_free", block.addr, block.size, block.stream))
        block.pool.erase(block)
        self.reserved -= block.size
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int = 0) -> bool:
        """`release_available_cached_blocks`: with max_split_size set, free the smallest
        oversize cached block of the stream that covers the request, else the stream's largest
        ones until enough."""
        max_split = self._max_split
        if max_split == SIZE_MAX:
            return False
        target = max(size, max_split)
        keys = pool.keys
        index = bisect_left(keys, (stream, target, -1))
        if (index < len(keys) and keys[index][0] == stream
                and pool.blocks[keys[index][2]].segment is None):
            self._release_block(pool.blocks[keys[index][2]])
            return True
        if index == 0:
            return False
        released = 0
        index -= 1
        while released < target and keys[index][1] >= max_split and keys[index][0] == stream:
            current = pool.blocks[keys[index][2]]
            is_first = index == 0
            if current.segment is None:
                released += current.size
                self._release_block(current)
            if is_first:
                break
            index -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """`release_cached_blocks`: every outstanding event waited for
        (`synchronize_and_free_events`), then `release_blocks` on the large pool, then the small
        one, every stream: each cached block that is a whole segment is freed; expandable
        segments unmap the whole pages inside their free blocks."""
        if self.cuda_events:
            self._synchronize_and_free_events()
        for pool in (self.large, self.small):
            to_unmap = []
            for *_, addr in list(pool.keys):
                block = pool.blocks.get(addr)
                if block is None:
                    continue
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and block.prev is None and block.next is None:
                    # release_expandable_segment: the whole address range is unmapped
                    pool.erase_unmapped(block)
                    self.expandables.remove(block.segment)

    def _garbage_collect(self) -> None:
        """`garbage_collect_cached_blocks`: above the threshold of the allowed memory, free
        unsplit cached large blocks whose age (free-block searches since they were cached) is
        at least the average, until enough is reclaimed or none is left to free."""
        threshold = int(self.conf.garbage_collection_threshold * self.allowed_maximum)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large
        total_age = 0
        count = 0
        for *_, addr in pool.keys:
            block = pool.blocks[addr]
            if not block.is_split():
                total_age += pool.gc_calls - block.gc_base
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for *_, addr in list(pool.keys):
                block = pool.blocks.get(addr)
                if block is None or block.is_split() or block.segment is not None:
                    continue
                age = pool.gc_calls - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # -- expandable segments ----------------------------------------------------------------

    def _allocate_expandable(self, pool: _Pool, size: int, stream: int = 0) -> Optional[_Block]:
        """`try_allocate_expandable_block`: the lowest address where free and unmapped space
        together hold `size` (`find_expandable_block`, a new segment's address range if none),
        mapped up to `size` a page at a time (`map_block`)."""
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped:
            if not self._map_block(candidate, min(candidate.size, size)):
                return None
        while candidate.size < size:
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.erase(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int = 0) -> _Block:
        def allocatable(block: Optional[_Block]) -> bool:
            return block is not None and not block.allocated and not block.event_count

        for block_stream, addr in pool.unmapped[bisect_left(pool.unmapped, (stream, -1)):]:
            if block_stream != stream:
                break
            candidate = pool.unmapped_blocks[addr]
            if allocatable(candidate.prev):
                candidate = candidate.prev
            room, walk = 0, candidate
            while room < size and allocatable(walk):
                room += walk.size
                walk = walk.next
            if room >= size:
                return candidate
        page = K_SMALL_BUFFER if pool.is_small else self.conf.large_segment_size_bytes
        segment = _Expandable(self.next_addr, page, self.device_total)
        self.next_addr += segment.size
        self.expandables.append(segment)
        candidate = _Block(segment.size, segment.base, pool, segment, mapped=False, stream=stream)
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, block: _Block, size: int) -> bool:
        """`map_block` with `ExpandableSegment::map`: the pages covering the first `size` bytes
        are mapped (all or none: `cuMemCreate` failing rolls the others back)."""
        page = block.segment.page
        mapped = -(-size // page) * page  # the block starts on a page boundary
        if not self._fits(mapped):
            return False
        pool = block.pool
        pool.erase_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.size - mapped, block.addr + mapped, pool, block.segment,
                          mapped=False, stream=block.stream)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.insert_unmapped(rest)
            block.size = mapped
        if self.trace is not None:
            self.trace.append(("segment_map", block.addr, mapped, block.stream))
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self._grow(mapped)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """`unmap_block` with `ExpandableSegment::unmap`: the whole pages inside a free block
        are unmapped; the slivers before and after stay mapped and cached."""
        segment = block.segment
        page = segment.page
        offset = block.addr - segment.base
        begin = -(-offset // page)
        end = (offset + block.size) // page
        if begin >= end:
            return
        pool = block.pool
        pool.erase(block)
        start = segment.base + begin * page
        length = (end - begin) * page
        before = start - block.addr
        if before > 0:
            sliver = _Block(before, block.addr, pool, segment, stream=block.stream)
            sliver.prev = block.prev
            if block.prev is not None:
                block.prev.next = sliver
            sliver.next = block
            block.prev = sliver
            pool.insert(sliver)
        after = block.size - before - length
        if after > 0:
            sliver = _Block(after, start + length, pool, segment, stream=block.stream)
            sliver.next = block.next
            if block.next is not None:
                block.next.prev = sliver
            sliver.prev = block
            block.next = sliver
            pool.insert(sliver)
        block.addr = start
        block.size = length
        block.mapped = False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert_unmapped(block)
        if self.trace is not None:
            self.trace.append(("segment_unmap", start, length, block.stream))
        self.reserved -= length
        self.num_device_free += 1

    # -- reading the state --------------------------------------------------------------------

    def segments(self) -> Tuple[SegmentState, ...]:
        """The segments, as `DeviceCachingAllocator::snapshot` reports them, by address."""
        heads: Dict[int, _Block] = {}
        blocks = [block for pool in (self.small, self.large) for block in pool.blocks.values()]
        blocks += [block for block in self.live.values() if block is not None]
        blocks += self.pending.values()
        for block in blocks:
            if block.prev is not None and block.prev.mapped:
                continue
            heads[block.addr] = block
        result = []
        for addr in sorted(heads):
            states = []
            walk: Optional[_Block] = heads[addr]
            while walk is not None and walk.mapped:
                states.append(BlockState(walk.addr, walk.size, walk.allocated, walk.requested,
                                         walk.key, walk.event_count > 0))
                walk = walk.next
            result.append(SegmentState(
                address=addr,
                total_size=sum(state.size for state in states),
                allocated_size=sum(state.size for state in states if state.allocated),
                pool="small" if heads[addr].pool.is_small else "large",
                expandable=heads[addr].segment is not None,
                blocks=tuple(states),
                stream=heads[addr].stream,
            ))
        return tuple(result)


_EVENT_FORMS = ("('alloc', key, nbytes), ('free', key) or ('empty_cache',); with streams also "
                "('alloc', key, nbytes, stream), ('record_stream', key, stream) and "
                "('synchronize', stream)")
_FORMS = {("alloc", 3), ("alloc", 4), ("free", 2), ("empty_cache", 1), ("record_stream", 3),
          ("synchronize", 2)}


def _is_stream(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked_form(index: int, event: Any) -> tuple:
    """The event as a tuple, after checking its form, its stream and its key (a ValueError naming it)."""
    form = tuple(event) if isinstance(event, (tuple, list)) else ()
    kind = form[0] if form else None
    if (kind, len(form)) not in _FORMS:
        raise ValueError(f"event {index} {event!r}: an event is {_EVENT_FORMS}")
    if kind == "synchronize" or kind == "record_stream" or (kind == "alloc" and len(form) == 4):
        if not _is_stream(form[-1]):
            raise ValueError(f"event {index} {event!r}: a stream is a whole number >= 0")
    if kind not in ("empty_cache", "synchronize"):
        try:
            hash(form[1])
        except TypeError:
            raise ValueError(f"event {index} {event!r}: the key must be hashable "
                             "(a string, a number, a tuple of them)") from None
    return form


def _apply(model: "CachingAllocatorModel", index: int, form: tuple) -> None:
    """One checked event through the allocator model (`OutOfMemory` where it runs out)."""
    kind, live = form[0], model.live
    if kind == "alloc":
        key, nbytes = form[1], form[2]
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"event {index} {form!r}: nbytes must be a whole number of bytes >= 0")
        if key in live:
            raise ValueError(f"event {index} {form!r}: key {key!r} is allocated already and not freed")
        model.malloc(key, nbytes, form[3] if len(form) == 4 else 0)
    elif kind in ("record_stream", "free") and form[1] not in live:
        raise ValueError(f"event {index} {form!r}: key {form[1]!r} is not allocated")
    elif kind == "record_stream":
        model.record_stream(form[1], form[2])
    elif kind == "synchronize":
        model.synchronize(form[1])
    elif kind == "free":
        model.free(form[1])
    else:
        model.empty_cache()


def replay_allocations(events: Iterable[tuple], *,
                       alloc_conf: Union[None, str, AllocConf] = None,
                       device_memory: Optional[int] = None,
                       record_trace: bool = False) -> AllocatorReplay:
    """Replay allocations and frees through a model of PyTorch's CUDA caching allocator.

    Args:
        events: `("alloc", key, nbytes)`, `("free", key)` and `("empty_cache",)` in program
            order; a key names one tensor's storage from its allocation to its free. With
            streams (whole numbers, 0 the default stream): `("alloc", key, nbytes, stream)`,
            `("record_stream", key, stream)` (`Tensor.record_stream`: a free of the key then
            waits for that stream) and `("synchronize", stream)` (the stream's work so far has
            ended).
        alloc_conf: None (torch's defaults), a `PYTORCH_CUDA_ALLOC_CONF` string such as
            `"expandable_segments:True"`, or a parsed
            `trainer_memcb.plan.device.alloc_conf.AllocConf`.
        device_memory: the bytes the allocator may take from the device; with it, the replay
            stops at the event that runs out (`oom`), as the program would.
        record_trace: keep what the allocator did in `trace`, as a snapshot's device trace.

    Returns:
        An `AllocatorReplay`: peaks, the state at the end, the segments, the OOM event.

    Raises:
        ValueError: a bad event (a free of an unknown key, a negative or non-integer size, a
            key allocated twice, an unknown form), naming it and its position; a bad config.

    Example:
        >>> replay = replay_allocations([("alloc", "x", 1000), ("free", "x")])
        >>> replay.allocated_peak_bytes, replay.reserved_peak_bytes, replay.reserved_bytes
        (1024, 2097152, 2097152)
    """
    model = CachingAllocatorModel(alloc_conf, device_memory, record_trace=record_trace)
    oom: Optional[tuple] = None
    oom_index: Optional[int] = None
    count = 0
    for index, event in enumerate(events):
        count = index + 1
        form = _checked_form(index, event)
        try:
            _apply(model, index, form)
        except OutOfMemory:
            oom, oom_index = tuple(form), index
            break
    return AllocatorReplay(
        reserved_peak_bytes=model.reserved_peak,
        allocated_peak_bytes=model.allocated_peak,
        requested_peak_bytes=model.requested_peak,
        reserved_bytes=model.reserved,
        allocated_bytes=model.allocated,
        segments=model.segments(),
        oom=oom,
        oom_index=oom_index,
        num_alloc_retries=model.num_alloc_retries,
        num_device_alloc=model.num_device_alloc,
        num_device_free=model.num_device_free,
        events=count,
        trace=tuple(model.trace) if model.trace is not None else (),
    )
