"""How long the step plan takes, and its peak memory (RSS), for Llama-2-7B and a 70B-sized Llama
(also at tensor parallelism 8 beside FSDP2 on 16, within 60 s).

Each case runs `trainer-memcb estimate` in a process of its own (so that its peak RSS is its own)
and prints the wall time, the CPU time (on a shared machine the wall time waits for other
processes; the CPU time is the command's own) and the peak RSS, each case's CPU time also as a
ratio to the first case's, the Llama-2-7B plan at 8 x 512 (much of a machine's speed and load
cancels out of the ratios), against the targets: the plan with
activations at batch 8 x 512 within 10 s and 1 GiB, `--max-batch-size` within 60 s; and for
Llama-2-7B, the same plan with the evaluation plan beside it (`--eval-samples 1000
--eval-batch-size 8`), whose evaluation part adds at most 5 s of CPU time.

    python benchmarks/step_plan.py
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("examples/models/llama-2-7b", "examples/models/llama-2-70b-shape")
CASES = (
    ("plan at 8 x 512", ["--batch-size", "8", "--seq-len", "512"], 10.0),
    ("--max-batch-size at 512, 80GiB", ["--max-batch-size", "--seq-len", "512", "--device-memory", "80GiB"], 60.0),
)
# The engine plans for 7B (target 15 s each): FSDP2 traced with the real fully_shard, ZeRO modelled.
ENGINE_CASES = tuple(
    (f"{name} x {world}, 8 x 512", ["--batch-size", "8", "--seq-len", "512", "--world-size", str(world), *flags], 15.0)
    for world in (8, 64)
    for name, flags in (("fsdp2 full shard", ["--sharding", "fsdp-full-shard", "--precision", "bf16"]),
                        ("ddp", ["--sharding", "ddp", "--precision", "bf16"]),
                        ("zero3", ["--zero", "3", "--precision", "deepspeed-bf16"]))
)
# The 70B under tensor parallelism beside FSDP2 (target 60 s): 8 x 16 processes, each rank's step traced.
TP_CASE = ("tp=8 x dp_shard=16, 1 x 512, ckpt", ["--parallelism", "tp=8,dp_shard=16", "--batch-size", "1", "--seq-len",
                                                "512", "--precision", "autocast-bf16", "--gradient-checkpointing",
                                                "--gpu", "H100"], 60.0)
# A 70B model's bf16 weights alone exceed 80 GiB on one process: its search is asked under ZeRO-3 on 64.
SHARDED = ["--zero", "3", "--world-size", "64", "--precision", "deepspeed-bf16"]
EVALUATION = ["--eval-samples", "1000", "--eval-batch-size", "8"]
EVALUATION_ADDED_TARGET = 5.0  # seconds of CPU time the evaluation plan adds, at most


def run(model: str, extra: list) -> tuple:
    """Wall seconds, CPU seconds and the peak RSS of the largest child so far (bytes)."""
    command = [sys.executable, "-m", "trainer_memcb", "estimate", model, "--dtype", "bfloat16",
               "--optimizers", "adamw_torch", "--json", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, after.ru_maxrss * 1024  # ru_maxrss is KiB on Linux (the largest child so far)


def main() -> None:
    print(f"{'model':38} {'case':32} {'wall s':>8} {'cpu s':>8} {'target s':>8} {'cpu/target':>10} {'RSS MiB*':>12} "
          f"{'cpu/7B':>7}")
    base: list = []  # the CPU seconds of the first case, Llama-2-7B's plan at 8 x 512

    def ratio(cpu: float) -> str:
        base[:] = base or [cpu]
        return f"{cpu / base[0]:7.2f}"

    for model in MODELS:
        for name, extra, target in CASES:
            if "70b" in model and "max-batch" in name:
                extra, name = extra + SHARDED, name + ", ZeRO-3 x 64"
            wall, cpu, rss = run(model, extra)
            print(f"{model:38} {name:32} {wall:8.1f} {cpu:8.1f} {target:8.0f} {cpu / target:10.2f} {rss / 2**20:12.0f} "
                  f"{ratio(cpu)}")
            if "70b" not in model and name == CASES[0][0]:
                plain = cpu
                wall, cpu, rss = run(model, extra + EVALUATION)
                added = cpu - plain
                print(f"{model:38} {'  + evaluation of 1000 x 512':32} {wall:8.1f} {cpu:8.1f} {target + 5:8.0f} "
                      f"{cpu / (target + 5):10.2f} {rss / 2**20:12.0f} {ratio(cpu)}")
                print(f"{'':38} {'  the evaluation part adds':32} {'':8} {added:8.1f} {EVALUATION_ADDED_TARGET:8.0f} "
                      f"{added / EVALUATION_ADDED_TARGET:10.2f}   -> target {'met' if added <= EVALUATION_ADDED_TARGET else 'NOT met'}")
    for model, (name, extra, target) in [(MODELS[0], case) for case in ENGINE_CASES] + [(MODELS[1], TP_CASE)]:
        wall, cpu, rss = run(model, extra)
        print(f"{model:38} {name:32} {wall:8.1f} {cpu:8.1f} {target:8.0f} {cpu / target:10.2f} {rss / 2**20:12.0f} "
              f"{ratio(cpu)}")
    print("* the largest peak RSS of the cases run so far (getrusage of the children): each case's own is at most that")


if __name__ == "__main__":
    main()
