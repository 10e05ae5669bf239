"""Figures across processes: the fullest process's, and the sum over all of them.

Under torchrun or accelerate every process holds its own optimizer state: a full replica under
DDP, a shard under FSDP2 or DeepSpeed ZeRO. What runs out of memory first is the fullest process,
and what the job holds is the sum. `reduce_across_processes` turns each process's own figures into
both, with two all-reduces of a few int64 values (one SUM, one MAX: two operations rather than a
negation trick, which could give the maximum but never the sum). Nothing is exchanged when
`torch.distributed` is not initialized or the world has one process.

Every process must call it at the same points, in the same order, or the job hangs. A process that
lacks a figure (its measurement failed) still takes part, with a "present" count of 0 for it; the
figure is then left out on every process, never reported from the processes that had it.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from trainer_memcb.training.figures import (
    ACTIVATION_KEYS,
    BREAKDOWN_KEY_PREFIXES,
    ESTIMATE_BYTES,
    ESTIMATE_TOTAL_BYTES,
    MASTER_WEIGHTS_BYTES,
    MEASURED_BYTES,
    MEASURED_ELEMENTS,
    MEASURED_TOTAL_BYTES,
    MODEL_GRADS_BYTES,
    MODEL_PARAMS_BYTES,
    MODEL_STATES_BYTES,
    MODEL_STATES_ESTIMATE_BYTES,
    MODEL_STATES_ESTIMATE_TOTAL_BYTES,
    MODEL_STATES_TOTAL_BYTES,
    TRAINABLE_PARAMS,
    REFERENCE_MODEL_PARAMS_BYTES,
    UNEXPECTED_BYTES,
)

__all__ = [
    "PER_PROCESS_KEYS",
    "TOTAL_KEYS",
    "collective_device",
    "reduce_across_processes",
    "world_size",
]

# Figures that describe what one process holds: across processes, the largest is logged.
PER_PROCESS_KEYS = (MEASURED_BYTES, MEASURED_ELEMENTS, ESTIMATE_BYTES, TRAINABLE_PARAMS, MASTER_WEIGHTS_BYTES,
                    MODEL_PARAMS_BYTES, MODEL_GRADS_BYTES, MODEL_STATES_BYTES, MODEL_STATES_ESTIMATE_BYTES,
                    REFERENCE_MODEL_PARAMS_BYTES, *ACTIVATION_KEYS)
# Per-process figure -> the key of its sum over all processes.
TOTAL_KEYS = {MEASURED_BYTES: MEASURED_TOTAL_BYTES, ESTIMATE_BYTES: ESTIMATE_TOTAL_BYTES,
              MODEL_STATES_BYTES: MODEL_STATES_TOTAL_BYTES, MODEL_STATES_ESTIMATE_BYTES: MODEL_STATES_ESTIMATE_TOTAL_BYTES}

# Backends that reduce only accelerator tensors, and the device type each needs. Every other
# backend (gloo, mpi, Intel's ccl, and a "cpu:gloo,cuda:nccl" pair) reduces CPU tensors, which keeps
# the exchange off the accelerator's queue.
_ACCELERATOR_ONLY_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}

# Whether this torch was built with `torch.distributed`: fixed for the process, and asked at every
# logged step.
_DISTRIBUTED_BUILT = dist.is_available()
# Breakdown keys (`optimizer_state_bytes_by_key/...`) start with one of these.
_BREAKDOWN_PREFIXES = tuple(BREAKDOWN_KEY_PREFIXES.values())


def world_size() -> int:
    """Processes in the default group; 1 when `torch.distributed` is absent or not initialized."""
    if not _DISTRIBUTED_BUILT or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def collective_device() -> torch.device:
    """Where the tensors of the exchange must live for the default group's backend.

    gloo: the CPU; nccl: this process's current CUDA device (set by torchrun-aware launchers such
    as accelerate and DeepSpeed before training starts).
    """
    device_type = _ACCELERATOR_ONLY_BACKENDS.get(str(dist.get_backend()).lower())
    if device_type is None:
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())


def _as_int(value: object) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _with_totals(figures: Mapping[str, int], per_process: Mapping[str, int], totals: Mapping[str, int]) -> Dict[str, int]:
    """The figures in their own order, each per-process key followed by its total."""
    result: Dict[str, int] = {}
    for key, value in figures.items():
        if key in PER_PROCESS_KEYS:
            if key in per_process:
                result[key] = per_process[key]
                if key in TOTAL_KEYS:
                    result[TOTAL_KEYS[key]] = totals[key]
        elif key.startswith(_BREAKDOWN_PREFIXES):
            if MEASURED_BYTES in per_process:  # a breakdown only beside the figure it breaks down
                result[key] = value
        elif key == UNEXPECTED_BYTES:
            if MEASURED_BYTES in per_process and ESTIMATE_BYTES in per_process:  # a difference of two figures logged
                result[key] = value
        else:
            result[key] = value
    return result


def reduce_across_processes(figures: Mapping[str, int]) -> Dict[str, int]:
    """This process's figures -> the job's: the largest over processes, plus the sums.

    Every process of the default group must call this at the same point. With one process (or no
    `torch.distributed`) nothing is exchanged and the figures come back as they are, without totals.

    Args:
        figures: this process's figures, as `optimizer_figures` makes them (breakdowns included).

    Returns:
        The same keys, per-process ones now the largest over processes, plus (with more than one
        process) `optimizer_state_total_bytes` and `optimizer_state_estimate_total_bytes`, the sums. A
        figure that any process lacks is left out (with its total and breakdowns). Breakdown keys
        (`optimizer_state_bytes_by_key/...`) stay this process's own.

    Examples:
        >>> from trainer_memcb.training.distributed import reduce_across_processes
        >>> reduce_across_processes({"optimizer_state_bytes": 88, "optimizer_state_estimate_bytes": 88})
        {'optimizer_state_bytes': 88, 'optimizer_state_estimate_bytes': 88}
    """
    processes = world_size()
    if processes == 1:
        # Nothing to exchange, and no totals: with one process each would only repeat its
        # per-process figure (a second, identical TensorBoard card).
        return dict(figures)

    local = {key: _as_int(figures.get(key)) for key in PER_PROCESS_KEYS}
    values: List[int] = [value or 0 for value in local.values()]
    present_flags = [int(value is not None) for value in local.values()]
    device = collective_device()
    # SUM over [present flags..., values...] gives how many processes have each figure and the
    # totals; MAX over [values...] gives the fullest process. A missing figure adds 0 to both.
    counts_and_sums = torch.tensor(present_flags + values, dtype=torch.int64, device=device)
    maxima = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(counts_and_sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    # The one host read of the exchange, once per logged step (a device sync under nccl).
    counts_and_sums_list, maxima_list = counts_and_sums.tolist(), maxima.tolist()

    num_keys = len(PER_PROCESS_KEYS)
    per_process: Dict[str, int] = {}
    totals: Dict[str, int] = {}
    for index, key in enumerate(PER_PROCESS_KEYS):
        if counts_and_sums_list[index] == processes:
            per_process[key] = maxima_list[index]
            totals[key] = counts_and_sums_list[num_keys + index]
    return _with_totals(figures, per_process, totals)
