"""A Gantt chart of a pipeline timeline (simulated or measured), as plain SVG text.

bar
    One timed action on one device — a stage computing one microbatch (``3F1``), a weight upload (``3W``),
    activations going up or down, a gradient download (``3G``). Anything with the attributes of
    :class:`~rpcompile.runtime.sim.sim_result.SimEvent` can be drawn (the executor's measured events too); an event
    with only ``action``, ``device``, ``lane``, ``start`` and ``end`` gets the rest from the action text.
lane
    Each device has three — ``compute`` (tall), ``upload`` and ``download`` (thin). Bars that overlap in time on one
    lane are stacked into *sub-rows*, so none hides another.
idle
    The compute lane's background is hatched, so every gap between compute bars reads as idle time.

:func:`timeline_svg` describes how bars are coloured and labelled and how the time axis is laid out.
"""

from __future__ import annotations

import heapq
import math
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from rpcompile.core.errors import ConfigError
from rpcompile.core.files import write_atomic
from rpcompile.runtime.sim.sim_result import SimEvent
from rpcompile.views.svg import TRANSFER_COLORS, document, esc, line, num, rect, stage_color, text, text_width

__all__ = ["timeline_svg", "write_timeline_svg", "LANES"]

LANES = ("compute", "upload", "download")
_KINDS = ("compute", "weights", "activations", "gradients")
# an action's text: stage, kind letter (W upload, F compute, G gradients home), then the microbatch if any
_ACTION = re.compile(r"^(\d+)([WFG])(\d*)$")

WIDTH = 1200.0
_LEFT, _RIGHT = 118.0, 24.0
_HEADER = 58.0
_AXIS = 34.0
_ROW = {"compute": 22.0, "upload": 7.0, "download": 7.0}
_LANE_GAP, _DEVICE_GAP = 3.0, 14.0
_LABEL_SIZE = 10.0

_STYLE = """
text { fill: #222; }
.title { font-size: 15px; font-weight: bold; }
.key { font-size: 11px; }
.dev { font-size: 13px; font-weight: bold; }
.util { font-size: 10px; fill: #666; }
.lane { font-size: 10px; fill: #555; }
.tick { font-size: 10px; fill: #444; }
.grid { stroke: #e2e2e2; stroke-width: 1; }
.axis { stroke: #888; stroke-width: 1; }
.lanebg { fill: #f7f7f7; }
.idle { fill: url(#idle); }
.bar { stroke: none; }
.bwd { stroke: #222; stroke-width: 1; }
.fused { stroke: #222; stroke-width: 1; stroke-dasharray: 3 2; }
.lbl { font-size: 10px; pointer-events: none; }
"""

_IDLE_PATTERN = (
    '<pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
    '<rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#dedede" '
    'stroke-width="2"/></pattern>'
)


def _as_bar(e: Any) -> SimEvent:
    """Read an event's attributes; stage, microbatch and kind missing from it come from its action text."""
    action = str(getattr(e, "action", ""))
    m = _ACTION.match(action)
    stage = getattr(e, "stage", int(m.group(1)) if m else -1)
    # W and G actions name no microbatch (-1): a stage uploads its weights and sends its gradients once
    mb = getattr(e, "microbatch", int(m.group(3)) if m and m.group(3) else -1)
    kind = getattr(e, "kind", None)
    if kind is None:
        kind = {"W": "weights", "F": "compute", "G": "gradients"}[m.group(2)] if m else "compute"
    lane = str(getattr(e, "lane", "compute"))
    if lane not in LANES:
        raise ConfigError(f"timeline event {action or e!r}: lane must be one of {', '.join(LANES)}, got {lane!r}")
    return SimEvent(action, int(e.device), lane, str(kind), int(stage), int(mb), float(e.start), float(e.end))


def _stack(bars: list[SimEvent]) -> tuple[list[int], int]:
    """Sub-row of each bar (bars sorted by start) so that bars overlapping in time get different rows; and the
    number of rows (at least 1). Greedy interval colouring: the lowest free row, which is optimal."""
    busy: list[tuple[float, int]] = []  # (end, row) of bars still running
    free: list[int] = []
    rows, count = [], 0
    for b in bars:
        # a bar that starts where another ended takes its row: float noise must not open a new one
        while busy and busy[0][0] <= b.start + 1e-12:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            row = heapq.heappop(free)
        else:
            row, count = count, count + 1
        heapq.heappush(busy, (b.end, row))
        rows.append(row)
    return rows, max(count, 1)


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / target
    mag = 10.0 ** math.floor(math.log10(raw))
    # the tolerance keeps a span that is exactly a nice step from rounding up to the next one
    return next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))


def _ticks(span: float) -> list[float]:
    """Tick times from 0 to the first multiple of a nice step at or past ``span``."""
    step = _nice_step(span)
    n = max(1, math.ceil(span / step - 1e-9))
    ticks = [k * step for k in range(n + 1)]
    ticks[-1] = max(ticks[-1], span)  # 25 ms stays 25 ms when rounding put the end at 25.000000000000004 ms
    return ticks


def _unit(last: float) -> tuple[str, float]:
    return ("s", 1.0) if last >= 1.0 else ("ms", 1e3) if last >= 1e-3 else ("µs", 1e6)


def _fmt(t: float, scale: float) -> str:
    return f"{round(t * scale, 6):g}"


def _name(stage: int, names: Sequence[str] | None) -> str:
    if names is not None and 0 <= stage < len(names):
        return str(names[stage])
    return f"S{stage}" if stage >= 0 else "—"


def _stage_class(name: str) -> str:
    return "bar fused" if name == "FB" else "bar bwd" if name.startswith("B") else "bar"


def _busy(bars: Iterable[SimEvent]) -> float:
    """Length of the union of the bars' intervals."""
    total = 0.0
    cur: tuple[float, float] | None = None  # the interval being merged
    for b in sorted(bars, key=lambda b: b.start):
        # a gap: the merged interval is complete; touching or overlapping bars extend it instead
        if cur is None or b.start > cur[1]:
            total += (cur[1] - cur[0]) if cur is not None else 0.0
            cur = (b.start, b.end)
        else:
            cur = (cur[0], max(cur[1], b.end))
    return total + ((cur[1] - cur[0]) if cur is not None else 0.0)


class _Chart:
    """Coordinates of one chart: the time origin and scale."""

    def __init__(self, bars: Sequence[SimEvent]) -> None:
        first = min((b.start for b in bars), default=0.0)
        last = max((b.end for b in bars), default=0.0)
        # A simulated iteration starts at 0; a measured one carries absolute clock readings: start at its first bar.
        self.t0 = 0.0 if 0.0 <= first <= 0.1 * max(last, 1e-30) else first
        span = last - self.t0
        # an empty or zero-length timeline still gets an axis (1 ms)
        self.ticks = _ticks(span if span > 0 else 1e-3)
        self.unit, self.scale = _unit(self.ticks[-1])
        self.plot_w = WIDTH - _LEFT - _RIGHT
        self.px_per_s = self.plot_w / self.ticks[-1]

    def x(self, t: float) -> float:
        return _LEFT + (t - self.t0) * self.px_per_s


def _header(title: str, bars: Sequence[SimEvent], devices: int, chart: _Chart) -> list[str]:
    end = max((b.end for b in bars), default=0.0) - chart.t0
    label = title or f"pipeline timeline: {devices} device{'s' * (devices != 1)}, {len(bars)} bars"
    out = ['<g class="header">', "  " + text(12, 20, f"{label} — {end * chart.scale:.4g} {chart.unit}",
                                             class_="title")]
    key = "compute bars: colour = stage; F forward, B backward (dark border), FB fused (dashed); hatched = idle."
    out.append("  " + text(12, 42, key, class_="key"))
    # SVG text cannot be measured here: the legend is laid out by estimated widths
    x = 24 + text_width(key, 11)
    out.append("  " + text(x, 42, "transfers:", class_="key"))
    x += 8 + text_width("transfers:", 11)
    for kind in ("weights", "activations", "gradients"):
        out.append("  " + rect(x, 33, 18, 11, fill=TRANSFER_COLORS[kind]))
        out.append("  " + text(x + 22, 42, kind, class_="key"))
        x += 30 + text_width(kind, 11)
    out.append("</g>")
    return out


def _compute_bar(b: SimEvent, x: float, y: float, w: float, h: float, names: Sequence[str] | None,
                 scale: float, unit: str) -> list[str]:
    name = _name(b.stage, names)
    mb = f"microbatch {b.microbatch}" if b.microbatch >= 0 else "no microbatch"
    tip = (f"{name} (stage {b.stage}) {b.action}: {mb}, {_fmt(b.start, 1e3)}–{_fmt(b.end, 1e3)} ms "
           f"({_fmt(b.end - b.start, scale)} {unit})")
    out = [rect(x, y, w, h, tip=tip, class_=_stage_class(name), fill=stage_color(b.stage))]
    long = f"{name} mb{b.microbatch}" if b.microbatch >= 0 else name
    # the longest label that fits the bar, or none
    for label in (long, name):
        if text_width(label, _LABEL_SIZE) + 6 <= w:
            out.append(text(x + w / 2, y + h / 2 + 3.5, label, class_="lbl", text_anchor="middle"))
            break
    return out


def _transfer_bar(b: SimEvent, x: float, y: float, w: float, h: float, names: Sequence[str] | None) -> str:
    name = _name(b.stage, names)
    mb = f", microbatch {b.microbatch}" if b.microbatch >= 0 else ""
    arrow = "↑ upload" if b.lane == "upload" else "↓ download" if b.lane == "download" else b.lane
    tip = f"{b.kind} of {name} (stage {b.stage}) {b.action}{mb}: {arrow}, {_fmt(b.start, 1e3)}–{_fmt(b.end, 1e3)} ms"
    return rect(x, y, w, h, tip=tip, class_="bar", fill=TRANSFER_COLORS.get(b.kind, "#999999"))


def _device(d: int, bars: list[SimEvent], y0: float, chart: _Chart, names: Sequence[str] | None,
            iteration: float) -> tuple[list[str], float]:
    """The row group of device ``d`` starting at ``y0``; returns its lines and its height."""
    out = [f'<g class="device" id="dev{d}">']
    by_lane: dict[str, list[SimEvent]] = {lane: [] for lane in LANES}
    for b in bars:
        by_lane[b.lane].append(b)
    busy = _busy(by_lane["compute"])
    out.append("  " + text(8, y0 + 15, f"dev {d}", class_="dev"))
    if iteration > 0:
        out.append("  " + text(8, y0 + 28, f"busy {100 * busy / iteration:.0f}%", class_="util"))
    y = y0
    for lane in LANES:
        lane_bars = sorted(by_lane[lane], key=lambda b: (b.start, b.end))
        rows, n_rows = _stack(lane_bars)
        row_h = _ROW[lane]
        h = n_rows * row_h
        out.append(f'  <g class="lane {lane}">')
        # the lane's name beside its first sub-row; +3.5 drops the baseline to centre 10 px text
        out.append("    " + text(_LEFT - 6, y + min(h, row_h) / 2 + 3.5, lane, class_="lane", text_anchor="end"))
        out.append("    " + rect(_LEFT, y, chart.plot_w, h, class_="idle" if lane == "compute" else "lanebg"))
        for b, r in zip(lane_bars, rows):
            x = chart.x(b.start)
            # a very short action still shows as a sliver
            w = max((b.end - b.start) * chart.px_per_s, 0.6)
            # half a pixel above and below (height row_h - 1): stacked sub-rows stay apart
            by = y + r * row_h + 0.5
            if lane == "compute" and b.kind == "compute":
                out.extend("    " + s for s in _compute_bar(b, x, by, w, row_h - 1, names, chart.scale, chart.unit))
            else:
                out.append("    " + _transfer_bar(b, x, by, w, row_h - 1, names))
        out.append("  </g>")
        y += h + _LANE_GAP
    out.append("</g>")
    return out, y - y0


def _axis(chart: _Chart, top: float, bottom: float) -> list[str]:
    out = ['<g class="time-axis">']
    for t in chart.ticks:
        x = chart.x(chart.t0 + t)
        out.append("  " + line(x, top, x, bottom, class_="grid"))
    out.append("  " + line(_LEFT, bottom, _LEFT + chart.plot_w, bottom, class_="axis"))
    for t in chart.ticks:
        x = chart.x(chart.t0 + t)
        out.append("  " + line(x, bottom, x, bottom + 4, class_="axis"))
        out.append("  " + f'<text class="tick" x="{num(x)}" y="{num(bottom + 16)}" text-anchor="middle" '
                   f'data-t="{t!r}">{esc(_fmt(t, chart.scale))} {chart.unit}</text>')
    origin = "time" if chart.t0 == 0.0 else "since first bar"
    out.append("  " + text(8, bottom + 16, origin, class_="lane"))
    out.append("</g>")
    return out


def timeline_svg(events: Iterable[Any], *, devices: int, title: str = "",
                 stage_names: Sequence[str] | None = None) -> str:
    """SVG text of a Gantt chart of ``events`` on ``devices`` devices (the terms: module docstring).

    ``stage_names[k]`` names stage ``k`` (``F0``, ``FB``, ``B3``…; from ``plan.stages``); without them stages are
    shown as ``S<k>``. Raises :class:`~rpcompile.core.errors.ConfigError` for an event on a device outside
    ``0..devices-1`` or on an unknown lane.

    Compute bars are coloured by stage (:func:`rpcompile.views.svg.stage_color`, the same colours as the plan graph); a
    forward stage has no border, a backward stage a dark border and the fused stage a dashed one, and bars wide enough
    carry the stage name (``F3``, ``B11``, ``FB``). Transfer bars are coloured by what they carry (key in the header).
    Every bar has a ``<title>`` tooltip: stage name, microbatch, start and end in ms.

    The time axis starts at 0 when the first bar starts near 0 (a simulated iteration), else at the first bar (a
    measured timeline with absolute clock readings); its ticks are 1, 2, 2.5 or 5 × 10^k in µs, ms or s, and the last
    tick is at or after the last bar's end.
    """
    if devices < 1:
        raise ConfigError(f"timeline_svg: devices must be >= 1, got {devices}")
    bars = [_as_bar(e) for e in events]
    per_device: list[list[SimEvent]] = [[] for _ in range(devices)]
    for b in bars:
        if not 0 <= b.device < devices:
            raise ConfigError(f"timeline event {b.action or b} runs on device {b.device}, but devices={devices}; "
                              "pass the device count the events were simulated on")
        per_device[b.device].append(b)
    chart = _Chart(bars)
    iteration = max((b.end for b in bars), default=0.0) - chart.t0
    body = _header(title, bars, devices, chart)
    y = _HEADER
    groups: list[str] = []
    for d in range(devices):
        lines, h = _device(d, per_device[d], y, chart, stage_names, iteration)
        groups.extend(lines)
        y += h + _DEVICE_GAP
    # the axis and its grid come before the device groups, so the bars are drawn over the grid lines
    body += _axis(chart, _HEADER - 4, y - _DEVICE_GAP + 4) + groups
    label = title or "pipeline timeline"
    return document(WIDTH, y - _DEVICE_GAP + 4 + _AXIS, body, style=_STYLE, defs=[_IDLE_PATTERN], label=label)


def write_timeline_svg(path: str | Path, events: Iterable[Any], **kw: Any) -> Path:
    """Write :func:`timeline_svg` of ``events`` to ``path`` (keywords as there); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, timeline_svg(events, **kw))
