"""The device options of `trainer-memcb estimate` as the plans read them: the reserve, the CUDA
context and the allocator config (`--reserve`, `--gpu`, `--device-type`, `--alloc-conf`), and the
memory they leave of `--device-memory`, shared by the step plan and the evaluation plan.
"""

from __future__ import annotations

from typing import Any, Optional

from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.utils.units import format_bytes

__all__ = ["DEFAULT_RESERVE_BYTES", "DEFAULT_RESERVE_TEXT", "DEFAULT_DEVICE_TYPE", "reserve_bytes",
           "cuda_context_bytes", "usable_memory", "alloc_conf_of"]

# What --reserve takes when it is not given: nothing. On CUDA the plan models what the process holds
# beside its tensors: the caching allocator's blocks and cache (the step's allocations replayed over
# two steps), the cuBLAS workspaces and the CUDA context (the GPU preset's, else 426 MiB). --reserve
# is the user's own margin for what is not modelled: NCCL's buffers with several processes,
# the workspace of cuDNN's attention engine, another program on the card, and the run-to-run
# spread of the allocator's cache (published runs of one setting differ by up to 4% in nvidia-smi).
DEFAULT_RESERVE_BYTES = {"cuda": 0, "cpu": 0}
DEFAULT_RESERVE_TEXT = "0B"
# --device-type's default: the step plans for a CUDA device.
DEFAULT_DEVICE_TYPE = "cuda"


def reserve_bytes(args: EstimateRequest) -> Optional[int]:
    """The reserve taken from --device-memory (None without --device-memory)."""
    if args.device_memory is None:
        return None
    if args.reserve is not None:
        return args.reserve
    return DEFAULT_RESERVE_BYTES[args.device_type or DEFAULT_DEVICE_TYPE]


def cuda_context_bytes(args: EstimateRequest) -> int:
    """The CUDA context the process holds outside the allocator: --gpu's preset's, else the default
    (`trainer_memcb.plan.device.gpus.DEFAULT_CUDA_CONTEXT_BYTES`); 0 with --device-type cpu."""
    from trainer_memcb.plan.device.gpus import DEFAULT_CUDA_CONTEXT_BYTES, gpu_preset

    if (getattr(args, "device_type", None) or DEFAULT_DEVICE_TYPE) != "cuda":
        return 0
    gpu = getattr(args, "gpu", None)
    return gpu_preset(gpu).cuda_context_bytes if gpu is not None else DEFAULT_CUDA_CONTEXT_BYTES


def alloc_conf_of(args: EstimateRequest) -> Any:
    """--alloc-conf, else `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`) from the environment.

    Raises:
        ValueError: the environment's setting does not parse (naming the variable and the fault).
    """
    from trainer_memcb.plan.device.alloc_conf import alloc_conf_from_environment

    if getattr(args, "alloc_conf", None) is not None:
        return args.alloc_conf
    try:
        return alloc_conf_from_environment()
    except ValueError as error:
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF in the environment: {error}") from None


def usable_memory(args: EstimateRequest) -> Optional[int]:
    """--device-memory less the CUDA context and the reserve: what the model states' fits? is
    answered against and the largest batch searched in (None without --device-memory).

    Raises:
        ValueError: a reserve as large as the memory.
    """
    reserve = reserve_bytes(args)
    if reserve is None:
        return None
    reserve += cuda_context_bytes(args)
    if reserve >= args.device_memory:
        given = (f"--reserve {format_bytes(args.reserve)} with the CUDA context" if args.reserve is not None else
                 f"the CUDA context of {format_bytes(reserve)}")
        raise ValueError(f"{given} leaves nothing of --device-memory {format_bytes(args.device_memory)}: "
                         "give a smaller --reserve (0B for none)")
    return args.device_memory - reserve
