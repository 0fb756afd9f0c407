"""Line charts as inline SVG, rendered on the server (no script, no build step, no network).

:func:`line_chart` draws series of (time, value) over a window ending now: a polyline per series
(broken where a value is missing), a y axis from 0 to a round maximum, the window's start, middle
and end on the x axis, and a legend with each series' latest value.  Each ``<svg>`` carries
``data-points`` (points drawn in the window) and each line ``data-series`` and ``data-last``, so a
test (or a script) can read what the chart shows.  Every text is escaped.  Pure: strings in,
string out.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from scheduler.waiting import size

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd")


def _nice_max(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at or above ``v`` (1 for nothing)."""
    if not v > 1e-9 or not math.isfinite(v):  # nothing to scale (a subnormal would give a 0 axis)
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * e >= v - 1e-12:
            return m * e
    return 10 * e  # pragma: no cover - the loop returns at 10


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return size(v)
    if unit == "seconds":
        return duration(v)
    if unit == "percent":
        return f"{v:.0f}%"
    if unit == "bytes/s":
        return size(v) + "/s"
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:.1f}"


def duration(s: float) -> str:
    """Seconds for people: ``45 s``, ``12 min``, ``3.5 h``, ``2.0 d``."""
    s = float(s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def line_chart(chart_id: str, title: str, ts: Sequence[float], series: Sequence[tuple[str, str, Sequence[float | None]]],
               unit: str, now: float, window_s: float, width: int = 440, height: int = 170,
               esc: Callable[[str], str] = html.escape) -> str:
    """An SVG chart of ``series`` ((key, label, values) aligned with ``ts``) over the ``window_s``
    seconds up to ``now``, in ``unit`` (count, percent, bytes, bytes/s, seconds)."""
    left, right, top, bottom = 62, 10, 22, 36
    pw, ph = width - left - right, height - top - bottom
    t0 = now - window_s
    idx = [i for i, t in enumerate(ts) if t0 <= t <= now + 1e-6]
    vmax = max((v for _, _, vals in series for i in idx if (v := vals[i]) is not None), default=0.0)
    top_v = 100.0 if unit == "percent" and vmax <= 100 else _nice_max(vmax)

    def x(t: float) -> float:
        return left + pw * (t - t0) / window_s

    def y(v: float) -> float:
        return top + ph * (1 - min(max(v, 0.0), top_v) / top_v)

    out = [f"<svg class='chart' id='{esc(chart_id)}' data-points='{len(idx)}' viewBox='0 0 {width} {height}' "
           f"width='{width}' height='{height}' role='img' aria-label='{esc(title)}'>",
           f"<text x='{left}' y='14' class='title'>{esc(title)}</text>"]
    for frac in (0.0, 0.5, 1.0):
        yy = top + ph * (1 - frac)
        out.append(f"<line x1='{left}' x2='{left + pw}' y1='{yy:.1f}' y2='{yy:.1f}' class='grid'/>")
        out.append(f"<text x='{left - 4}' y='{yy + 4:.1f}' class='axis' text-anchor='end'>"
                   f"{esc(fmt_value(top_v * frac, unit))}</text>")
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        label = "now" if frac == 1.0 else "-" + duration(window_s * (1 - frac))
        out.append(f"<text x='{left + pw * frac:.1f}' y='{height - 22}' class='axis' text-anchor='{anchor}'>"
                   f"{esc(label)}</text>")
    legend = []
    for k, (key, label, vals) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        runs: list[list[str]] = [[]]
        last = None
        for i in idx:
            v = vals[i]
            if v is None:
                if runs[-1]:
                    runs.append([])
                continue
            last = v
            runs[-1].append(f"{x(ts[i]):.1f},{y(v):.1f}")
        pts = [r for r in runs if r]
        data = f"data-series='{esc(key)}' data-last='{'' if last is None else repr(float(last))}'"
        if not pts:
            out.append(f"<polyline {data} points='' fill='none' stroke='{color}'/>")
        for r in pts:
            if len(r) == 1:  # one point: a dot, so a fresh history shows something
                cx, cy = r[0].split(",")
                out.append(f"<circle {data} cx='{cx}' cy='{cy}' r='2' fill='{color}'/>")
            else:
                out.append(f"<polyline {data} points='{' '.join(r)}' fill='none' stroke='{color}' stroke-width='1.6'/>")
        legend.append(f"<tspan fill='{color}'>&#9632;</tspan> {esc(label)} {esc(fmt_value(last, unit))}")
    out.append(f"<text x='{left}' y='{height - 5}' class='legend'>{' &#160; '.join(legend)}</text>")
    out.append("</svg>")
    return "".join(out)


__all__ = ["duration", "fmt_value", "line_chart"]
