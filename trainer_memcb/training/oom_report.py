"""A short report of a CUDA out-of-memory error in a run, written to the run's `output_dir`.

When `Trainer.train` leaves with `torch.OutOfMemoryError` (`torch.cuda.OutOfMemoryError` is the
same class), the callback writes `out_of_memory_report.txt` (with several processes, each
process that failed its own, `out_of_memory_report-rank<N>.txt`) and lets the error propagate,
the same object, unchanged. The report says:

- where: the optimizer steps done before the error, and the error's first line;
- what the step plan of the run's own settings holds at its peak, by part
  (`trainer_memcb.training.step_plan_probe`; when no plan was made, why);
- the caching allocator's state on the model's CUDA device, read now, in the failure path only:
  reserved and allocated bytes and their difference, the segments (small and large pool), the
  largest free block and the inactive split bytes. From `torch.cuda.memory_stats` (its
  `reserved_bytes.all.current`, `allocated_bytes.all.current`, `segment.{small,large}_pool.current`,
  `inactive_split_bytes.all.current`) and `torch.cuda.memory_snapshot` (its segments' blocks in
  state `inactive`: the largest is the largest request that fits without a new segment). A large
  "reserved minus allocated" with a small largest free block is fragmentation: torch's own advice
  for it is `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.

Exact bytes, with 1024-based units beside them (`trainer_memcb.utils.units.format_bytes`). Written
atomically, never through a symbolic link (`trainer_memcb.utils.safe_io.atomic_write`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

from trainer_memcb.utils.safe_io import atomic_write
from trainer_memcb.utils.units import format_bytes

__all__ = ["OOM_REPORT_FILE_NAME", "OUT_OF_MEMORY_ERRORS", "allocator_state", "cuda_device_of", "oom_report_path",
           "oom_report_text", "write_oom_report"]

OOM_REPORT_FILE_NAME = "out_of_memory_report.txt"
# torch.OutOfMemoryError (torch 2.5 and newer) is torch.cuda.OutOfMemoryError.
OUT_OF_MEMORY_ERRORS = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
                              torch.cuda.OutOfMemoryError})
_PLAN_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "batch_and_buffers", "other",
               "reference_model")


def cuda_device_of(model: Any) -> Optional[torch.device]:
    """The CUDA device the error is about: the model's, when its parameters are on CUDA; else, with
    CUDA available, the current CUDA device; else None (no allocator to read)."""
    for param in getattr(model, "parameters", lambda: iter(()))():
        if param.device.type == "cuda":
            return param.device if param.device.index is not None else torch.device("cuda", torch.cuda.current_device())
        break
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _snapshot() -> List[Dict[str, Any]]:
    try:
        return torch.cuda.memory_snapshot(include_traces=False)  # no stack traces: light
    except TypeError:  # torch before 2.9 takes no include_traces
        return torch.cuda.memory_snapshot()


def allocator_state(device: torch.device) -> Dict[str, int]:
    """The caching allocator's state on `device`, read now (failure path only: the snapshot walks
    every segment): bytes and counts, see the module docstring."""
    stats = torch.cuda.memory_stats(device)
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    free_blocks = [int(block.get("size", 0)) for segment in _snapshot()
                   if segment.get("device", device.index) == device.index
                   for block in segment.get("blocks", ()) if block.get("state") == "inactive"]
    return {
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "reserved_minus_allocated_bytes": reserved - allocated,
        "segments": int(stats.get("segment.all.current", 0)),
        "small_pool_segments": int(stats.get("segment.small_pool.current", 0)),
        "large_pool_segments": int(stats.get("segment.large_pool.current", 0)),
        "largest_free_block_bytes": max(free_blocks, default=0),
        "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
    }


def _bytes(value: int) -> str:
    return f"{value} bytes ({format_bytes(value)})"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def oom_report_text(error: BaseException, steps_done: int, plan: Any = None, no_plan: str = "",
                    device: Optional[torch.device] = None, allocator: Optional[Dict[str, int]] = None,
                    no_allocator: str = "") -> str:
    """The report, as text (see the module docstring).

    Args:
        error: the out-of-memory error.
        steps_done: optimizer steps done before it (`trainer.state.global_step`).
        plan: the step plan (`StepMemoryPlan`), or None; then `no_plan` says why.
        device, allocator: the CUDA device and `allocator_state(device)`, or None; then
            `no_allocator` says why.

    Examples:
        >>> print(oom_report_text(RuntimeError("out of memory"), 3, no_plan="not made", no_allocator="no CUDA"))
        Out of memory in Trainer.train after 3 optimizer steps
        error: RuntimeError: out of memory
        <BLANKLINE>
        The step plan for this run's settings: not made
        <BLANKLINE>
        The caching allocator: not read (no CUDA)
        <BLANKLINE>
    """
    lines = [f"Out of memory in Trainer.train after {steps_done} optimizer step{'s' if steps_done != 1 else ''}",
             f"error: {_first_line(error)}", ""]
    if plan is None:
        lines.append(f"The step plan for this run's settings: {no_plan}")
    else:
        batch = f"{plan.settings.batch_size} x {plan.settings.seq_len}" if plan.settings.seq_len is not None else f"{plan.settings.batch_size}"
        lines.append(f"The step plan for this run's settings (batch {batch}, "
                     f"{plan.settings.optimizer}, {plan.settings.precision}, engine {plan.settings.engine}, on {plan.settings.device_type}) "
                     f"peaks in {plan.step.peak_phase} at {_bytes(plan.step.peak_bytes)}, holding:")
        parts = dict(plan.step.peak_parts)
        for part in [*_PLAN_PARTS, *sorted(set(parts) - set(_PLAN_PARTS))]:
            if part in parts:
                lines.append(f"  {part.replace('_', ' ')}: {_bytes(int(parts[part]))}")
    lines.append("")
    if allocator is None:
        lines.append(f"The caching allocator: not read ({no_allocator})")
    else:
        lines += [f"The caching allocator on {device}, when the error reached Trainer.train:",
                  f"  reserved: {_bytes(allocator['reserved_bytes'])}",
                  f"  allocated: {_bytes(allocator['allocated_bytes'])}",
                  f"  reserved minus allocated: {_bytes(allocator['reserved_minus_allocated_bytes'])}",
                  f"  segments: {allocator['segments']} ({allocator['small_pool_segments']} in the small pool, "
                  f"{allocator['large_pool_segments']} in the large pool)",
                  f"  largest free block: {_bytes(allocator['largest_free_block_bytes'])}",
                  f"  inactive split blocks: {_bytes(allocator['inactive_split_bytes'])}"]
    lines.append("")
    return "\n".join(lines)


def oom_report_path(output_dir: str, rank: int = 0, world_size: int = 1) -> str:
    """`<output_dir>/out_of_memory_report.txt`, or `...-rank<N>.txt` with several processes."""
    if world_size > 1:
        stem, suffix = os.path.splitext(OOM_REPORT_FILE_NAME)
        return os.path.join(output_dir, f"{stem}-rank{rank}{suffix}")
    return os.path.join(output_dir, OOM_REPORT_FILE_NAME)


def write_oom_report(path: str, text: str) -> None:
    """Write the report atomically (its folder made if missing); never through a symbolic link."""
    payload = text.encode("utf-8")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda handle: handle.write(payload))
