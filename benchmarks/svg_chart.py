"""A small SVG line chart (documentation tooling: matplotlib is not in the project's environment).

    svg = line_chart("title", "GPUs", "tokens/s", [8, 16, 32], [Series("a", [1.0, 2.0, 3.0])])

The x values are placed at equal steps (the plots here double the GPU count per step); the y axis
starts at 0 with round ticks. Every point carries a ``<title>`` (its tooltip in a browser), and the
output depends only on the inputs, so a committed chart can be checked for being current.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence
from xml.sax.saxutils import escape

COLOURS = ("#1f77b4", "#2ca02c", "#d62728", "#ff7f0e", "#9467bd", "#8c564b")
DASHES = ("", "6 3", "2 3", "8 3 2 3")
WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 80, 200, 40, 56


@dataclasses.dataclass(frozen=True)
class Series:
    name: str
    ys: Sequence[float]
    point_notes: Optional[Sequence[str]] = None  # one tooltip line per point (e.g. what limits it)


def nice_step(top: float, ticks: int = 6) -> float:
    """A 1, 2 or 5 x 10^k step giving about ``ticks`` intervals up to ``top``."""
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _fmt(value: float) -> str:
    return f"{value:.1f}"


def line_chart(title: str, x_label: str, y_label: str, xs: Sequence, series: Sequence[Series],
               y_format=lambda v: f"{v:g}") -> str:
    if not xs or not series:
        raise ValueError("a chart needs x values and at least one series")
    for s in series:
        if len(s.ys) != len(xs):
            raise ValueError(f"series {s.name!r}: {len(s.ys)} values for {len(xs)} x values")
        if s.point_notes is not None and len(s.point_notes) != len(xs):
            raise ValueError(f"series {s.name!r}: {len(s.point_notes)} point notes for {len(xs)} x values")
        if any(not math.isfinite(y) or y < 0 for y in s.ys):
            raise ValueError(f"series {s.name!r}: values must be finite and >= 0")
    top = max(max(s.ys) for s in series) or 1.0
    step = nice_step(top)
    y_max = step * math.ceil(top / step)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(i: int) -> float:
        return LEFT + (plot_w * i / (len(xs) - 1) if len(xs) > 1 else plot_w / 2)

    def py(y: float) -> float:
        return TOP + plot_h * (1 - y / y_max)

    out: List[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2:.1f}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    for k in range(int(round(y_max / step)) + 1):
        y = py(k * step)
        out.append(f'<line x1="{LEFT}" y1="{_fmt(y)}" x2="{LEFT + plot_w}" y2="{_fmt(y)}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{_fmt(y + 4)}" text-anchor="end">{escape(y_format(k * step))}</text>')
    for i, x in enumerate(xs):
        out.append(f'<line x1="{_fmt(px(i))}" y1="{TOP}" x2="{_fmt(px(i))}" y2="{TOP + plot_h}" stroke="#eee"/>')
        out.append(f'<text x="{_fmt(px(i))}" y="{TOP + plot_h + 18}" text-anchor="middle">{escape(str(x))}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 14}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(20 {TOP + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
               f'{escape(y_label)}</text>')
    for n, s in enumerate(series):
        colour, dash = COLOURS[n % len(COLOURS)], DASHES[n % len(DASHES)]
        points = " ".join(f"{_fmt(px(i))},{_fmt(py(y))}" for i, y in enumerate(s.ys))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<g class="series" data-name="{escape(s.name, {chr(34): "&quot;"})}">')
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"{dash_attr}/>')
        for i, y in enumerate(s.ys):
            note = f"{s.name}, {x_label} {xs[i]}: {y_format(y)}"
            if s.point_notes:
                note += f"; {s.point_notes[i]}"
            out.append(f'<circle cx="{_fmt(px(i))}" cy="{_fmt(py(y))}" r="3.5" fill="{colour}">'
                       f'<title>{escape(note)}</title></circle>')
        out.append("</g>")
        ly = TOP + 10 + 20 * n
        lx = LEFT + plot_w + 14
        out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 26}" y2="{ly}" stroke="{colour}" stroke-width="2"'
                   f'{dash_attr}/>')
        out.append(f'<text x="{lx + 32}" y="{ly + 4}">{escape(s.name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
