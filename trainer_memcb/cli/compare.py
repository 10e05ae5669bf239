"""`trainer-memcb compare RUN_DIR...`: one row per run, sorted by the memory its optimizer held.

`compare_runs` computes the rows from the runs' own logs; `compare_table` only formats them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell, metric_cell
from trainer_memcb.cli.report import DEFAULT_METRICS, run_report
from trainer_memcb.runs.run_logs import RunLog

__all__ = ["CompareRow", "compare_runs", "compare_table"]


@dataclass
class CompareRow:
    """One run: its optimizer, its state measured and estimated, its last evaluation."""

    name: str
    run_dir: str
    optimizer_class: Optional[str]
    trainable_params: Optional[int]
    measured_bytes: Optional[int]
    estimate_bytes: Optional[int]
    final_metrics: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _memory_order(row: CompareRow) -> tuple:
    # Runs without a measurement go last, ordered by their estimate.
    measured, estimate = row.measured_bytes, row.estimate_bytes
    return (measured is None, measured if measured is not None else 0, estimate is None, estimate or 0, row.name)


def compare_runs(runs: Sequence[RunLog], metrics: Sequence[str] = DEFAULT_METRICS) -> List[CompareRow]:
    """One row per run, the smallest measured state first."""
    rows = []
    for run in runs:
        report = run_report(run, metrics)
        rows.append(CompareRow(
            name=report.name,
            run_dir=report.run_dir,
            optimizer_class=report.optimizer_class,
            trainable_params=report.trainable_params,
            measured_bytes=report.measured_bytes,
            estimate_bytes=report.estimate_bytes,
            final_metrics=report.final_metrics,
        ))
    return sorted(rows, key=_memory_order)


def compare_table(rows: Sequence[CompareRow], metrics: Sequence[str] = DEFAULT_METRICS) -> TextTable:
    return TextTable(
        "Runs by optimizer state memory",
        ["run", "optimizer", "trainable params", "state measured", "state estimate", *(f"final {m}" for m in metrics)],
        [[row.name, row.optimizer_class or "-", count_cell(row.trainable_params), bytes_cell(row.measured_bytes),
          bytes_cell(row.estimate_bytes), *(metric_cell(row.final_metrics.get(m)) for m in metrics)]
         for row in rows],
        text_columns=(0, 1),
    )
