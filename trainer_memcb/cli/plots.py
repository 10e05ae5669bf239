"""Plots for `report` and `compare`: PNG, PDF or SVG. matplotlib is optional (`pip install 'trainer_memcb[plot]'`).

Figures are drawn with matplotlib's object API on an Agg canvas: no pyplot, no global backend
switch, nothing left open in the caller's process. Text from a run folder (run names, class
names) is drawn as written: matplotlib's mathtext, which reads `$...$` as math, is off for every
text. The file is written whole or not at all, and never through a symbolic link
(`trainer_memcb.utils.safe_io.atomic_write`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence, Tuple

from trainer_memcb.cli.compare import CompareRow
from trainer_memcb.cli.report import RunReport
from trainer_memcb.utils.safe_io import UnsafeFileError, atomic_write
from trainer_memcb.utils.units import GiB, KiB, MiB

__all__ = [
    "PLOT_SIZE_INCHES", "PLOT_DPI", "PLOT_FORMATS", "PlotError", "plot_format",
    "report_figure", "report_plot", "compare_figure", "compare_plot",
]

# 9 x 5 inches at 100 dots per inch: a 900 x 500 pixel PNG.
PLOT_SIZE_INCHES = (9.0, 5.0)
PLOT_DPI = 100
# Memory in the first two colors, metrics in others, so that a metric never looks like a state.
_STATE_COLORS = ("tab:blue", "tab:orange")
_METRIC_COLORS = ("tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
# Formats the Agg canvas writes with no other program (pgf would need LaTeX), by file extension.
PLOT_FORMATS = ("png", "pdf", "svg")


class PlotError(Exception):
    """A plot that cannot be drawn (matplotlib missing, a file that cannot be written)."""


def plot_format(path: str) -> str:
    """The format a plot path asks for, from its extension (any case); no extension means PNG.

    Raises:
        ValueError: another extension.

    Examples:
        >>> plot_format("runs/adamw.SVG"), plot_format("plot")
        ('svg', 'png')
    """
    extension = os.path.splitext(path)[1]
    if not extension:
        return "png"
    if extension.lower().lstrip(".") not in PLOT_FORMATS:
        raise ValueError(f"--plot {path}: the extension must be .png, .pdf or .svg (none means .png)")
    return extension.lower().lstrip(".")


def _figure() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("plots need matplotlib: pip install 'trainer_memcb[plot]'") from None
    figure = Figure(figsize=PLOT_SIZE_INCHES, dpi=PLOT_DPI)
    FigureCanvasAgg(figure)
    return figure


def _unit(largest: int) -> Tuple[str, int]:
    """The binary unit that reads best for values up to `largest` bytes."""
    for name, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if largest >= size:
            return name, size
    return "bytes", 1


def _short_class(path: Optional[str]) -> str:
    """`"bitsandbytes.optim.adamw.AdamW"` -> `"bitsandbytes AdamW"`: short enough for a tick label."""
    if not path:
        return ""
    library, _, name = path.rpartition(".")
    return f"{library.split('.')[0]} {name}" if library else name


def _legend_below(figure: Any, axes: Any, handles: list, labels: list) -> None:
    # Under the axes, where it hides no point of either y axis.
    if handles:
        figure.subplots_adjust(bottom=0.27)
        axes.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(len(handles), 4),
                    frameon=False)


def _as_written(figure: Any) -> None:
    """Every text of the figure drawn as written, `$` included: no mathtext."""
    for text in figure.findobj(lambda artist: hasattr(artist, "set_parse_math")):
        text.set_parse_math(False)


def _save(figure: Any, path: str) -> None:
    try:
        kind = plot_format(path)
    except ValueError as error:
        raise PlotError(str(error)) from None
    try:
        # No bbox_inches="tight": the image keeps the size PLOT_SIZE_INCHES x PLOT_DPI says.
        atomic_write(path, lambda handle: figure.savefig(handle, format=kind, dpi=PLOT_DPI))
    except UnsafeFileError as error:
        raise PlotError(str(error)) from None
    except OSError as error:
        raise PlotError(f"could not write the plot to {path} ({error.strerror or error})") from None


def _metric_axis(metric_axes: Any, values: Sequence[float]) -> None:
    """Metrics between 0 and 1 (accuracy, F1) on a fixed 0-1 scale, others (a loss) on their own."""
    metric_axes.set_ylabel("eval metric")
    finite = [value for value in values if math.isfinite(value)]
    if finite and all(0 <= value <= 1 for value in finite):
        metric_axes.set_ylim(0, 1.05)


def report_plot(report: RunReport, path: str, metrics: Sequence[str]) -> None:
    """Optimizer state (measured and estimate) over the steps; eval metrics on a second axis.
    The format follows the extension of `path` (`plot_format`)."""
    _save(report_figure(report, metrics), path)


def report_figure(report: RunReport, metrics: Sequence[str]) -> Any:
    """The figure `report_plot` writes: a matplotlib `Figure` on an Agg canvas."""
    figure = _figure()
    axes = figure.add_subplot(1, 1, 1)
    known = [v for s in report.steps for v in (s.measured_bytes, s.estimate_bytes) if v is not None]
    unit, size = _unit(max(known, default=0))
    for (label, attribute, style), color in zip(
        (("measured", "measured_bytes", "-o"), ("estimate", "estimate_bytes", "--")), _STATE_COLORS
    ):
        points = [(s.step, getattr(s, attribute) / size) for s in report.steps if getattr(s, attribute) is not None]
        if points:
            axes.plot(*zip(*points), style, color=color, label=f"state {label}")
    axes.set_xlabel("step")
    axes.set_ylabel(f"optimizer state ({unit})")
    axes.set_ylim(bottom=0)
    handles, labels = axes.get_legend_handles_labels()
    series = {metric: [(e.step, e.metrics[metric]) for e in report.evals if metric in e.metrics] for metric in metrics}
    series = {metric: points for metric, points in series.items() if points}
    if series:  # a second axis only for metrics the run logged
        metric_axes = axes.twinx()
        for (metric, points), color in zip(series.items(), _METRIC_COLORS * len(series)):
            metric_axes.plot(*zip(*points), ":s", color=color, label=f"eval {metric}")
        _metric_axis(metric_axes, [value for points in series.values() for _, value in points])
        more_handles, more_labels = metric_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    _legend_below(figure, axes, handles, labels)
    axes.set_title(f"{report.name}: {report.optimizer_class or 'optimizer'} state")
    _as_written(figure)
    return figure


def compare_plot(rows: Sequence[CompareRow], path: str, metrics: Sequence[str]) -> None:
    """Bars of each run's measured and estimated state; final eval metrics on a second axis."""
    _save(compare_figure(rows, metrics), path)


def compare_figure(rows: Sequence[CompareRow], metrics: Sequence[str]) -> Any:
    """The figure `compare_plot` writes."""
    figure = _figure()
    axes = figure.add_subplot(1, 1, 1)
    known = [v for row in rows for v in (row.measured_bytes, row.estimate_bytes) if v is not None]
    unit, size = _unit(max(known, default=0))
    positions = list(range(len(rows)))
    width = 0.38
    axes.bar([p - width / 2 for p in positions], [(row.measured_bytes or 0) / size for row in rows], width,
             color=_STATE_COLORS[0], label="state measured")
    axes.bar([p + width / 2 for p in positions], [(row.estimate_bytes or 0) / size for row in rows], width,
             color=_STATE_COLORS[1], label="state estimate")
    axes.set_xticks(positions)
    axes.set_xticklabels([f"{row.name}\n{_short_class(row.optimizer_class)}" for row in rows])
    axes.set_ylabel(f"optimizer state ({unit})")
    handles, labels = axes.get_legend_handles_labels()
    series = {metric: [(p, row.final_metrics[metric]) for p, row in zip(positions, rows) if metric in row.final_metrics]
              for metric in metrics}
    series = {metric: points for metric, points in series.items() if points}
    if series:  # a second axis only for metrics the runs logged
        metric_axes = axes.twinx()
        for (metric, points), color in zip(series.items(), _METRIC_COLORS * len(series)):
            metric_axes.plot(*zip(*points), "D", color=color, markersize=8, label=f"final eval {metric}")
        _metric_axis(metric_axes, [value for points in series.values() for _, value in points])
        more_handles, more_labels = metric_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    _legend_below(figure, axes, handles, labels)
    axes.set_title("Optimizer state by run")
    _as_written(figure)
    return figure
