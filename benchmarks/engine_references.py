"""The engine plans for Llama-2-7B against torch's and DeepSpeed's own figures, and their times.

- FSDP2 (full shard, bf16 parameters, AdamW, batch 1 x 512): the plan's peak per process against
  `FSDPMemTracker` on the same fake step (tests/plan/fsdp_reference.py), at 4, 8 and 64 processes;
- ZeRO-2 and ZeRO-3 (bf16, batch 1 x 512, each offload setting DeepSpeed's `..._all_cold` prints):
  the plan's model states against the installed `estimate_zero2_model_states_mem_needs` /
  `estimate_zero3_model_states_mem_needs`, term by term (tests/plan/zero_reference.py; their 1.5
  buffer factor applies to the CPU figure only).

Each plan's wall and CPU seconds are printed, and its CPU time as a ratio to that of the
one-process plan of the same model and batch (timed first): the load of a shared machine cancels
out of the ratio much more than out of the seconds.

    python benchmarks/engine_references.py [WORLD ...]
"""

from __future__ import annotations

import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "plan"))

import torch  # noqa: E402

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402
from trainer_memcb.plan.optimizers.whatif import build_meta_model  # noqa: E402

MODEL = os.path.join(ROOT, "examples", "models", "llama-2-7b")


def build():
    return build_meta_model(MODEL, dtype=torch.bfloat16)


def timed(function):
    """The value, and the wall and CPU seconds it took."""
    start, cpu = time.perf_counter(), time.process_time()
    value = function()
    return value, (time.perf_counter() - start, time.process_time() - cpu)


def seconds(spent, base_cpu: float) -> str:
    wall, cpu = spent
    return f"{wall:7.1f} {cpu:7.1f} {cpu / base_cpu:6.2f}"


def main() -> None:
    stages = [int(a[1:]) for a in sys.argv[1:] if a.startswith("z")] or [2, 3]
    worlds = [int(w) for w in sys.argv[1:] if not w.startswith(("z", "-"))] or [4, 8, 64]
    fsdp = "--no-fsdp" not in sys.argv
    from fsdp_reference import fsdp_memtracker_peak

    settings = resolve_settings(batch_size=1, precision="bf16", optimizer="adamw_torch")
    (plan, _), (wall, base_cpu) = timed(lambda: plan_step_memory(build, seq_len=512, settings=settings,
                                                                 device_type="cpu", model_states=False))
    print(f"one process, bf16, batch 1 x 512: peak {plan.step.peak_bytes:,}, {wall:.1f} s wall, {base_cpu:.1f} s CPU (ratio 1)")
    print(f"{'engine':14} {'W':>3} {'plan peak':>16} {'reference':>16} {'diff':>6} {'wall s':>7} {'cpu s':>7} {'ratio':>6}  parts")
    for world in worlds if fsdp else []:
        settings = resolve_settings(world_size=world, sharding="fsdp-full-shard", precision="bf16", batch_size=1,
                                    optimizer="adamw_torch")
        (plan, _), spent = timed(lambda: plan_step_memory(build, seq_len=512, settings=settings, device_type="cpu",
                                                          model_states=False))
        tracker = fsdp_memtracker_peak(build, settings, 1, 512, torch.bfloat16)
        print(f"{'fsdp2':14} {world:3} {plan.step.peak_bytes:16,} {tracker['Total']:16,} {plan.step.peak_bytes - tracker['Total']:6} "
              f"{seconds(spent, base_cpu)}  {plan.step.peak_parts}")
        print(f"{'':14} {'':3} tracker: {tracker}")
    from zero_reference import ZERO_ROWS, plan_figures, plan_row

    for world in worlds:
        for label, stage, offload_optimizer, offload_param in ZERO_ROWS:
            if stage not in stages:
                continue
            row, spent = timed(lambda: plan_row(build, label, stage, offload_optimizer, offload_param, world))
            ds, ours = row["deepspeed"], plan_figures(row)
            print(f"{label:14} {world:3} {row['plan'].peak_bytes:16,} {ds.gpu_bytes:16,} {'':6} {seconds(spent, base_cpu)}  "
                  f"model states: most on the device {ours.device_bytes:,}, at the optimizer step "
                  f"{ours.at_optimizer_step_bytes:,}, host per node {ours.host_bytes_per_node:,} (DeepSpeed CPU per node "
                  f"{ds.cpu_bytes_per_node:,}); plan terms {ours.device_terms}, DeepSpeed's {ds.gpu_terms}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
