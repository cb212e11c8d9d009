"""Static SVG of a profile: one row per rank (compute / wait / communication / idle), a mark where
each collective's last rank arrived, and the summary lines. What a saved notebook and GitHub show.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from nbdist.profiler.summary import ProfileSummary, format_us
from nbdist.profiler.timeline import KINDS, Timeline

KIND_COLORS = {"compute": "#4e79a7", "communication": "#59a14f", "wait": "#e15759",
               "idle": "#e8e8e8"}
"""Shared with profile_view.js (keep in step)."""
_STYLE = (".nbp-t{font:12px system-ui,-apple-system,'Segoe UI',sans-serif;fill:#1f1f1f}"
          ".nbp-m{fill:#6a6a6a}.nbp-h{font-weight:600;font-size:13px}")
_WIDTH, _LEFT, _ROW, _GAP = 900, 70, 22, 8
_MAX_CHARS = 125  # a summary line that fits the 900 px width at 12 px


def columns(segments: Sequence[tuple[float, float, str]], start: float, end: float, count: int
            ) -> list[tuple[int, int, str]]:
    """The row as at most `count` equal columns, each painted with the kind that filled most of
    it, run-length encoded as (first column, last column + 1, kind)."""
    span = max(end - start, 1e-9)
    weights = [dict.fromkeys(KINDS, 0.0) for _ in range(count)]
    for a, b, kind in segments:
        first, last = int((a - start) / span * count), int((b - start) / span * count)
        for column in range(max(first, 0), min(last, count - 1) + 1):
            lo = start + column * span / count
            hi = lo + span / count
            weights[column][kind] += max(0.0, min(b, hi) - max(a, lo))
    runs: list[tuple[int, int, str]] = []
    for column, weight in enumerate(weights):
        kind = max(weight, key=lambda k: weight[k]) if any(weight.values()) else "idle"
        if runs and runs[-1][2] == kind:
            runs[-1] = (runs[-1][0], column + 1, kind)
        else:
            runs.append((column, column + 1, kind))
    return runs


def render_svg(timeline: Timeline, summary: ProfileSummary, title: str = "nbdist profile") -> str:
    plot = _WIDTH - _LEFT - 10
    top = 52
    height = top + len(timeline.rows) * (_ROW + _GAP) + 20
    text_lines = _summary_lines(summary)
    total_height = height + 18 * len(text_lines) + 10
    span = max(timeline.end - timeline.start, 1e-9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{total_height}" '
             f'viewBox="0 0 {_WIDTH} {total_height}" class="nbdist-profile-svg">',
             f"<style>{_STYLE}</style>",
             f'<rect width="{_WIDTH}" height="{total_height}" fill="#fff"/>',
             f'<text class="nbp-t nbp-h" x="8" y="18">{html.escape(title)} '
             f"({format_us(span)}, {len(timeline.rows)} ranks)</text>"]
    parts += _legend(top - 16)
    for index, row in enumerate(timeline.rows):
        y = top + index * (_ROW + _GAP)
        parts.append(f'<g class="nbdist-profile-row" data-rank="{row.rank}">'
                     f'<text class="nbp-t" x="8" y="{y + 15}">rank {row.rank}</text>')
        for first, last, kind in columns(row.segments, timeline.start, timeline.end, plot):
            parts.append(f'<rect x="{_LEFT + first}" y="{y}" width="{last - first}" '
                         f'height="{_ROW}" fill="{KIND_COLORS[kind]}"/>')
        parts.append("</g>")
    for collective in timeline.collectives:
        if len(collective.arrivals) < 2:
            continue
        x = _LEFT + round((collective.last_arrival - timeline.start) / span * plot)
        y = top + timeline.ranks.index(collective.last_rank) * (_ROW + _GAP) if \
            collective.last_rank in timeline.ranks else top
        parts.append(f'<path d="M{x},{y - 1}l-4,-6h8z" fill="#1f1f1f">'
                     f"<title>{html.escape(collective.name)} #{collective.seq}: last rank "
                     f"{collective.last_rank}</title></path>")
    axis_y = top + len(timeline.rows) * (_ROW + _GAP)
    parts.append(f'<text class="nbp-t nbp-m" x="{_LEFT}" y="{axis_y + 4}">0</text>'
                 f'<text class="nbp-t nbp-m" x="{_WIDTH - 10}" y="{axis_y + 4}" '
                 f'text-anchor="end">{format_us(span)}</text>')
    for number, line in enumerate(text_lines):
        parts.append(f'<text class="nbp-t" x="8" y="{height + 14 + 18 * number}" '
                     f'xml:space="preserve">{html.escape(line)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _legend(y: int) -> list[str]:
    parts, x = [], _LEFT
    for kind in KINDS:
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" '
                     f'fill="{KIND_COLORS[kind]}"/>'
                     f'<text class="nbp-t nbp-m" x="{x + 14}" y="{y}">{kind}</text>')
        x += 30 + 8 * len(kind)
    parts.append(f'<path d="M{x + 4},{y}l-4,-6h8z" fill="#1f1f1f"/>'
                 f'<text class="nbp-t nbp-m" x="{x + 12}" y="{y}">'
                 "last rank into a collective</text>")
    return parts


def _summary_lines(summary: ProfileSummary) -> list[str]:
    lines = [summary.straggler_line()]
    for rank, totals in sorted(summary.totals.items()):
        lines.append(f"rank {rank}: " + ", ".join(f"{kind} {format_us(totals[kind])}"
                                                   for kind in KINDS)
                     + f", {summary.collectives.get(rank, 0)} collectives")
    top = ", ".join(f"{op['name'][:40]} {format_us(op['self_cpu_us'] + op['self_device_us'])}"
                    for op in summary.top_operators[:4])
    if top:
        lines.append(f"top operators: {top}")
    return [line if len(line) <= _MAX_CHARS else line[:_MAX_CHARS - 1] + "…" for line in lines]
