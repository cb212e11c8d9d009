"""Pure rendering of per-rank memory: a stacked bar per rank (SVG string) and a text table.

No torch, no I/O: rows in, markup out. Rank labels use the dashboard's rank colours (nbdist.colors).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from nbdist.colors import rank_color
from nbdist.text import format_bytes
from nbdist.text import render_table as render_text_table

SEGMENTS = ("params", "grads", "optimizer", "activations", "other")
"""Bar segments bottom to top; every row is a mapping with these keys (None counts as 0)."""

SEGMENT_COLORS = {
    "params": "#4e79a7",
    "grads": "#f28e2b",
    "optimizer": "#59a14f",
    "activations": "#e15759",
    "other": "#bab0ac",
}


def render_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str] = (*SEGMENTS, "total")
) -> str:
    """Fixed-width text table, one line per rank."""
    lines = [
        [r.get("rank", i), *(format_bytes(r.get(c)) for c in columns)]
        for i, r in enumerate(rows)
    ]
    return render_text_table(["rank", *columns], lines, align="right", rule=True)


def render_svg(
    rows: Sequence[dict[str, Any]], title: str = "memory per rank", width: int = 520
) -> str:
    """A stacked bar per rank (params, grads, optimizer, activations, other) on one byte scale."""
    height, top, bottom, left = 260, 34, 40, 70
    plot_h = height - top - bottom
    totals = [sum(float(r.get(s) or 0) for s in SEGMENTS) for r in rows]
    peak = max(totals, default=0.0) or 1.0
    n = max(len(rows), 1)
    slot = (width - left - 120) / n
    bar_w = max(min(slot * 0.6, 60), 4)
    base = top + plot_h
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="system-ui,sans-serif" font-size="11">',
        f'<text x="{left}" y="18" font-size="13" font-weight="600">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{base}" x2="{left + slot * n}" y2="{base}" stroke="#999"/>',
        f'<text x="{left - 6}" y="{top + 4}" text-anchor="end" fill="#666">'
        f"{format_bytes(peak)}</text>",
        f'<text x="{left - 6}" y="{base}" text-anchor="end" fill="#666">0</text>',
    ]
    for i, row in enumerate(rows):
        x = left + slot * i + (slot - bar_w) / 2
        y = float(top + plot_h)
        for segment in SEGMENTS:
            value = float(row.get(segment) or 0)
            h = plot_h * value / peak
            if h > 0:
                y -= h
                out.append(
                    f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                    f'fill="{SEGMENT_COLORS[segment]}"><title>rank {row.get("rank", i)} {segment}: '
                    f"{format_bytes(value)}</title></rect>"
                )
        rank = int(row.get("rank", i))
        out.append(
            f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h + 16}" text-anchor="middle" '
            f'font-weight="600" fill="{rank_color(rank)}">rank {rank}</text>'
        )
    for j, segment in enumerate(reversed(SEGMENTS)):
        y = top + 14 * j
        color = SEGMENT_COLORS[segment]
        out.append(f'<rect x="{width - 110}" y="{y}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{width - 95}" y="{y + 9}">{segment}</text>')
    out.append("</svg>")
    return "".join(out)
