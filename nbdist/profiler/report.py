"""`ProfileReport`: the merged timeline and its summary, and every way to show them: a text table,
the static SVG, the interactive view (anywidget, imported only when shown), a Chrome trace."""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbdist.profiler.chrome import write_trace
from nbdist.profiler.clocks import align_clocks
from nbdist.profiler.summary import ProfileSummary, summarize
from nbdist.profiler.svg import KIND_COLORS, columns, render_svg
from nbdist.profiler.timeline import KINDS, Timeline, build_timeline

MAX_VIEW_SEGMENTS = 20_000
"""Per rank in the interactive view; a busier row is sent as that many equal columns."""
MAX_VIEW_COLLECTIVES = 5_000


@dataclass
class ProfileReport:
    """A profiled cell across ranks: `table()` (per rank compute / communication / wait / idle,
    the straggler, top operators), `straggler`, `wait_us(rank)`, the `timeline` itself (rows,
    matched collectives), `svg()`, `view()` (interactive) and `write_trace(path)` (Chrome /
    Perfetto). In a notebook it shows itself as the static SVG, then the interactive view."""

    timeline: Timeline
    summary: ProfileSummary
    trace_path: str | None = None
    missing: dict[int, str] = field(default_factory=dict)
    """Ranks whose capture did not come back, and why."""

    @property
    def straggler(self) -> int | None:
        return None if self.summary.straggler is None else self.summary.straggler.rank

    def wait_us(self, rank: int) -> float:
        return self.summary.totals[rank]["wait"]

    def table(self) -> str:
        lines = [self.summary.table()]
        lines += [f"rank {rank}: no profile ({why})" for rank, why in sorted(self.missing.items())]
        lines += [f"clock of {host} moved by {-offset / 1e3:+.2f} ms to line up with rank 0's host"
                  for host, offset in sorted(self.timeline.clock_offsets.items())]
        if self.trace_path:
            lines.append(f"trace: {self.trace_path} (open in https://ui.perfetto.dev)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()

    def write_trace(self, path: str | os.PathLike[str]) -> str:
        self.trace_path = write_trace(self.timeline, path)
        return self.trace_path

    def svg(self) -> str:
        return render_svg(self.timeline, self.summary)

    def static_bundle(self) -> dict[str, Any]:
        """SVG, as an ``<img>`` in text/html too: the one rich type JupyterLab shows in an
        untrusted notebook (see nbdist.dashboard.widget.Dashboard.static_bundle)."""
        svg = self.svg()
        encoded = base64.b64encode(svg.encode()).decode("ascii")
        text = self.table()
        return {
            "text/plain": text,
            "image/svg+xml": svg,
            "text/html": (f'<img class="nbdist-profile-img" alt="{html.escape(text)}" '
                          f'style="max-width:100%;height:auto" '
                          f'src="data:image/svg+xml;base64,{encoded}">'),
        }

    def view_data(self) -> dict[str, Any]:
        """What the interactive view draws: times in µs from the earliest start."""
        timeline, origin = self.timeline, self.timeline.start
        rows = []
        for row in timeline.rows:
            # whole µs: the view cannot show less, and the saved widget state stays small
            segments: list[list[float]] = [[round(a - origin), round(b - origin), KINDS.index(k)]
                                           for a, b, k in row.segments if k != "idle"]
            if len(segments) > MAX_VIEW_SEGMENTS:
                width = (timeline.end - origin) / MAX_VIEW_SEGMENTS
                segments = [[round(a * width), round(b * width), KINDS.index(k)] for a, b, k in
                            columns(row.segments, origin, timeline.end, MAX_VIEW_SEGMENTS)
                            if k != "idle"]
            rows.append({"rank": row.rank, "host": row.host, "start": row.start - origin,
                         "end": row.end - origin, "segments": segments, "totals": row.totals})
        collectives = [{"name": c.name, "group": c.group, "seq": c.seq, "last": c.last_rank,
                        "arrivals": {str(r): round(t - origin) for r, t in c.arrivals.items()},
                        "waits": {str(r): round(w) for r, w in c.waits.items()}}
                       for c in timeline.collectives[:MAX_VIEW_COLLECTIVES]]
        return {"kinds": list(KINDS), "colors": KIND_COLORS, "span": timeline.end - origin,
                "rows": rows, "collectives": collectives,
                "summary": self.table(), "straggler": self.straggler}

    def view(self) -> Any:
        """The interactive view (an anywidget): zoom with the wheel, drag to pan, hover a
        collective to see who waited for whom."""
        from nbdist.profiler.view import ProfileView

        return ProfileView(self.view_data())

    def _ipython_display_(self) -> None:
        """Two outputs: the static SVG and table (what stays readable once the kernel is gone),
        then the live view, which hides that static output while it is shown."""
        from IPython.display import display

        display(self.static_bundle(), raw=True)
        display(self.view())


def build_report(captures: Sequence[dict[str, Any]], missing: dict[int, str] | None = None,
                 trace_path: str | os.PathLike[str] | None = None) -> ProfileReport:
    """Merge the ranks' captures (from nbdist.worker.profiling) into one report; with
    `trace_path`, also write the Chrome/Perfetto trace there."""
    captures, offsets = align_clocks(captures)
    timeline = build_timeline(captures)
    timeline.clock_offsets = offsets
    summary = summarize(timeline, [c.get("top_operators", []) for c in captures])
    report = ProfileReport(timeline, summary, missing=dict(missing or {}))
    if trace_path is not None:
        report.write_trace(trace_path)
    return report
