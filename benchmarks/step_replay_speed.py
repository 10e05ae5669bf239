"""What the allocator replay adds to the step plan's time: Llama-2-7B at 8 x 512, bf16, AdamW.

The step is traced once (`trace_step`, what `plan_step_memory` spends nearly all its time on), then
its timeline is replayed over two steps through the caching allocator model (`replay_step`, what
the step plan adds on CUDA), three times; the fastest replay is taken (a busy machine only adds
time). Printed: the trace's CPU time, the replay's, the events replayed, and the ratio replay /
trace against the target of at most 0.20. A plan whose replay runs past the device's memory
replays a second time with the limit (`fits?`), at most doubling the replay.

    python benchmarks/step_replay_speed.py
    python benchmarks/step_replay_speed.py --model examples/models/mistral-7b --batch-size 4 --seq-len 4096
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "examples", "models", "llama-2-7b"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    import torch

    from trainer_memcb.plan.answers.step_replay import replay_step
    from trainer_memcb.plan.optimizers.whatif import build_meta_model
    from trainer_memcb.plan.settings import resolve_settings
    from trainer_memcb.plan.step.trace import trace_step

    settings = resolve_settings(batch_size=args.batch_size, seq_len=args.seq_len, optimizer="adamw_torch",
                                precision="bf16", device_type="cuda")
    meta = build_meta_model(args.model, torch.bfloat16)
    start = time.process_time()
    timeline = trace_step(meta, settings, args=None, step_dtype=torch.bfloat16)
    traced = time.process_time() - start
    replays = []
    for _ in range(3):
        start = time.process_time()
        replay = replay_step(timeline, alloc_conf="")
        replays.append(time.process_time() - start)
    fastest = min(replays)
    ratio = fastest / traced
    print(f"model {os.path.relpath(args.model, ROOT)}, {args.batch_size} x {args.seq_len}, bf16, adamw_torch")
    print(f"trace: {traced:.2f} s CPU, {len(timeline.events):,} events")
    print(f"replay (two steps, {replay.events:,} allocator calls): {fastest:.3f} s CPU (runs: "
          f"{', '.join(f'{t:.3f}' for t in replays)})")
    print(f"reserved peak {replay.reserved_peak_bytes:,} bytes, allocated peak {replay.allocated_peak_bytes:,}")
    print(f"replay / trace: {ratio:.3f} (target at most {TARGET:.2f}) {'OK' if ratio <= TARGET else 'OVER'}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
