"""The end-of-training summary: a table for people, a JSON document with the exact bytes."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from trainer_memcb.state.estimate import StateEstimate
from trainer_memcb.state.judge import StateJudgement
from trainer_memcb.state.measure import StateMeasurement
from trainer_memcb.training.figures import ACTIVATION_KEYS, step_memory_rows
from trainer_memcb.utils.safe_io import atomic_write
from trainer_memcb.utils.units import format_bytes

__all__ = ["SUMMARY_FILE_NAME", "step_memory_figures", "step_memory_text", "summary_document", "summary_text",
           "write_summary"]

SUMMARY_FILE_NAME = "optimizer_memory.json"
SUMMARY_FORMAT_VERSION = 1


def summary_document(
    measurement: Optional[StateMeasurement],
    estimate: Optional[StateEstimate],
    optimizer_class: str,
    global_step: int,
    extra: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """A JSON-ready dict: exact bytes, breakdowns, and which optimizer they describe."""
    document: Dict[str, Any] = {
        "format_version": SUMMARY_FORMAT_VERSION,
        "optimizer_class": optimizer_class,
        "global_step": global_step,
        "measured": measurement.to_dict() if measurement is not None else None,
        "estimate": estimate.to_dict() if estimate is not None else None,
    }
    if measurement is not None and estimate is not None:
        document["measured_minus_estimate_bytes"] = measurement.num_bytes - estimate.num_bytes
    document.update(extra or {})
    return document


def _rows(title: str, measured: Dict[str, int], estimated: Dict[str, int]) -> List[str]:
    lines = [f"  {title:<24} {'measured':>14} {'estimate':>14}"]
    for name in sorted(set(measured) | set(estimated)):
        got = format_bytes(measured[name]) if name in measured else "-"
        want = format_bytes(estimated[name]) if name in estimated else "-"
        lines.append(f"  {name:<24} {got:>14} {want:>14}")
    return lines


def step_memory_figures(document: Mapping[str, Any]) -> Tuple[Dict[str, Any], Optional[int]]:
    """The step's memory at the end of a run, from a summary document: its final figures, with the
    last logged step's activations over them; and that step (None without activations).

    Examples:
        >>> step_memory_figures({"final_figures": {"model_params_bytes": 40},
        ...                      "activations": {"step": 3, "activations_bytes": 64}})
        ({'model_params_bytes': 40, 'activations_bytes': 64}, 3)
    """
    final = document.get("final_figures")
    figures: Dict[str, Any] = dict(final) if isinstance(final, dict) else {}
    activations = document.get("activations")
    step = None
    if isinstance(activations, dict):
        figures.update({key: value for key, value in activations.items() if key in ACTIVATION_KEYS})
        step = activations.get("step") if isinstance(activations.get("step"), int) else None
    return figures, step


def step_memory_text(figures: Mapping[str, Any], activations_step: Optional[int] = None) -> List[str]:
    """Lines for the step's memory by part, measured and planned, in MiB/GiB; none when nothing is known.

    Examples:
        >>> for line in step_memory_text({"model_params_bytes": 40, "activations_bytes": 64}, 3):
        ...     print(line)
        Step memory by part (per process; activations of step 3, its last micro-batch)
          part                           measured        planned
          parameters                         40 B              -
          activations                        64 B              -
    """
    rows = step_memory_rows(figures)
    if not rows:
        return []
    when = f"; activations of step {activations_step}, its last micro-batch" if activations_step is not None else ""
    lines = [f"Step memory by part (per process{when})", f"  {'part':<24} {'measured':>14} {'planned':>14}"]
    for part, measured, planned in rows:
        got = format_bytes(measured) if measured is not None else "-"
        want = format_bytes(planned) if planned is not None else "-"
        lines.append(f"  {part:<24} {got:>14} {want:>14}")
    return lines


def summary_text(measurement: Optional[StateMeasurement], estimate: Optional[StateEstimate],
                 judgement: Optional[StateJudgement] = None, step_memory: Optional[Mapping[str, Any]] = None,
                 activations_step: Optional[int] = None) -> str:
    """A few lines for the logger: totals, then bytes by state key and by dtype, in MiB/GiB, the
    judgement of measured against estimate when there is one, and the step's memory by part
    (`step_memory`: unprefixed figures; see `step_memory_figures`)."""
    measured_total = format_bytes(measurement.num_bytes) if measurement is not None else "not measured"
    estimate_total = format_bytes(estimate.num_bytes) if estimate is not None else "no rule"
    lines = [f"Optimizer state: measured {measured_total}, estimate {estimate_total}"]
    if measurement is not None:
        lines.append(
            f"  {measurement.num_bytes:,} bytes in {measurement.num_elements:,} values"
            f" over {measurement.num_params_with_state:,} parameter tensors"
        )
    if estimate is not None:
        lines.append(f"  estimate: {estimate.num_bytes:,} bytes for {estimate.num_params:,} trainable parameters")
    by_key = measurement.bytes_by_key if measurement is not None else {}
    lines += _rows("by state key", by_key, estimate.bytes_by_key if estimate is not None else {})
    if measurement is not None:
        lines += _rows("by dtype", measurement.bytes_by_dtype, {})
    if judgement is not None:
        lines.append(judgement.text())
    lines += step_memory_text(step_memory or {}, activations_step)
    return "\n".join(lines)


def write_summary(document: Dict[str, Any], path: str) -> None:
    """Write the document atomically, so that a reader never sees half a file; a failure leaves
    no file behind, and a `path` that is a symbolic link is refused (`UnsafeFileError`)."""
    # Serialised first: a document that cannot be written as JSON fails before any file exists.
    payload = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda handle: handle.write(payload))
