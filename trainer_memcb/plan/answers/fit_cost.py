"""Make it fit, the cost model: each proposal's step time relative to the user's own, read from
its traced step.

Its FLOPs as torch's FLOP counter counts them (`trainer_memcb.plan.step.flops`, inside the trace:
recomputation under checkpointing included), per micro-batch, times the number of micro-batches; a
fixed cost per micro-batch (`MICRO_BATCH_SECONDS`: the launches and Python of one forward and
backward); and the host transfers of offload at the host link's bandwidth (`HOST_BANDWIDTH`). The
optimizer step's own arithmetic (elementwise, no FLOPs in the counter's registry) and communication
are not counted.
"""

from __future__ import annotations

from typing import Any, Dict, Optional


__all__ = ["step_seconds", "offload_transfer_bytes", "FLOPS_PER_SECOND", "MICRO_BATCH_SECONDS",
           "HOST_BANDWIDTH"]

# Sustained dense FLOP/s of one process, by device type: what the step time is read against. CUDA:
# a third of an H100 SXM's 989 TFLOP/s dense bf16 (NVIDIA's H100 datasheet), the model FLOPs
# utilisation large-model training reaches (PaLM, Chowdhery et al. 2022, table 3: 46%; 30-40% is
# common in fine-tuning). CPU: one core's order of magnitude with AVX2 fp32 GEMMs.
FLOPS_PER_SECOND = {"cuda": 330e12, "cpu": 50e9}
# The fixed cost of one micro-batch (kernel launches, Python, the loss): what a smaller batch with
# more accumulation pays. CUDA: a few thousand kernel launches of ~5 us per forward and backward of a
# transformer; CPU: the Python and dispatch of a small model's forward and backward, measured here
# (benchmarks/fit_step_times.py).
MICRO_BATCH_SECONDS = {"cuda": 0.01, "cpu": 0.004}
# Host <-> device bytes per second for offload: PCIe 4.0 x16 as CUDA's bandwidthTest measures it
# with pinned memory (~25 GB/s of 32); 0 on the CPU (no transfer: the host is the device).
HOST_BANDWIDTH = {"cuda": 25e9, "cpu": None}

def step_seconds(flops: Optional[int], micro_batches: int, transfer: int, device_type: str) -> Optional[float]:
    """A step's estimated seconds: `micro_batches` of `flops` each, their fixed cost, and `transfer`
    bytes between host and device; None without FLOPs."""
    if flops is None:
        return None
    bandwidth = HOST_BANDWIDTH[device_type]
    return (micro_batches * (flops / FLOPS_PER_SECOND[device_type] + MICRO_BATCH_SECONDS[device_type])
            + (transfer / bandwidth if bandwidth else 0.0))


def offload_transfer_bytes(deepspeed: Optional[Dict[str, Any]], trainable_values: int, value_bytes: int,
                           world_size: int, device_type: str) -> int:
    """Host <-> device bytes per step of ZeRO-Offload: the process's partition of the gradients
    down and of the updated parameters up (stage_1_and_2.py / stage3.py with offload_optimizer)."""
    zero = (deepspeed or {}).get("zero_optimization") or {}
    if not ((zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")) or device_type == "cpu":
        return 0
    return 2 * trainable_values * value_bytes // world_size
