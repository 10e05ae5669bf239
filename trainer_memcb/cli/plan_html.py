"""`estimate --write-html FILE`: the planned step as one self-contained page.

The page draws `trainer_memcb.plan.answers.plan_snapshot.step_series(plan)`: the bytes alive over
the plan's two training steps, stacked by part, the allocator's reserved bytes as a line (CUDA
plans), the peak marked, and each phase labelled; below it, the plan's figures. Everything is in
the file (inline SVG drawn here, a few lines of inline script for the hover readout, the series as
JSON): it opens offline and fetches nothing.
"""

from __future__ import annotations

import html
import json
from typing import Any, List, Optional, Sequence, Tuple

from trainer_memcb.cli.output import bytes_cell
from trainer_memcb.utils.units import GiB, KiB, MiB, format_bytes

__all__ = ["plan_html", "PART_COLOURS"]

# One colour per part, in the order `step_series` lists them; an engine's own parts take the rest.
PART_COLOURS = {
    "parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer_state": "#59a14f", "activations": "#e15759",
    "batch_and_buffers": "#b07aa1", "other": "#bab0ac", "cuda_workspaces": "#9c755f",
}
_MORE_COLOURS = ("#76b7b2", "#edc948", "#ff9da7", "#86bcb6", "#d37295", "#a0cbe8", "#8cd17d")
_RESERVED_COLOUR = "#222222"
WIDTH, HEIGHT = 1100, 480  # the chart's drawing area, in SVG units
LEFT, TOP, BOTTOM = 90, 70, 40  # margins: the bytes axis, the phase labels, the events axis


def _colours(parts: Sequence[str]) -> List[str]:
    others = iter(_MORE_COLOURS * (len(parts) // len(_MORE_COLOURS) + 1))
    return [PART_COLOURS.get(part) or next(others) for part in parts]


def _tick_step(top: int) -> int:
    """A round step (1, 2 or 5 times a power of two unit: KiB, MiB, GiB) for about 5 ticks to `top`."""
    for unit in (KiB, MiB, GiB, 1024 * GiB):
        for times in (1, 2, 5, 10, 20, 50, 100, 200, 500):
            if top / (unit * times) <= 6:
                return unit * times
    return max(1, top // 5)


class _Axes:
    """The chart's scales: an event's x and a byte count's y, in SVG units."""

    def __init__(self, events: int, top: int) -> None:
        self.count, self.top = max(1, events - 1), top

    def x(self, index: int) -> float:
        return round(LEFT + WIDTH * index / self.count, 2)

    def y(self, nbytes: int) -> float:
        return round(TOP + HEIGHT * (1 - nbytes / self.top), 2)


def plan_html(plan: Any, series: Any, title: Optional[str] = None) -> str:
    """The page of `series` (`step_series(plan)`) for `plan` (a `StepMemoryPlan`)."""
    parts = list(series.parts)
    colours = _colours(parts)
    reserved_peak = series.reserved_peak_bytes
    axes = _Axes(series.events, int(max([series.peak.total, reserved_peak or 0, 1]) * 1.08))
    legend = "".join(
        f'<li class="legend-item" data-part="{html.escape(part)}"><span class="swatch" style="background:{colour}">'
        f'</span>{html.escape(part)}: {html.escape(bytes_cell(series.peak.parts[slot]))} at the peak</li>'
        for slot, (part, colour) in enumerate(zip(parts, colours)))
    if reserved_peak is not None:
        legend += (f'<li class="legend-item" data-part="reserved"><span class="swatch line" '
                   f'style="background:{_RESERVED_COLOUR}"></span>reserved (the caching allocator)</li>')
    figures = "".join(f"<tr><th>{html.escape(name)}</th><td>{html.escape(value)}</td></tr>"
                      for name, value in _figure_rows(plan, series))
    data = json.dumps({"parts": parts, "events": series.events,
                       "points": [[p.index, p.phase, list(p.parts), p.reserved] for p in series.points]})
    heading = title or f"Planned training step: {plan.settings.model}"
    what = ("bytes alive by part (as asked, before the allocator's rounding), the caching allocator's reserved "
            "bytes as a line, over two training steps (the second holds what the first left: the optimizer state)"
            if reserved_peak is not None else
            "bytes alive by part over two training steps (the second holds what the first left: the optimizer "
            "state); no caching allocator on this device type")
    return (_PAGE_HEAD.format(heading=html.escape(heading))
            + f"""<h1 id="title">{html.escape(heading)}</h1>
<p class="what">{html.escape(what)}.</p>
<ul class="legend">{legend}</ul>
{"".join(_svg(series, parts, colours, axes))}
<div id="readout">move over the chart to read the bytes at a moment</div>
<table class="figures">{figures}</table>
<script type="application/json" id="series-data">{html.escape(data, quote=False)}</script>
""" + _PAGE_SCRIPT.replace("{LEFT}", str(LEFT)).replace("{WIDTH}", str(WIDTH)))


def _svg(series: Any, parts: List[str], colours: List[str], axes: _Axes) -> List[str]:
    """The chart: the phases, the bytes axis, the parts stacked, the reserved line, the peaks marked."""
    x, y = axes.x, axes.y
    points, reserved_peak = list(series.points), series.reserved_peak_bytes
    svg: List[str] = []
    add = svg.append
    total_w, total_h = LEFT + WIDTH + 20, TOP + HEIGHT + BOTTOM
    add(f'<svg id="chart" viewBox="0 0 {total_w} {total_h}" '
        f'width="{total_w}" height="{total_h}" role="img" aria-label="memory over the planned step">')
    svg += _phases(series, x)
    # Bytes axis.
    for tick in range(0, axes.top + 1, _tick_step(axes.top)):
        add(f'<line x1="{LEFT}" y1="{y(tick)}" x2="{LEFT + WIDTH}" y2="{y(tick)}" stroke="#e0e0e0"/>')
        add(f'<text class="tick" x="{LEFT - 6}" y="{y(tick) + 4}" font-size="11" text-anchor="end">'
            f'{html.escape(format_bytes(tick))}</text>')
    # The parts, stacked: each a polygon between the sum below it and the sum with it.
    below = [0] * len(points)
    for slot, (part, colour) in enumerate(zip(parts, colours)):
        above = [base + point.parts[slot] for base, point in zip(below, points)]
        upper = " ".join(f"{x(p.index)},{y(v)}" for p, v in zip(points, above))
        lower = " ".join(f"{x(p.index)},{y(v)}" for p, v in reversed(list(zip(points, below))))
        add(f'<polygon class="part" data-part="{html.escape(part)}" points="{upper} {lower}" fill="{colour}" '
            f'fill-opacity="0.85" stroke="none"><title>{html.escape(part)}</title></polygon>')
        below = above
    if reserved_peak is not None:
        line = " ".join(f"{x(p.index)},{y(p.reserved)}" for p in points)
        add(f'<polyline id="reserved-line" points="{line}" fill="none" stroke="{_RESERVED_COLOUR}" '
            'stroke-width="1.5"><title>reserved (the caching allocator)</title></polyline>')
    svg += _peak_marks(series, axes)
    add(f'<line x1="{LEFT}" y1="{TOP + HEIGHT}" x2="{LEFT + WIDTH}" y2="{TOP + HEIGHT}" stroke="#333"/>')
    add(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + HEIGHT}" stroke="#333"/>')
    add(f'<text x="{LEFT + WIDTH / 2}" y="{TOP + HEIGHT + 28}" font-size="12" text-anchor="middle">'
        f'allocator events, two training steps ({series.events:,})</text>')
    add(f'<line id="cursor" x1="0" y1="{TOP}" x2="0" y2="{TOP + HEIGHT}" stroke="#555" visibility="hidden"/>')
    add("</svg>")
    return svg


def _phases(series: Any, x: Any) -> List[str]:
    """Phases: alternate bands, a line at each start, the label in one of three rows."""
    marks: List[str] = []
    phases = list(series.phases) + [(series.events, "")]
    for number, ((start, name), (end, _)) in enumerate(zip(phases, phases[1:])):
        if number % 2:
            marks.append(f'<rect class="phase-band" x="{x(start)}" y="{TOP}" width="{round(x(end) - x(start), 2)}" '
                         f'height="{HEIGHT}" fill="#f3f3f3"/>')
    for number, (start, name) in enumerate(series.phases):
        row = TOP - 8 - 16 * (number % 3)
        marks.append(f'<line x1="{x(start)}" y1="{row + 4}" x2="{x(start)}" y2="{TOP + HEIGHT}" stroke="#999" '
                     'stroke-dasharray="3,3"/>')
        marks.append(f'<text class="phase-label" x="{x(start) + 3}" y="{row}" font-size="12" fill="#444">'
                     f'{html.escape(name)}</text>')
    return marks


def _peak_marks(series: Any, axes: _Axes) -> List[str]:
    """The step's peak marked on the stack, and the reserved peak named at its height."""
    peak, reserved_peak = series.peak, series.reserved_peak_bytes
    px, py = axes.x(peak.index), axes.y(peak.total)
    anchor = "end" if px > LEFT + WIDTH * 0.7 else "start"
    shift = -8 if anchor == "end" else 8
    marks = [f'<g id="peak-marker"><circle cx="{px}" cy="{py}" r="5" fill="none" stroke="#c00" stroke-width="2"/>'
             f'<text x="{px + shift}" y="{py - 8}" font-size="12" fill="#c00" text-anchor="{anchor}">'
             f'peak {html.escape(bytes_cell(peak.total))}, {html.escape(peak.phase)}</text></g>']
    if reserved_peak is not None:
        points = list(series.points)
        at = next(p for p in points if p.reserved == max(q.reserved for q in points))
        marks.append(f'<g id="reserved-peak-marker"><text x="{LEFT + WIDTH}" y="{axes.y(reserved_peak) - 6}" '
                     f'font-size="12" text-anchor="end">reserved peak {html.escape(bytes_cell(reserved_peak))} '
                     f'(from {html.escape(at.phase)})</text></g>')
    return marks


def _figure_rows(plan: Any, series: Any) -> List[Tuple[str, str]]:
    """The plan's figures under the chart, as (name, value) rows."""
    settings, device, step = plan.settings, plan.device, plan.step
    rows: List[Tuple[str, str]] = [
        ("model", settings.model), ("batch size, sequence length", f"{settings.batch_size}, {settings.seq_len}"),
        ("device type", settings.device_type), ("optimizer", settings.optimizer), ("precision", settings.precision),
        ("engine", settings.engine), ("the step's peak (plan)", bytes_cell(step.peak_bytes)),
        ("peak phase", str(step.peak_phase)), ("most alive at once, drawn", bytes_cell(series.peak.total))]
    if series.reserved_peak_bytes is not None:
        rows += [("reserved peak (plan)", bytes_cell(device.reserved_peak_bytes)),
                 ("PYTORCH_CUDA_ALLOC_CONF", device.alloc_conf or "torch's defaults")]
    if plan.verdict.fits is not None:
        rows.append(("fits?", ("yes" if plan.verdict.fits else "no")
                     + f", margin {bytes_cell(plan.verdict.margin_bytes)}"))
    return rows


_PAGE_HEAD = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{heading}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 18px; margin: 0 0 4px 0; }}
p.what {{ font-size: 13px; color: #555; margin: 0 0 8px 0; }}
ul.legend {{ list-style: none; padding: 0; margin: 6px 0; display: flex; flex-wrap: wrap; gap: 14px; font-size: 13px; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; margin-right: 5px; vertical-align: middle; }}
.swatch.line {{ height: 2px; }}
#readout {{ font-size: 12px; font-family: monospace; min-height: 3em; white-space: pre; }}
table.figures {{ border-collapse: collapse; font-size: 13px; margin-top: 10px; }}
table.figures th {{ text-align: left; padding: 2px 12px 2px 0; font-weight: normal; color: #555; }}
</style>
</head>
<body>
"""

# The hover readout; {LEFT} and {WIDTH} are the chart's margin and width.
_PAGE_SCRIPT = """<script>
(function () {
  var data = JSON.parse(document.getElementById("series-data").textContent);
  var svg = document.getElementById("chart"), cursor = document.getElementById("cursor");
  var out = document.getElementById("readout");
  var left = {LEFT}, width = {WIDTH}, count = Math.max(1, data.events - 1);
  function bytes(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], v = n, i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : v) + " " + units[i] + " (" + n.toLocaleString("en") + ")";
  }
  svg.addEventListener("mousemove", function (event) {
    var box = svg.getBoundingClientRect(), scale = svg.viewBox.baseVal.width / box.width;
    var index = ((event.clientX - box.left) * scale - left) / width * count, best = data.points[0];
    data.points.forEach(function (p) { if (Math.abs(p[0] - index) < Math.abs(best[0] - index)) best = p; });
    var x = left + width * best[0] / count;
    cursor.setAttribute("x1", x); cursor.setAttribute("x2", x); cursor.setAttribute("visibility", "visible");
    var total = best[2].reduce(function (a, b) { return a + b; }, 0);
    var lines = ["event " + best[0] + ", " + best[1] + ": alive " + bytes(total)
                 + (best[3] === null ? "" : ", reserved " + bytes(best[3]))];
    data.parts.forEach(function (name, i) { if (best[2][i]) lines.push("  " + name + " " + bytes(best[2][i])); });
    out.textContent = lines.join("\\n");
  });
})();
</script>
</body>
</html>
"""
