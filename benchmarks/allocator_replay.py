"""How fast the caching allocator model replays a timeline: events per second for 100,000 events.

A step plan's timeline of a 7B model holds tens of thousands of allocations and frees, and the
replay runs once per plan, per process and per step replayed, so it must stay well under the
plan's own time. The timeline here is synthetic and seeded: tensors of 256 bytes to 256 MiB
(log-uniform, so both pools and every segment rule are exercised), freed mostly in the reverse
order of their allocation, as a forward and backward pass free their activations, with a
resident set that never empties, and an `empty_cache` every 10,000 events.

    python benchmarks/allocator_replay.py            # 100,000 events, three settings
    python benchmarks/allocator_replay.py --events 20000
"""

from __future__ import annotations

import argparse
import random
import time

from trainer_memcb import replay_allocations

SETTINGS = (None, "expandable_segments:True", "max_split_size_mb:128,roundup_power2_divisions:4")


def timeline(count: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    events = []
    live = []
    next_key = 0
    while len(events) < count:
        if len(events) % 10_000 == 9_999:
            events.append(("empty_cache",))
            continue
        if live and (len(live) > 400 or rng.random() < 0.45):
            # mostly the newest tensor goes first, sometimes an older one
            index = len(live) - 1 - min(int(rng.expovariate(0.3)), len(live) - 1)
            events.append(("free", live.pop(index)))
        else:
            nbytes = int(2 ** rng.uniform(8, 28))
            events.append(("alloc", next_key, nbytes))
            live.append(next_key)
            next_key += 1
    return events


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000, help="timeline length (default 100,000)")
    args = parser.parse_args(argv)
    if args.events < 1:
        parser.error(f"--events must be 1 or more, got {args.events}")
    events = timeline(args.events)
    for conf in SETTINGS:
        start = time.perf_counter()
        replay = replay_allocations(events, alloc_conf=conf)
        seconds = time.perf_counter() - start
        print(f"{conf or 'defaults':<52} {len(events) / seconds:>12,.0f} events/s  "
              f"({seconds:.2f} s; reserved peak {replay.reserved_peak_bytes / 2 ** 30:.2f} GiB, "
              f"allocated peak {replay.allocated_peak_bytes / 2 ** 30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
