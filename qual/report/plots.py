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

from qual.errors import QualError  # noqa: E402
from qual.files import write_bytes  # noqa: E402

CONTROL_COLOR = "#4c72b0"
CANDIDATE_COLOR = "#dd8452"
STEP_COLOR = "#c0392b"
ERROR_COLOR = "#333333"

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


def trend_strip_svg(points: Sequence[tuple]) -> str:
    """Both arms' acceptance over the last runs of one configuration, the baseline ringed, tonight last, each change of
    the engine marked (a dashed line, its new version).

    points: (label, control rate, candidate rate, is the baseline, is tonight[, engine]), oldest first.
    """
    with matplotlib.rc_context(_RC):
        fig = _figure(9.0, 2.0)
        ax = fig.subplots()
        x = np.arange(len(points))
        for i, (color, name) in enumerate(((CONTROL_COLOR, "control"), (CANDIDATE_COLOR, "candidate"))):
            y = _nan([p[1 + i] for p in points]) * 100
            ax.plot(x, y, marker="o", markersize=3.5, linewidth=1.2, color=color, label=name)
            for j, p in enumerate(points):
                if p[3] and np.isfinite(y[j]):
                    ax.plot([j], [y[j]], marker="o", markersize=9, markerfacecolor="none", color="#333333",
                            label="baseline" if i == 0 else None)
        if points and points[-1][4]:
            ax.axvspan(len(points) - 1.5, len(points) - 0.5, color="#eeeeee", zorder=0)
        engines = [p[5] if len(p) > 5 else None for p in points]
        for j in range(1, len(points)):
            if engines[j] and engines[j - 1] and engines[j] != engines[j - 1]:
                ax.axvline(j - 0.5, color=ERROR_COLOR, linestyle="--", linewidth=0.8, alpha=0.7)
                ax.annotate(_short_engine(engines[j]), (j - 0.5, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                            rotation=90, va="top", ha="right")
        ax.set_xticks(x)
        ax.set_xticklabels([p[0] for p in points], fontsize=7, rotation=0 if len(points) <= 12 else 60)
        ax.set_ylabel("acceptance (%)")
        ax.legend(loc="best", frameon=False, ncol=3)
        return to_svg(fig, "trend-strip")


def trend_figure(series: dict[str, list[tuple]], steps: Sequence[tuple], axis: str = "date") -> Figure:
    """Acceptance over nights: one panel per series label, along the axis (date: time; else one column a night,
    labelled by its engine, qual or --meta value where that changes). Every panel marks the nights whose engine
    changed (a dashed line) and the nights that ended without a verdict (an x on the axis).

    series: label -> [(x, control_rate, candidate_rate, engine, error)], oldest first (x: a datetime on the date
    axis, else the night's value or None); steps: (label, where, arm, rate), where: the night's datetime on the date
    axis, else its column (its index in the series).
    """
    with matplotlib.rc_context(_RC):
        labels = sorted(series) or ["(no runs)"]
        fig = _figure(9.0, 2.6 * len(labels))
        axes = np.atleast_1d(fig.subplots(len(labels), 1, squeeze=False)[:, 0])
        for ax, label in zip(axes, labels):
            pts = series.get(label, [])
            xs = [p[0] for p in pts] if axis == "date" else list(range(len(pts)))
            if pts:
                ax.plot(xs, _nan([p[1] for p in pts]) * 100, "o-", color=CONTROL_COLOR, label="control", markersize=4)
                ax.plot(xs, _nan([p[2] for p in pts]) * 100, "o-", color=CANDIDATE_COLOR, label="candidate", markersize=4)
                errors = [x for x, p in zip(xs, pts) if p[4]]
                if errors:
                    ax.scatter(errors, [0] * len(errors), marker="x", color=ERROR_COLOR, label="no verdict", zorder=5)
                for i in range(1, len(pts)):
                    if pts[i][3] and pts[i - 1][3] and pts[i][3] != pts[i - 1][3]:
                        ax.axvline(xs[i], color=ERROR_COLOR, linestyle="--", linewidth=0.8, alpha=0.7)
                        ax.annotate(_short_engine(pts[i][3]), (xs[i], 1.0), xycoords=("data", "axes fraction"),
                                    fontsize=7, rotation=90, va="top", ha="right")
            marked = [s for s in steps if s[0] == label]
            if marked:
                ax.scatter([s[1] for s in marked], [(s[3] or 0) * 100 for s in marked], s=140, facecolors="none",
                           edgecolors=STEP_COLOR, linewidths=1.8, label="step change", zorder=5)
            ax.set_title(textwrap.fill(label, 130), fontsize=8, loc="left")  # a configuration key's label is long
            ax.set_ylabel("acceptance (%)")
            ax.legend(loc="best", frameon=False)
            if axis == "date":
                _time_axis(ax, [p[0] for p in pts])
            else:
                _value_axis(ax, [p[0] for p in pts], axis)
        return fig


def _short_engine(label: str) -> str:
    return label if len(label) <= 40 else label[:37] + "..."


def _value_axis(ax, values: list, axis: str) -> None:
    """One column a night, labelled by the axis value where it changes (a run of nights of one engine reads once)."""
    ticks = [i for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
    ax.set_xticks(ticks, [_short_engine(str(values[i] if values[i] is not None else "(none)")) for i in ticks],
                  rotation=20, ha="right", fontsize=7)
    ax.set_xlim(-0.5, max(len(values) - 0.5, 0.5))
    ax.set_xlabel(axis, fontsize=8)


def _time_axis(ax, times: list) -> None:
    """Dates every panel shows (not only the lowest), at the scale the runs span: two runs minutes apart read as
    minutes apart, not as a default span of years around them."""
    locator = mdates.AutoDateLocator(minticks=3, maxticks=7)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    if times:
        lo, hi = mdates.date2num(min(times)), mdates.date2num(max(times))
        pad = max((hi - lo) * 0.05, 5 / (24 * 60))  # at least five minutes each side (one run, or runs close together)
        ax.set_xlim(mdates.num2date(lo - pad), mdates.num2date(hi + pad))
    ax.tick_params(axis="x", labelbottom=True, labelsize=8)


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
