"""The published site's trend charts: hand-written inline SVG, one column per night, whose points link to the
night's report (matplotlib's SVG has no links). Pure: numbers and labels in, SVG text out; every text escaped."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from markupsafe import escape

from qual.report.plots import CANDIDATE_COLOR, CONTROL_COLOR

FAIL_COLOR = "#b71c1c"
FAIL_BAND = "#fbe3e3"
INK, MUTED, GRID = "#1d2330", "#5f6b7a", "#dde2ea"
FONT = 'font-family="system-ui, sans-serif"'
MONO = 'font-family="ui-monospace, DejaVu Sans Mono, monospace"'

WIDTH = 900.0  # the viewBox's width while every night gets SLOT_MIN or more
SLOT_MIN = 16.0  # units per night at least: more nights widen the chart, and its box scrolls
LABEL_W = 62.0  # a night's label (a short commit, a date): labels are thinned to one every ceil(LABEL_W / slot)
SIDE, PLOT_H, BOTTOM = 56.0, 200.0, 42.0  # SIDE: each side, for the y labels (and half the newest label)
MIN_SCALE = 0.75  # the chart is never drawn smaller than this (phones scroll it): text stays readable
# A sequence of draft positions reads as one: dark blue (the first position) through teal to amber (the last).
POSITION_ANCHORS = ((0x1F, 0x3B, 0x73), (0x2A, 0x9D, 0x8F), (0xE0, 0x9A, 0x1E))


@dataclass(frozen=True)
class Column:
    """One night on the x axis."""

    commit: str  # the first label line
    date: str  # the second
    failed: bool
    href: str | None  # the night's report relative to the page; None: plotted from its history row only
    title: str  # the tooltip of the night's points


@dataclass(frozen=True)
class Line:
    name: str
    color: str
    values: Sequence[float | None]  # fractions, one per column; None: no value that night
    wide: bool = False  # a thicker line and larger points, drawn first: a line beneath it stays visible


def position_colors(k: int) -> list[str]:
    """k colors from the first draft position's to the last's."""
    out = []
    for i in range(k):
        t = i / (k - 1) if k > 1 else 0.0
        seg = min(int(t * (len(POSITION_ANCHORS) - 1)), len(POSITION_ANCHORS) - 2)
        u = t * (len(POSITION_ANCHORS) - 1) - seg
        a, b = POSITION_ANCHORS[seg], POSITION_ANCHORS[seg + 1]
        out.append("#" + "".join(f"{round(x + (y - x) * u):02x}" for x, y in zip(a, b)))
    return out


def arm_lines(control: Sequence[float | None], candidate: Sequence[float | None]) -> list[Line]:
    """The two arms; the control is drawn wider, under the candidate, so that equal rates show both."""
    return [Line("control", CONTROL_COLOR, control, wide=True), Line("candidate", CANDIDATE_COLOR, candidate)]


def _ticks(values: list[float]) -> list[float]:
    """Round y ticks (in %) spanning the values, within 0..100; a flat series gets a 5 pp window."""
    if not values:
        return [0.0, 25.0, 50.0, 75.0, 100.0]
    lo, hi = min(values), max(values)
    if hi - lo < 1.0:
        lo, hi = lo - 2.5, hi + 2.5
    lo, hi = lo - (hi - lo) * 0.05, hi + (hi - lo) * 0.05  # no point on the plot's edge
    raw = (hi - lo) / 4
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start, stop = max(0.0, math.floor(lo / step) * step), min(100.0, math.ceil(hi / step) * step)
    n = round((stop - start) / step)
    return [start + i * step for i in range(n + 1)]


@dataclass(frozen=True)
class Key:
    """One entry of a chart's legend (drawn by the page, outside the chart's scrolling box)."""

    kind: str  # line | failed | hollow
    text: str
    color: str = MUTED


def legend(columns: Sequence[Column], lines: Sequence[Line]) -> list[Key]:
    """The lines, then the marks the chart holds: a failed night, a night without a report."""
    keys = [Key("line", line.name, line.color) for line in lines]
    if any(c.failed for c in columns):
        keys.append(Key("failed", "failed night", FAIL_COLOR))
    if any(c.href is None for c in columns):
        keys.append(Key("hollow", "no report: from the history row only"))
    return keys


def chart_svg(columns: Sequence[Column], lines: Sequence[Line], label: str) -> str:
    """A line per series over the nights, oldest left: failed nights banded and labelled in red, each night's points
    (and its column) linking to its report; a night without a report is drawn hollow. label: what the y axis
    measures (its values are fractions, drawn in %).

    Up to (WIDTH - 2 SIDE) / SLOT_MIN nights the chart scales with the page (never below MIN_SCALE); more nights
    widen it at scale 1. A chart wider than its box scrolls, and the page starts it at the newest night: the y axis is
    labelled on both sides, so that it reads from either end."""
    n = max(len(columns), 1)
    wide = 2 * SIDE + n * SLOT_MIN > WIDTH
    width = max(WIDTH, 2 * SIDE + n * SLOT_MIN)
    slot = (width - 2 * SIDE) / n
    top = 22.0  # room for a failed night's FAIL above its band
    bottom_y = top + PLOT_H
    height = bottom_y + BOTTOM
    values = [v * 100 for line in lines for v in line.values if v is not None]
    ticks = _ticks(values)
    y_lo, y_hi = ticks[0], ticks[-1]

    def x(i: int) -> float:
        return SIDE + slot * (i + 0.5)

    def y(v: float) -> float:
        return bottom_y - (v * 100 - y_lo) / (y_hi - y_lo) * PLOT_H

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height:.0f}" width="100%" '
           f'style="min-width: {width if wide else width * MIN_SCALE:.0f}px" role="img" '
           f'aria-label="{escape(label)} by night">']
    for i, c in enumerate(columns):  # failed nights behind everything
        if c.failed:
            out.append(f'<rect x="{x(i) - slot / 2:.1f}" y="{top:.1f}" width="{slot:.1f}" height="{PLOT_H:.1f}" '
                       f'fill="{FAIL_BAND}"/>')
            if slot >= 30:
                out.append(f'<text x="{x(i):.1f}" y="{top - 6:.1f}" font-size="10" font-weight="700" '
                           f'text-anchor="middle" fill="{FAIL_COLOR}" {FONT}>FAIL</text>')
    for t in ticks:
        ty = bottom_y - (t - y_lo) / (y_hi - y_lo) * PLOT_H
        out.append(f'<line x1="{SIDE:.1f}" y1="{ty:.1f}" x2="{width - SIDE:.1f}" y2="{ty:.1f}" stroke="{GRID}"/>'
                   f'<text x="{SIDE - 6:.1f}" y="{ty + 4:.1f}" font-size="11" text-anchor="end" fill="{MUTED}" '
                   f'{FONT}>{t:g}%</text>')
        out.append(f'<text x="{width - SIDE + 6:.1f}" y="{ty + 4:.1f}" font-size="11" fill="{MUTED}" '
                   f'{FONT}>{t:g}%</text>')
    out.append(f'<text transform="translate(14 {top + PLOT_H / 2:.1f}) rotate(-90)" font-size="11" '
               f'text-anchor="middle" fill="{MUTED}" {FONT}>{escape(label)}</text>')
    every = max(1, math.ceil(LABEL_W / slot))
    for i, c in enumerate(columns):
        if (len(columns) - 1 - i) % every:  # thinned from the newest night back: the newest is always labelled
            continue
        color = FAIL_COLOR if c.failed else INK
        out.append(f'<text x="{x(i):.1f}" y="{bottom_y + 16:.1f}" font-size="11" text-anchor="middle" fill="{color}" '
                   f'{MONO}>{escape(c.commit)}</text><text x="{x(i):.1f}" y="{bottom_y + 30:.1f}" font-size="10" '
                   f'text-anchor="middle" fill="{MUTED}" {FONT}>{escape(c.date)}</text>')
    for i, c in enumerate(columns):  # the whole column links to the night's report, under its points
        if c.href is not None:
            out.append(f'<a href="{escape(c.href)}"><title>{escape(c.title)}</title><rect x="{x(i) - slot / 2:.1f}" '
                       f'y="{top:.1f}" width="{slot:.1f}" height="{PLOT_H:.1f}" fill="transparent"/></a>')
    for line in lines:
        out.extend(_polylines(line, x, y))
    for line in lines:
        for i, (c, v) in enumerate(zip(columns, line.values)):
            if v is None:
                continue
            tip = f"<title>{escape(line.name)} {v * 100:.2f}% \u00b7 {escape(c.title)}</title>"
            r = 6 if line.wide else 4
            if c.href is None:
                out.append(f'<g>{tip}<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="{r}" fill="#fff" '
                           f'stroke="{line.color}" stroke-width="1.5"/></g>')
            else:
                out.append(f'<a href="{escape(c.href)}">{tip}<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="{r}" '
                           f'fill="{line.color}"/></a>')
    out.append(f'<line x1="{SIDE:.1f}" y1="{bottom_y:.1f}" x2="{width - SIDE:.1f}" y2="{bottom_y:.1f}" '
               f'stroke="{MUTED}"/></svg>')
    return "".join(out)


def _polylines(line: Line, x, y) -> list[str]:
    """The line through consecutive nights that have a value; a night without one breaks it."""
    runs: list[list[str]] = [[]]
    for i, v in enumerate(line.values):
        if v is None:
            runs.append([])
        else:
            runs[-1].append(f"{x(i):.1f},{y(v):.1f}")
    return [f'<polyline points="{" ".join(r)}" fill="none" stroke="{line.color}" '
            f'stroke-width="{3.5 if line.wide else 1.8}"/>'
            for r in runs if len(r) > 1]
