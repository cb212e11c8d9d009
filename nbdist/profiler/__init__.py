"""Cross-rank profiles: merge each rank's torch.profiler capture into one timeline (collectives
matched across ranks, compute / communication / wait told apart), summarize it, and show it as
a text table, a static SVG, an interactive view or a Chrome/Perfetto trace. Knows nothing of the
cluster: it works on the plain dicts `nbdist.worker.profiling` exports."""

from __future__ import annotations

from nbdist.profiler.report import ProfileReport, build_report
from nbdist.profiler.summary import ProfileSummary, Straggler
from nbdist.profiler.timeline import Collective, Timeline, build_timeline

__all__ = ["Collective", "ProfileReport", "ProfileSummary", "Straggler", "Timeline",
           "build_report", "build_timeline"]
