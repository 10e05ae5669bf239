"""The end-of-training summary: a table for people, a JSON document with the exact bytes."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from trainer_memcb.state.estimate import StateEstimate
from trainer_memcb.state.judge import StateJudgement
from trainer_memcb.state.measure import StateMeasurement
from trainer_memcb.utils.safe_io import atomic_write
from trainer_memcb.utils.units import format_bytes

__all__ = ["SUMMARY_FILE_NAME", "summary_document", "summary_text", "write_summary"]

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


def summary_text(measurement: Optional[StateMeasurement], estimate: Optional[StateEstimate],
                 judgement: Optional[StateJudgement] = None) -> str:
    """A few lines for the logger: totals, then bytes by state key and by dtype, in MiB/GiB, and
    the judgement of measured against estimate when there is one."""
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
    return "\n".join(lines)


def write_summary(document: Dict[str, Any], path: str) -> None:
    """Write the document atomically, so that a reader never sees half a file; a failure leaves
    no file behind, and a `path` that is a symbolic link is refused (`UnsafeFileError`)."""
    # Serialised first: a document that cannot be written as JSON fails before any file exists.
    payload = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda handle: handle.write(payload))
