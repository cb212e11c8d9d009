"""Static SVG of the dashboard, kept in the output's mimebundle for saved and exported notebooks.

Pure string building from a :class:`DashboardModel` (no browser, no matplotlib); colours and
units match the live widget. Coordinates are whole pixels and lines are downsampled, so it stays
small.
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np

from nbdist.colors import rank_color, rank_dash
from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.stragglers import describe, ms
from nbdist.text import format_bytes

# format_bytes: nbdist.text's, re-exported
__all__ = ["format_bytes", "format_number", "nice_ticks", "render_svg"]

_STATE_COLORS = {
    "running": "#2e9e44",
    "idle": "#8a8a8a",
    "stale": "#d08700",
    "dead": "#d0312d",
    "waiting": "#8a8a8a",
}

# class names are prefixed: JupyterLab inlines trusted SVG, so this <style> applies page-wide;
# the newlines are dropped, so a rule may span lines
_STYLE = """
.nbd-bg{fill:var(--jp-layout-color0,#fff)}
.nbd-t{font:12px var(--jp-ui-font-family,system-ui,-apple-system,'Segoe UI',sans-serif);
fill:var(--jp-ui-font-color1,#1f1f1f)}
.nbd-m{fill:var(--jp-ui-font-color2,#6a6a6a)}
.nbd-h{font-weight:600;font-size:13px}
.nbd-grid{stroke:var(--jp-border-color2,#e4e4e4);stroke-width:1}
.nbd-axis{stroke:var(--jp-border-color1,#bdbdbd);stroke-width:1}
.nbd-track{fill:var(--jp-layout-color2,#eee)}
.nbd-l{fill:none;stroke-width:1.5;stroke-linejoin:round}
""".replace("\n", "")


def format_number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–" if value is None else str(value)
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-3 or magnitude >= 1e5):
        return f"{value:.3g}"
    if magnitude >= 100:
        return f"{value:.0f}"
    return f"{value:.4g}"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high] (1-2-5 steps)."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _path(x: np.ndarray, y: np.ndarray) -> str:
    # whole pixels, consecutive duplicates dropped, NaN (segment break or unplottable) -> new "M"
    parts: list[str] = []
    pen_down = False
    last: tuple[int, int] | None = None
    for px, py in zip(x.tolist(), y.tolist(), strict=False):
        if not (math.isfinite(px) and math.isfinite(py)):
            pen_down = False
            continue
        point = (round(px), round(py))
        if pen_down and point == last:
            continue
        parts.append(f"{'' if pen_down else 'M'}{point[0]} {point[1]}")
        pen_down = True
        last = point
    return " ".join(parts)


class _Chart:
    def __init__(self, x: float, y: float, width: float, height: float) -> None:
        self.left, self.top, self.width, self.height = x + 56, y + 22, width - 66, height - 50

    def frame(self, out: list[str], title: str, x_label: str) -> None:
        right = self.left + self.width
        out.append(
            f'<text class="nbd-t nbd-h" x="{self.left - 50:.0f}" y="{self.top - 8:.0f}">'
            f"{html.escape(title)}</text>"
        )
        bottom = self.top + self.height
        out.append(
            f'<line class="nbd-axis" x1="{self.left:.0f}" y1="{bottom:.0f}" x2="{right:.0f}"'
            f' y2="{bottom:.0f}"/>'
        )
        out.append(
            f'<text class="nbd-t nbd-m" text-anchor="end" x="{right:.0f}" y="{bottom + 30:.0f}">'
            f"{html.escape(x_label)}</text>"
        )


def _scale(
    values: np.ndarray, low: float, high: float, start: float, length: float, log: bool
) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        if log:
            values = np.where(values > 0, np.log10(values), np.nan)
            low, high = math.log10(low), math.log10(high)
        span = (high - low) or 1.0
        return start + (values - low) / span * length


def _bounds(arrays: list[np.ndarray], log: bool) -> tuple[float, float] | None:
    finite = [a[np.isfinite(a) & ((a > 0) if log else True)] for a in arrays]
    finite = [a for a in finite if a.size]
    if not finite:
        return None
    low = float(min(a.min() for a in finite))
    high = float(max(a.max() for a in finite))
    if high == low:
        pad = abs(high) * 0.05 or 1.0
        low, high = (low / 2, high * 2) if log else (low - pad, high + pad)
    return low, high


def _draw_lines(
    out: list[str],
    chart: _Chart,
    lines: list[tuple[int, np.ndarray, np.ndarray, str]],
    log_y: bool,
    y_format: Any,
) -> None:
    xb = _bounds([x for _, x, _, _ in lines], False)
    yb = _bounds([y for _, _, y, _ in lines], log_y)
    bottom = chart.top + chart.height
    if xb is None or yb is None:
        middle = chart.top + chart.height / 2
        x = chart.left + 8
        out.append(f'<text class="nbd-t nbd-m" x="{x:.0f}" y="{middle:.0f}">no data yet</text>')
        return
    ylow, yhigh = yb
    if log_y:
        ticks = [
            10.0**e for e in range(math.floor(math.log10(ylow)), math.ceil(math.log10(yhigh)) + 1)
        ]
        ticks = [t for t in ticks if ylow <= t <= yhigh] or [ylow, yhigh]
    else:
        ylow, yhigh = (
            (min(ylow, 0.0), yhigh) if ylow >= 0 and ylow < 0.25 * yhigh else (ylow, yhigh)
        )
        # byte axes tick at round MiB/GiB, not at round decimal byte counts
        unit = (2**30 if yhigh >= 2**30 else 2**20) if y_format is format_bytes else 1.0
        ticks = [t * unit for t in nice_ticks(ylow / unit, yhigh / unit, 4)]
    for tick in ticks:
        py = float(_scale(np.array([tick]), ylow, yhigh, bottom, -chart.height, log_y)[0])
        out.append(
            f'<line class="nbd-grid" x1="{chart.left:.0f}" y1="{py:.0f}"'
            f' x2="{chart.left + chart.width:.0f}" y2="{py:.0f}"/>'
        )
        out.append(
            f'<text class="nbd-t nbd-m" text-anchor="end" x="{chart.left - 6:.0f}"'
            f' y="{py + 4:.0f}">{html.escape(y_format(tick))}</text>'
        )
    for tick in nice_ticks(xb[0], xb[1], 5):
        px = float(_scale(np.array([tick]), xb[0], xb[1], chart.left, chart.width, False)[0])
        out.append(
            f'<text class="nbd-t nbd-m" text-anchor="middle" x="{px:.0f}" y="{bottom + 16:.0f}">'
            f"{format_number(tick)}</text>"
        )
    for rank, x, y, dash in lines:
        px = _scale(x, xb[0], xb[1], chart.left, chart.width, False)
        py = _scale(y, ylow, yhigh, bottom, -chart.height, log_y)
        style = f' stroke-dasharray="{dash}"' if dash else ""
        stroke = rank_color(rank)
        out.append(f'<path class="nbd-l" stroke="{stroke}"{style} d="{_path(px, py)}"/>')


_ROW = 20
_TABLE_TOP = 44
_CHART_HEIGHT = 230
_COLUMNS = (12, 64, 140, 190, 250, 320, 390, 456)
"""x of the table's columns: rank, state, step, steps/s, last metric value, step time, late by,
memory bar."""
_FLAG_COLOR = "#d08700"


def render_svg(
    model: DashboardModel,
    metric: str | None = None,
    log_scale: bool = False,
    width: int = 900,
    title: str = "nbdist dashboard",
) -> str:
    """The whole dashboard as one standalone SVG document (string)."""
    ranks = list(model.ranks)
    names = model.metric_names()
    metric = metric if metric in names else (names[0] if names else None)
    charts_top = _TABLE_TOP + _ROW * (len(ranks) + 2) + 12
    height = charts_top + _CHART_HEIGHT + 28
    out: list[str] = [
        '<svg xmlns="http://www.w3.org/2000/svg" class="nbdist-static"'
        f' width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img"'
        f' aria-label="{html.escape(title)}">',
        f"<style>{_STYLE}</style>",
        f'<rect class="nbd-bg" width="{width}" height="{height}"/>',
        f'<text class="nbd-t nbd-h" x="12" y="22">{html.escape(title)}</text>',
        f'<text class="nbd-t nbd-m" x="{width - 12}" y="22" text-anchor="end">{len(ranks)} ranks'
        f" · cell {model.cell} · final at cell end</text>",
    ]
    _draw_rank_table(out, model, metric, width)
    half = (width - 24) / 2
    _draw_metric_chart(out, model, metric, log_scale, _Chart(12, charts_top, half, _CHART_HEIGHT))
    _draw_memory_chart(out, model, _Chart(12 + half, charts_top, half, _CHART_HEIGHT))
    out.append("</svg>")
    return "".join(out)


def _draw_rank_table(
    out: list[str], model: DashboardModel, metric: str | None, width: int
) -> None:
    """Per rank: state, step, steps/s, the metric's last value and a memory bar against
    capacity."""
    headers = (
        "rank",
        "state",
        "step",
        "steps/s",
        html.escape(metric or "metric"),
        "step time",
        "late by",
        "memory: allocated ▮ reserved ▯ peak ┃ of capacity",
    )
    stragglers = model.stragglers.summary(list(model.ranks))
    for x, text in zip(_COLUMNS, headers, strict=False):
        out.append(f'<text class="nbd-t nbd-m" x="{x}" y="{_TABLE_TOP}">{text}</text>')
    bar_width = width - _COLUMNS[7] - 12
    for index, rank in enumerate(model.ranks):
        summary = model.rank_summary(rank, stragglers=stragglers)
        y = _TABLE_TOP + _ROW * (index + 1)
        if rank == stragglers["flagged"]:  # the rank the others wait for
            out.append(f'<rect x="6" y="{y - 14}" width="{width - 12}" height="{_ROW - 2}" '
                       f'fill="{_FLAG_COLOR}" fill-opacity="0.18"/>')
        color = rank_color(rank)
        out.append(f'<circle cx="{_COLUMNS[0] + 5}" cy="{y - 4}" r="5" fill="{color}"/>')
        out.append(f'<text class="nbd-t" x="{_COLUMNS[0] + 16}" y="{y}">{rank}</text>')
        state = summary["state"]
        label = state if state != "stale" else f"stale {summary['age'] or 0:.0f} s"
        state_color = _STATE_COLORS.get(state, "#888")
        out.append(
            f'<text class="nbd-t" x="{_COLUMNS[1]}" y="{y}" style="fill:{state_color}">'
            f"{html.escape(label)}</text>"
        )
        last = summary["last"].get(metric) if metric else None
        cells = (
            format_number(summary["step"]),
            format_number(summary["steps_per_s"]),
            format_number(last),
            ms(summary["step_time"]),
            ms(summary["late_by"]),
        )
        for x, text in zip(_COLUMNS[2:7], cells, strict=True):
            out.append(f'<text class="nbd-t" x="{x}" y="{y}">{text}</text>')
        _draw_memory_bar(out, rank, summary["memory"] or {}, y, min(160, bar_width - 310))
    y = _TABLE_TOP + _ROW * (len(model.ranks) + 1)
    style = f' style="fill:{_FLAG_COLOR}"' if stragglers["flagged"] is not None else ""
    out.append(f'<text class="nbd-t nbd-m" x="{_COLUMNS[0]}" y="{y}"{style}>'
               f'{html.escape(describe(stragglers))}</text>')


def _draw_memory_bar(
    out: list[str], rank: int, memory: dict[str, Any], y: int, track_width: float
) -> None:
    """allocated (solid) and reserved (faint) as shares of capacity, peak as a tick, then the
    numbers."""
    bar_left = _COLUMNS[7]
    capacity = float(memory.get("capacity") or 0)
    top = y - 11
    out.append(
        f'<rect class="nbd-track" x="{bar_left}" y="{top}" width="{track_width}"'
        ' height="12" rx="2"/>'
    )
    if capacity > 0:
        color = rank_color(rank)

        def frac(key: str) -> float:
            return min(1.0, max(0.0, float(memory.get(key) or 0) / capacity))

        reserved = frac("reserved") * track_width
        allocated = frac("allocated") * track_width
        out.append(
            f'<rect x="{bar_left}" y="{top}" width="{reserved:.1f}" height="12" rx="2"'
            f' fill="{color}" fill-opacity="0.35"/>'
        )
        out.append(
            f'<rect x="{bar_left}" y="{top}" width="{allocated:.1f}" height="12" rx="2"'
            f' fill="{color}"/>'
        )
        peak_x = bar_left + frac("peak") * track_width
        out.append(
            f'<line x1="{peak_x:.1f}" y1="{y - 13}" x2="{peak_x:.1f}" y2="{y + 3}"'
            f' stroke="{color}" stroke-width="2"/>'
        )
    text = (
        f"{format_bytes(memory.get('allocated'))} / {format_bytes(memory.get('reserved'))}"
        f" · peak {format_bytes(memory.get('peak'))} · of {format_bytes(capacity or None)}"
    )
    x = bar_left + track_width + 8
    out.append(f'<text class="nbd-t nbd-m" x="{x}" y="{y}">{html.escape(text)}</text>')


def _draw_metric_chart(
    out: list[str], model: DashboardModel, metric: str | None, log_scale: bool, chart: _Chart
) -> None:
    chart.frame(out, f"{metric or 'metric'} per rank{' (log)' if log_scale else ''}", "step")
    lines = []
    for rank, history in model.ranks.items():
        line = history.metrics.get(metric or "")
        if line is not None and line.n:
            x, y = line.downsampled(model.config.svg_points_per_series)
            lines.append((rank, x, y, rank_dash(rank)))
    _draw_lines(out, chart, lines, log_scale, format_number)


def _draw_memory_chart(out: list[str], model: DashboardModel, chart: _Chart) -> None:
    chart.frame(out, "memory per rank (— allocated, - - reserved)", "seconds")
    lines = []
    for rank, history in model.ranks.items():
        for name, dash in (("allocated", rank_dash(rank)), ("reserved", "4 3")):
            line = history.memory.get(name)
            if line is not None and line.n:
                x, y = line.downsampled(model.config.svg_points_per_series)
                lines.append((rank, x, y, dash))
    _draw_lines(out, chart, lines, False, format_bytes)
