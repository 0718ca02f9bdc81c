"""Matplotlib figures for the reports, returned as inline SVG text or written to a file.

Figures use the object-oriented API on an Agg canvas (never pyplot), so no GUI
backend loads and no global figure state is kept.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass
from datetime import datetime
from html import unescape
from pathlib import Path
from typing import Mapping, Sequence

# matplotlib writes a font cache into its config dir: keep it out of the
# user's home unless they chose one.
if "MPLCONFIGDIR" not in os.environ:
    _uid = os.getuid() if hasattr(os, "getuid") else "user"
    os.environ["MPLCONFIGDIR"] = str(Path(tempfile.gettempdir()) / f"qual-mpl-{_uid}")

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import dates as mdates  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from markupsafe import escape  # noqa: E402

from qual.errors import QualError  # noqa: E402
from qual.files import write_bytes  # noqa: E402
from qual.outcomes import ERROR, PASS  # noqa: E402
from qual.shown import safe  # noqa: E402

CONTROL_COLOR = "#4c72b0"
CANDIDATE_COLOR = "#dd8452"
STEP_COLOR = "#c0392b"
ERROR_COLOR = "#333333"
FAIL_COLOR, FAIL_BAND = "#b71c1c", "#f6caca"
ERROR_BAND = "#d9d9d9"

_RC = {
    "svg.fonttype": "none",  # text stays text: small, selectable, no glyph defs to collide
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
}


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def to_svg(fig: Figure, salt: str) -> str:
    """Inline SVG (no XML prolog); `salt` keeps element ids distinct between figures of one page."""
    buf = io.StringIO()
    with matplotlib.rc_context({**_RC, "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    start = text.find("<svg")
    svg = text[start:]
    # Scale with the page: drop fixed pt sizes, keep the viewBox.
    svg = re.sub(r'(<svg[^>]*?)\swidth="[^"]*"\s+height="[^"]*"', r'\1 width="100%"', svg, count=1)
    return svg


def linked_svg(fig: Figure, salt: str, titles: Mapping[str, str]) -> str:
    """to_svg, each link (Artist.set_url/set_urls) a plain href that opens in the page's own tab, with its title
    (titles: href -> the tooltip of what links there)."""
    def link(m: re.Match) -> str:
        return f'<a href="{m[1]}"><title>{escape(safe(titles.get(unescape(m[1]), "")))}</title>'

    return re.sub(r'<a xlink:href="([^"]*)" target="_blank">', link, to_svg(fig, salt))


def _nan(xs: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if x is None else x for x in xs], dtype=float)


def _whiskers(values: np.ndarray, intervals: Sequence[Sequence[float] | None], n: int) -> np.ndarray:
    """matplotlib's asymmetric error bars [2, n] around values from [lo, hi] intervals (same units); NaN: none."""
    lo_hi = np.full((2, n), np.nan)
    for i, ci in enumerate(list(intervals)[:n]):
        if ci is not None and np.isfinite(values[i]):
            lo_hi[:, i] = (max(0.0, values[i] - ci[0]), max(0.0, ci[1] - values[i]))
    return lo_hi


def per_position_svg(
    control_uncond: Sequence[float | None],
    candidate_uncond: Sequence[float | None],
    control_cond: Sequence[float | None],
    candidate_cond: Sequence[float | None],
    intervals: Mapping[str, Sequence[Sequence[float] | None]] | None = None,
    salt: str = "",
) -> str:
    """Grouped bars per draft position: unconditional (left) and conditional (right) acceptance.

    intervals: "control", "candidate", "control_conditional", "candidate_conditional" -> [lo, hi] (fractions) per
    position, drawn as whiskers; a position without one has none. salt: prefixes the figure's element ids (one
    page holding several of these figures: a sweep's).
    """
    intervals = intervals or {}
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 3.2)
        axes = fig.subplots(1, 2, sharey=True)
        panels = (
            (axes[0], control_uncond, candidate_uncond, "", "unconditional: accepted at i / drafts"),
            (axes[1], control_cond, candidate_cond, "_conditional", "conditional: accepted at i / accepted at i-1"),
        )
        for ax, c, k, suffix, label in panels:
            n = max(len(c), len(k))
            x = np.arange(n)
            bars = ((-0.2, c, "control", CONTROL_COLOR), (0.2, k, "candidate", CANDIDATE_COLOR))
            for offset, values, arm, color in bars:
                y = _nan(list(values) + [None] * (n - len(values))) * 100
                ci = [None if v is None else [v[0] * 100, v[1] * 100] for v in intervals.get(arm + suffix, [])]
                ax.bar(x + offset, y, 0.4, label=arm, color=color, yerr=_whiskers(y, ci, n),
                       error_kw={"ecolor": ERROR_COLOR, "elinewidth": 0.9, "capsize": 2.0})
            ax.set_title(label)
            ax.set_xlabel("draft position")
            ax.set_xticks(x)
            ax.set_ylim(0, 100)
        axes[0].set_ylabel("acceptance (%)")
        axes[0].legend(loc="upper right", frameon=False)
        return to_svg(fig, f"{salt}per-position")


def delta_histogram_svg(deltas: Sequence[float], mean_delta: float | None, salt: str = "") -> str:
    """Histogram of per-request paired deltas (candidate - control), in pp."""
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 2.8)
        ax = fig.subplots()
        d = np.asarray(deltas, dtype=float) * 100
        if d.size:
            lo, hi = float(d.min()), float(d.max())
            bins = min(40, max(5, d.size // 4))
            if hi - lo < 1e-9:  # all requests equal (identical arms): one bar centred on the value
                lo, hi, bins = lo - 0.55, hi + 0.55, 11
            ax.hist(d, bins=bins, range=(lo, hi), color=CANDIDATE_COLOR, alpha=0.85)
        ax.axvline(0, color="#333333", linewidth=1)
        if mean_delta is not None:
            ax.axvline(mean_delta * 100, color=STEP_COLOR, linestyle="--", linewidth=1.2,
                       label=f"pooled delta {mean_delta * 100:+.2f} pp")
            ax.legend(loc="upper left", frameon=False)
        ax.set_xlabel("per-request acceptance delta, candidate - control (pp)")
        ax.set_ylabel("requests")
        return to_svg(fig, f"{salt}delta-hist")


@dataclass(frozen=True)
class Column:
    """One night on a plot of nights (the trend, the published site)."""

    id: int  # the history row: the night's identity across the panels of one figure, and its place in recording order
    when: datetime  # its place on the date axis (time to scale)
    value: str | None  # its place on any other axis (qual.nights.axis_value): labelled where it changes
    outcome: str  # pass | fail | inconclusive | error: anything but pass is marked; an error night is a gap
    engine: str | None  # the engine's version: a change between two nights is marked on every panel
    href: str | None = None  # where its points link (its report; else where the page says why it has none)
    title: str = ""  # the tooltip of its links (an error night's names its cause)
    hollow: bool = False  # no report of the night: its points are drawn hollow


@dataclass(frozen=True)
class Panel:
    """One plot of a figure of nights: lines of rates over its own nights, on the figure's one x axis."""

    ylabel: str
    columns: Sequence[Column]
    lines: Sequence[tuple[str, str, Sequence[float | None]]]  # (name, color, fractions per column; None: a gap)
    title: str = ""
    href: str | None = None  # where the title links (the series' page)
    rings: Sequence[tuple[int, float]] = ()  # (column index, rate): a step change (or what ring_label says), ringed
    ring_label: str = "step change"
    tonight: int | None = None  # the column of the run a report is of: named above the plot


def arm_lines(control: Sequence[float | None], candidate: Sequence[float | None]) -> list[tuple]:
    """Both arms' lines (the control first: drawn wider, so equal rates show both)."""
    return [("control", CONTROL_COLOR, control), ("candidate", CANDIDATE_COLOR, candidate)]


def position_colors(k: int) -> list[str]:
    """k colors from the first draft position's (dark blue) to the last's (yellow): a sequence reads as one."""
    return [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["viridis"](np.linspace(0.0, 0.9, k))]


def nights_figure(panels: Sequence[Panel], axis: str = "date", panel_height: float = 2.3) -> Figure:
    """Panels stacked on one shared x axis: the date (time to scale), else one column a night in the order the nights
    were recorded (their ids, as qual.history.runs.newest_first: a clock set back leaves them in place), labelled by
    its engine, qual or --meta value where that changes. Every panel marks the nights that did not pass (a red
    band, FAIL above it), the error nights (a grey band, ERROR: no rates, the lines break) and each change of the
    engine (a dashed line, its new version); each point links to its night's page (hollow where there is none)."""
    everyone = sorted({c.id: c for p in panels for c in p.columns}.values(), key=lambda c: c.id)
    order = {c.id: i for i, c in enumerate(everyone)}

    def place(c: Column):
        return mdates.date2num(c.when) if axis == "date" else order[c.id]

    with matplotlib.rc_context(_RC):
        wide = 9.0 if axis == "date" else max(9.0, 0.22 * len(everyone))
        fig = _figure(wide, panel_height * max(len(panels), 1))
        axes = fig.subplots(max(len(panels), 1), 1, sharex=True, squeeze=False)[:, 0]
        for n, (ax, panel) in enumerate(zip(axes, panels)):
            x = np.array([place(c) for c in panel.columns], dtype=float)
            _mark_nights(ax, x, panel.columns)
            for j, (name, color, values) in enumerate(panel.lines):
                y = _nan(values) * 100
                ax.plot(x, y, color=color, linewidth=3.0 if j == 0 and len(panel.lines) == 2 else 1.4, label=safe(name))
                shown = np.isfinite(y)
                cols = [c for c, ok in zip(panel.columns, shown) if ok]
                dots = ax.scatter(x[shown], y[shown], s=22, zorder=3, edgecolors=color, linewidths=1.2,
                                  facecolors=["white" if c.hollow else color for c in cols])
                dots.set_urls([c.href for c in cols])
            if panel.rings:
                ax.scatter([x[i] for i, _ in panel.rings], [r * 100 for _, r in panel.rings], s=150, zorder=4,
                           facecolors="none", edgecolors=STEP_COLOR, linewidths=1.8, label=panel.ring_label)
            if panel.tonight is not None:
                ax.annotate("tonight", (x[panel.tonight], 1.0), xycoords=("data", "axes fraction"), ha="center",
                            va="bottom", fontsize=7, xytext=(0, 9), textcoords="offset points")
            ax.set_ylabel(panel.ylabel)
            if panel.title:
                ax.set_title(textwrap.fill(safe(panel.title), 120), fontsize=8, loc="left", pad=12).set_url(panel.href)
            _legend(ax, panels if n == 0 else ())
        if axis == "date":
            _time_axis(axes[-1], [c.when for c in everyone])
        else:
            _value_axis(axes[-1], [c.value for c in everyone], axis)
        return fig


def nights_svg(panels: Sequence[Panel], axis: str = "date", salt: str = "", panel_height: float = 2.3) -> str:
    """nights_figure as inline SVG whose links open in the page's tab, each with its night's tooltip."""
    titles = {c.href: c.title for p in panels for c in p.columns if c.href}
    titles.update({p.href: p.title for p in panels if p.href})
    return linked_svg(nights_figure(panels, axis, panel_height), salt, titles)


def _mark_nights(ax, x: np.ndarray, columns: Sequence[Column]) -> None:
    """The nights that did not pass (banded, named above the plot, linking to the night) and the engine's changes (a
    dashed line between two nights, its new version beside it)."""
    for xi, c in zip(x, columns):
        if c.outcome == PASS:
            continue
        error = c.outcome == ERROR
        ax.axvline(xi, color=ERROR_BAND if error else FAIL_BAND, linewidth=7, zorder=0)
        mark = ax.text(xi, 1.0, c.outcome.upper(), transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                       fontsize=6, fontweight="bold", color=ERROR_COLOR if error else FAIL_COLOR)
        mark.set_url(c.href)
    for i in range(1, len(columns)):
        if _engine_changed(columns[i - 1], columns[i]):
            where = (x[i - 1] + x[i]) / 2
            ax.axvline(where, color=ERROR_COLOR, linestyle="--", linewidth=0.9, alpha=0.8)
            ax.annotate(_short_engine(columns[i].engine), (where, 0.98), xycoords=("data", "axes fraction"),
                        fontsize=7, rotation=90, va="top", ha="right", color=ERROR_COLOR)


def _engine_changed(before: Column, after: Column) -> bool:
    """Both nights name their engine, and not the same one."""
    return bool(before.engine and after.engine and before.engine != after.engine)


def _legend(ax, panels: Sequence[Panel]) -> None:
    """The panel's lines, and the marks the panels given hold (the first panel's legend names those of all)."""
    handles, labels = ax.get_legend_handles_labels()
    columns = [c for p in panels for c in p.columns]
    changed = any(_engine_changed(a, b) for p in panels for a, b in zip(p.columns, p.columns[1:]))
    marks = (("failed night", any(c.outcome not in (PASS, ERROR) for c in columns), Patch(color=FAIL_BAND)),
             ("error night: no verdict", any(c.outcome == ERROR for c in columns), Patch(color=ERROR_BAND)),
             ("no report: from the history row only", any(c.hollow and c.outcome != ERROR for c in columns),
              Line2D([], [], marker="o", linestyle="", markerfacecolor="white", markeredgecolor=ERROR_COLOR)),
             ("engine changed", changed, Line2D([], [], color=ERROR_COLOR, linestyle="--")))
    for text, present, handle in marks:
        if present:
            handles.append(handle)
            labels.append(text)
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)


def _short_engine(label: str) -> str:
    label = safe(label)  # a version or --meta value is recorded text: its control characters are shown escaped
    return label if len(label) <= 40 else label[:37] + "..."


def _value_axis(ax, values: list, axis: str) -> None:
    """One column a night, labelled by the axis value where it changes (a run of nights of one engine reads once)."""
    ticks = [i for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
    ax.set_xticks(ticks, [_short_engine(str(values[i] if values[i] is not None else "(none)")) for i in ticks],
                  rotation=20, ha="right", fontsize=7)
    ax.set_xlim(-0.5, max(len(values) - 0.5, 0.5))
    ax.set_xlabel(safe(axis), fontsize=8)


def _time_axis(ax, times: list) -> None:
    """Dates at the scale the runs span: two runs minutes apart read as minutes apart, not as a default span of years
    around them."""
    locator = mdates.AutoDateLocator(minticks=3, maxticks=7)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    if times:
        lo, hi = mdates.date2num(min(times)), mdates.date2num(max(times))
        pad = max((hi - lo) * 0.05, 5 / (24 * 60))  # at least five minutes each side (one run, or runs close together)
        ax.set_xlim(lo - pad, hi + pad)
    ax.tick_params(axis="x", labelsize=8)


def plot_format(path: str | Path) -> str:
    """png or svg, by the path's suffix (a caller checks it before the work whose plot it is)."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise QualError(f"plot output must end in .png or .svg, got {Path(path).name!r}")
    return fmt


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write a figure as .png or .svg (chosen by suffix), whole or not at all (qual.files: a link there is replaced,
    never written through; a full disk leaves no empty file)."""
    path = Path(path)
    fmt = plot_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format=fmt, dpi=120, metadata={"Date": None} if fmt == "svg" else None)
    return write_bytes(path, buf.getvalue())
