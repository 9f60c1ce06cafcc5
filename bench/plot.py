"""Bar and line charts as PNG, drawn with Pillow (already a worker dependency; no plotting library).

``draw_panels`` lays out one bar chart per ``Panel`` in a grid; each chart has
groups of bars (one bar per series), value labels, and optional reference lines
(a goal, a baseline). ``draw_timelines`` stacks line charts that share one time
axis (``Timeline``: series of values over time, optional reference lines), for
runs whose state changes over time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

_PANEL_W, _PANEL_H = 560, 380
_MARGIN_L, _MARGIN_R, _MARGIN_T, _MARGIN_B = 70, 20, 56, 60
_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")
_LINE_COLOR = "#C44E52"
_AXIS = "#333333"
_GRID = "#DDDDDD"

Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


@dataclass(frozen=True)
class Line:
    """A horizontal reference line across a panel."""

    value: float
    label: str


@dataclass(frozen=True)
class Panel:
    """One bar chart: ``values[g][s]`` is series ``s`` of group ``g``."""

    title: str
    unit: str  # the y axis label
    groups: Sequence[str]
    series: Sequence[str]
    values: Sequence[Sequence[float]]
    lines: Sequence[Line] = field(default_factory=tuple)
    note: str = ""  # one line under the title, e.g. the ratio


def draw_panels(panels: Sequence[Panel], path: Path, columns: int = 2, title: str = "") -> None:
    """Write ``panels`` as one PNG image, ``columns`` charts per row."""
    rows = math.ceil(len(panels) / columns)
    top = 40 if title else 0
    image = Image.new("RGB", (columns * _PANEL_W, rows * _PANEL_H + top), "white")
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((12, 10), title, fill=_AXIS, font=_font(18))
    for n, panel in enumerate(panels):
        row, col = divmod(n, columns)
        _draw_panel(draw, panel, col * _PANEL_W, top + row * _PANEL_H)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def _draw_panel(draw: ImageDraw.ImageDraw, panel: Panel, x0: int, y0: int) -> None:
    font, small = _font(13), _font(11)
    draw.text((x0 + 12, y0 + 8), panel.title, fill=_AXIS, font=_font(15))
    if panel.note:
        draw.text((x0 + 12, y0 + 28), panel.note, fill=_AXIS, font=small)
    left, right = x0 + _MARGIN_L, x0 + _PANEL_W - _MARGIN_R
    top, bottom = y0 + _MARGIN_T, y0 + _PANEL_H - _MARGIN_B
    finite = [v for group in panel.values for v in group if math.isfinite(v)]
    finite += [line.value for line in panel.lines if math.isfinite(line.value)]
    y_max = 4 * _nice_step(max(finite, default=1.0) * 1.1 / 4)

    def y_of(value: float) -> float:
        return bottom - (bottom - top) * min(value, y_max) / y_max

    for tick in range(5):
        value = y_max * tick / 4
        y = y_of(value)
        draw.line([(left, y), (right, y)], fill=_GRID)
        draw.text((left - 6, y), _short(value), fill=_AXIS, font=small, anchor="rm")
    draw.text((x0 + 6, top - 14), panel.unit, fill=_AXIS, font=small)
    _draw_bars(draw, panel, left, right, y_of, font, small)
    for line in panel.lines:
        if math.isfinite(line.value):
            y = y_of(line.value)
            _dashed(draw, left, right, y)
            draw.text((right, y - 2), line.label, fill=_LINE_COLOR, font=small, anchor="rb")
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=_AXIS)
    if len(panel.series) > 1:
        _legend(draw, panel.series, left, bottom + 30, small)


def _draw_bars(
    draw: ImageDraw.ImageDraw,
    panel: Panel,
    left: int,
    right: int,
    y_of: Callable[[float], float],
    font: Font,
    small: Font,
) -> None:
    bottom = y_of(0.0)
    group_w = (right - left) / max(len(panel.groups), 1)
    bar_w = group_w * 0.7 / max(len(panel.series), 1)
    for g, (label, values) in enumerate(zip(panel.groups, panel.values, strict=True)):
        gx = left + g * group_w + group_w * 0.15
        for s, value in enumerate(values):
            x = gx + s * bar_w
            if math.isfinite(value):
                draw.rectangle(
                    [(x + 1, y_of(value)), (x + bar_w - 1, bottom)], fill=_COLORS[s % len(_COLORS)]
                )
            shown = _short(value) if math.isfinite(value) else "n/a"
            draw.text((x + bar_w / 2, y_of(value) - 2), shown, fill=_AXIS, font=small, anchor="mb")
        draw.text(
            (left + (g + 0.5) * group_w, bottom + 6), label, fill=_AXIS, font=font, anchor="ma"
        )


def _legend(draw: ImageDraw.ImageDraw, series: Sequence[str], x: int, y: int, font: Font) -> None:
    for s, name in enumerate(series):
        draw.rectangle([(x, y), (x + 10, y + 10)], fill=_COLORS[s % len(_COLORS)])
        draw.text((x + 14, y + 5), name, fill=_AXIS, font=font, anchor="lm")
        x += 24 + int(draw.textlength(name, font=font))


def _dashed(draw: ImageDraw.ImageDraw, x0: int, x1: int, y: float) -> None:
    for x in range(x0, x1, 10):
        draw.line([(x, y), (min(x + 6, x1), y)], fill=_LINE_COLOR, width=2)


def _nice_step(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 × 10^k at or above ``value``: a readable tick step."""
    value = max(value, 1e-9)
    base = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5):
        if step * base >= value:
            return step * base
    return 10 * base


def _short(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value / 1000:.3g}k"
    if abs(value) >= 10:
        return f"{value:.0f}"
    return f"{value:.2g}"


def _font(size: int) -> Font:
    return ImageFont.load_default(size=size)


@dataclass(frozen=True)
class Timeline:
    """One line chart over time: ``series[name][i]`` is the value at ``times[i]``."""

    title: str
    unit: str  # the y axis label
    times: Sequence[float]  # seconds from the start of the run
    series: dict[str, Sequence[float]]
    lines: Sequence[Line] = field(default_factory=tuple)
    steps: bool = False  # draw as a staircase (counts that change at an instant)


_TIMELINE_W, _TIMELINE_H = 1000, 230


def draw_timelines(
    charts: Sequence[Timeline], path: Path, title: str = "", columns: int = 1
) -> None:
    """Write ``charts`` as one PNG, ``columns`` side by side, then row under row, all on the
    time axis of the longest."""
    top = 40 if title else 0
    rows = math.ceil(len(charts) / columns)
    image = Image.new("RGB", (columns * _TIMELINE_W, rows * _TIMELINE_H + top), "white")
    draw = ImageDraw.Draw(image)
    if title:
        draw.text((12, 10), title, fill=_AXIS, font=_font(18))
    span = max((max(c.times, default=0.0) for c in charts), default=0.0) or 1.0
    for n, chart in enumerate(charts):
        row, column = divmod(n, columns)
        _draw_timeline(draw, chart, column * _TIMELINE_W, top + row * _TIMELINE_H, span)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def _draw_timeline(
    draw: ImageDraw.ImageDraw, chart: Timeline, x0: int, y0: int, span: float
) -> None:
    small = _font(11)
    box = (x0 + _MARGIN_L, y0 + 34, x0 + _TIMELINE_W - 150, y0 + _TIMELINE_H - 34)
    left, top, right, bottom = box
    draw.text((x0 + 12, y0 + 8), chart.title, fill=_AXIS, font=_font(15))
    finite = [v for ys in chart.series.values() for v in ys if math.isfinite(v)]
    finite += [line.value for line in chart.lines if math.isfinite(line.value)]
    y_max = 4 * _nice_step(max(finite, default=1.0) * 1.1 / 4)

    def x_of(t: float) -> float:
        return left + (right - left) * t / span

    def y_of(value: float) -> float:
        return bottom - (bottom - top) * min(value, y_max) / y_max

    _timeline_axes(draw, chart.unit, box, y_max, span, small)
    for s, (name, ys) in enumerate(chart.series.items()):
        color = _COLORS[s % len(_COLORS)]
        points: list[tuple[float, float]] = []
        for t, value in zip(chart.times, ys, strict=True):
            if not math.isfinite(value):  # a gap: no value to draw there
                _polyline(draw, points, color)
                points = []
                continue
            if chart.steps and points:
                points.append((x_of(t), points[-1][1]))
            points.append((x_of(t), y_of(value)))
        _polyline(draw, points, color)
        draw.rectangle([(right + 16, top + 18 * s), (right + 26, top + 18 * s + 10)], fill=color)
        draw.text((right + 30, top + 18 * s + 5), name, fill=_AXIS, font=small, anchor="lm")
    for line in chart.lines:
        if math.isfinite(line.value):
            y = y_of(line.value)
            _dashed(draw, left, right, y)
            draw.text((right, y - 2), line.label, fill=_LINE_COLOR, font=small, anchor="rb")


def _timeline_axes(
    draw: ImageDraw.ImageDraw,
    unit: str,
    box: tuple[int, int, int, int],
    y_max: float,
    span: float,
    font: Font,
) -> None:
    """Grid, value ticks, time ticks every "nice" number of seconds, and the axes."""
    left, top, right, bottom = box
    for tick in range(5):
        value = y_max * tick / 4
        y = bottom - (bottom - top) * tick / 4
        draw.line([(left, y), (right, y)], fill=_GRID)
        draw.text((left - 6, y), _short(value), fill=_AXIS, font=font, anchor="rm")
    step = _nice_step(span / 10)
    for k in range(int(span / step) + 1):
        x = left + (right - left) * k * step / span
        draw.line([(x, bottom), (x, bottom + 4)], fill=_AXIS)
        draw.text((x, bottom + 6), f"{k * step:g} s", fill=_AXIS, font=font, anchor="ma")
    draw.text((left - 60, top - 16), unit, fill=_AXIS, font=font)
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=_AXIS)


def _polyline(draw: ImageDraw.ImageDraw, points: list[tuple[float, float]], color: str) -> None:
    if len(points) > 1:
        draw.line(points, fill=color, width=2)
    elif points:
        x, y = points[0]
        draw.ellipse([(x - 2, y - 2), (x + 2, y + 2)], fill=color)
