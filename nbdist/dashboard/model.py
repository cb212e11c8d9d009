"""The dashboard's data model: per-rank history, states and steps/s, and the downsampled view.

Pure Python + NumPy (no widgets, no IPython) so it is unit-tested directly; the widget feeds it
telemetry payloads and ships :meth:`DashboardModel.build_view` to the browser a few times a second.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nbdist.colors import PALETTE_DARK, PALETTE_LIGHT, rank_color
from nbdist.dashboard.series import Series
from nbdist.dashboard.stragglers import StragglerConfig, StragglerView


@dataclass
class DashboardConfig:
    stale_after: float = 5.0
    """Stale: a running rank silent this long (no telemetry, or no ``log()`` once it logs)."""

    stale_log_factor: float = 4.0
    """...or silent for this many times its usual interval between logs, if that is longer."""

    sync_interval: float = 0.2
    """Minimum seconds between two pushes to the browser (at most 5 model syncs per second)."""

    points_per_series: int = 500
    """Most points one line carries to the browser (min/max per bucket keeps spikes visible)."""

    point_budget: int = 24_000
    """Most points per sync over all lines; lines get fewer points when there are many."""

    svg_points_per_series: int = 240
    """Points per line in the static SVG (its size is what a saved notebook stores)."""

    history_limit: int = 100_000
    """Points kept per line in the kernel; past it, the older half is thinned by two. Bounds the
    kernel's memory on long runs (1.6 MB per line; 30 minutes of log() at 100 Hz is 180,000
    points) while the view, 500 points per line, never needs more."""

    rate_window: float = 10.0
    """Seconds of recent ``log()`` records over which steps/s is computed."""

    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """When a rank counts as the one the others wait for (``stragglers.py``)."""


@dataclass
class RankStatus:
    state: str
    detail: str
    age: float | None
    """Seconds since the last telemetry of this rank (None: never heard from)."""


class _RankHistory:
    def __init__(self, rank: int, history_limit: int) -> None:
        self.rank = rank
        self.history_limit = history_limit
        self.metrics: dict[str, Series] = {}
        self.memory: dict[str, Series] = {}
        self.last_memory: dict[str, Any] | None = None
        self.last_payload_at: float | None = None
        self.last_log_at: float | None = None
        self.log_intervals: deque[float] = deque(maxlen=16)
        self.reported_state = "waiting"
        self.cell = 0
        self.cell_logged = False
        self.finished_cell = -1
        self.dead: str | None = None
        self.restarts = 0
        self.recent_steps: deque[tuple[float, float]] = deque(maxlen=2048)
        self.last_step: float | None = None
        self.last_values: dict[str, float] = {}
        self.dropped = 0
        self.rejected: dict[str, str] = {}

    def series(self, table: dict[str, Series], name: str) -> Series:
        line = table.get(name)
        if line is None:
            line = table[name] = Series(self.history_limit)
        return line


MEMORY_LINES = ("allocated", "reserved")


class DashboardModel:
    """Everything the dashboard knows; fed by :meth:`ingest` and :meth:`set_rank_state`."""

    def __init__(
        self,
        ranks: int = 0,
        config: DashboardConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or DashboardConfig()
        self.clock = clock
        self.ranks: dict[int, _RankHistory] = {}
        self.t0: float | None = None
        self.cell = 0
        self.revision = 0
        self.payloads = 0
        self.pending_log_times: list[float] = []
        """Rank wall times of records ingested since the widget last synced (B6 latency)."""
        self.stragglers = StragglerView(self.config.stragglers)
        self.ensure_ranks(ranks)

    # -- input ---------------------------------------------------------------------------------
    def ensure_ranks(self, ranks: int) -> None:
        for rank in range(ranks):
            self._rank(rank)

    def _rank(self, rank: int) -> _RankHistory:
        history = self.ranks.get(rank)
        if history is None:
            history = self.ranks[rank] = _RankHistory(rank, self.config.history_limit)
            self.ranks = dict(sorted(self.ranks.items()))
        return history

    def ingest(self, rank: int, payload: dict[str, Any]) -> None:
        """One telemetry payload from ``rank`` (see ``nbdist.worker.agent``)."""
        now = self.clock()
        history = self._rank(int(rank))
        self.payloads += 1
        self.revision += 1
        history.last_payload_at = now
        cell = int(payload.get("cell", history.cell) or 0)
        # a tick of a cell the notebook already saw end (it raced the reply) must not revive it
        if cell > history.finished_cell or payload.get("reason") == "cell_end":
            history.reported_state = str(payload.get("state", history.reported_state))
        if cell != history.cell:
            history.cell = cell
            history.cell_logged = False
            history.last_log_at = None
        self.cell = max(self.cell, cell)
        if payload.get("reason") in ("cell_start", "cell_end"):
            history.dead = None  # a rank that runs a cell is alive (after a restart)
        t = payload.get("t")
        if isinstance(t, int | float) and self.t0 is None:
            self.t0 = float(t)
        memory = payload.get("memory")
        if isinstance(memory, dict):
            self._ingest_memory(history, memory, t)
        metrics = payload.get("metrics")
        if isinstance(metrics, dict):
            self._ingest_metrics(history, metrics, now)
        timing = payload.get("timing")
        if isinstance(timing, dict):
            self.stragglers.ingest(int(rank), timing)

    def _ingest_memory(self, history: _RankHistory, memory: dict[str, Any], t: Any) -> None:
        history.last_memory = memory
        if not isinstance(t, int | float) or self.t0 is None:
            return
        for name in MEMORY_LINES:
            value = memory.get(name)
            if isinstance(value, int | float):
                history.series(history.memory, name).extend([t - self.t0], [value])

    def _ingest_metrics(self, history: _RankHistory, metrics: dict[str, Any], now: float) -> None:
        times = list(metrics.get("t") or [])
        steps = np.asarray(metrics.get("step") or [], dtype=np.float64)
        if steps.size == 0:
            return
        if history.last_log_at is not None:
            history.log_intervals.append(now - history.last_log_at)
        history.last_log_at = now
        history.cell_logged = True
        history.dropped += int(metrics.get("dropped", 0) or 0)
        history.rejected.update(metrics.get("rejected") or {})
        if len(self.pending_log_times) < 100_000:
            self.pending_log_times.extend(times)
        for name, column in (metrics.get("values") or {}).items():
            y = np.array([math.nan if v is None else v for v in column], dtype=np.float64)
            # None means "not logged in this record"; a logged NaN (diverging loss) is kept
            present = np.array([v is not None for v in column], dtype=bool)
            if not present.any():
                continue
            history.series(history.metrics, str(name)).extend(steps[present], y[present])
            last = y[present][-1]
            history.last_values[str(name)] = float(last)
        history.last_step = float(steps[-1])
        for t, step in zip(times, steps.tolist(), strict=False):
            history.recent_steps.append((float(t), float(step)))

    def set_rank_state(self, rank: int, state: str, detail: str = "") -> None:
        history = self._rank(int(rank))
        self.revision += 1
        if state == "dead":
            history.dead = detail or "engine died"
        elif state in ("alive", "restarted"):
            history.dead = None
            if state == "restarted":
                history.restarts += 1
                history.reported_state = "idle"

    def cell_finished(self) -> None:
        """The notebook saw the cell end: every rank still marked running is idle now."""
        self.revision += 1
        for history in self.ranks.values():
            history.finished_cell = max(history.finished_cell, history.cell)
            if history.reported_state == "running":
                history.reported_state = "idle"

    # -- derived -------------------------------------------------------------------------------
    def status(self, rank: int, now: float | None = None) -> RankStatus:
        """running / idle / stale (with seconds) / dead / waiting, as the table shows it."""
        now = self.clock() if now is None else now
        history = self._rank(rank)
        age = None if history.last_payload_at is None else now - history.last_payload_at
        if history.dead is not None:
            return RankStatus("dead", history.dead, age)
        if age is None:
            return RankStatus("waiting", "no telemetry yet", None)
        if history.reported_state != "running":
            return RankStatus("idle", "", age)
        stale_after = self.config.stale_after
        if age > stale_after:
            return RankStatus("stale", f"no telemetry for {age:.0f} s", age)
        silent, limit = self.log_silence(rank, now)
        if silent is not None and silent > limit:
            return RankStatus("stale", f"no log() for {silent:.0f} s", age)
        return RankStatus("running", "", age)

    def log_silence(self, rank: int, now: float | None = None) -> tuple[float | None, float]:
        """Seconds since ``rank`` last logged in this cell (None: it has not) and the stale limit.

        The limit adapts to the rank's own rhythm: a loop that logs every 20 s is not stale at 6 s.
        """
        now = self.clock() if now is None else now
        history = self._rank(rank)
        usual = float(np.median(history.log_intervals)) if history.log_intervals else 0.0
        limit = max(self.config.stale_after, self.config.stale_log_factor * usual)
        if not history.cell_logged or history.last_log_at is None:
            return None, limit
        return now - history.last_log_at, limit

    def steps_per_second(self, rank: int) -> float | None:
        recent = self._rank(rank).recent_steps
        if len(recent) < 2:
            return None
        t_last, step_last = recent[-1]
        t_first, step_first = recent[-1]
        for t, step in reversed(recent):
            if t_last - t > self.config.rate_window or step > step_last:
                break  # older than the window, or before a step restart
            t_first, step_first = t, step
        if t_last - t_first <= 0:
            return None
        return (step_last - step_first) / (t_last - t_first)

    def metric_names(self) -> list[str]:
        names: set[str] = set()
        for history in self.ranks.values():
            names.update(history.metrics)
        # the loss first: it is what people watch
        return sorted(names, key=lambda name: (name != "loss", name))

    def rank_summary(self, rank: int, now: float | None = None,
                     stragglers: dict[str, Any] | None = None) -> dict[str, Any]:
        """One rank's row; `stragglers`: ``self.stragglers.summary`` of every rank, when the
        caller has it already (the view and the SVG build it once for all rows)."""
        history = self._rank(rank)
        status = self.status(rank, now)
        rate = self.steps_per_second(rank)
        silent, silent_limit = self.log_silence(rank, now)
        if stragglers is None:
            stragglers = self.stragglers.summary([rank])
        timing = dict(stragglers["ranks"][rank])
        if timing["step_time"] is None and rate:
            timing["step_time"] = 1.0 / rate  # no optimizer steps seen: from log(step=...)
        return {
            **timing,
            "rank": rank,
            "state": status.state,
            "detail": status.detail,
            "age": status.age,
            "silent": silent,
            "silent_limit": silent_limit,
            "step": history.last_step,
            "steps_per_s": rate,
            "last": dict(history.last_values),
            "memory": dict(history.last_memory) if history.last_memory else None,
            "restarts": history.restarts,
            "dropped": history.dropped,
            "rejected": dict(history.rejected),
        }

    # -- what the browser gets -----------------------------------------------------------------
    def build_view(self, per_series: int | None = None) -> tuple[dict[str, Any], bytes]:
        """A JSON-able description plus one float32 buffer of interleaved (x, y) points.

        ``view["series"]`` lists ``{"chart": "metric"|"memory", "name", "rank", "offset", "count"}``
        in points; NaN pairs in the buffer mark breaks between segments.
        """
        now = self.clock()
        lines: list[tuple[str, str, int, Series]] = []
        for rank, history in self.ranks.items():
            for name, line in history.metrics.items():
                lines.append(("metric", name, rank, line))
            for name, line in history.memory.items():
                lines.append(("memory", name, rank, line))
        if per_series is None:
            per_series = self.config.points_per_series
            if lines:
                per_series = max(16, min(per_series, self.config.point_budget // len(lines)))
        chunks: list[np.ndarray] = []
        series: list[dict[str, Any]] = []
        offset = 0
        for chart, name, rank, line in lines:
            x, y = line.downsampled(per_series)
            pairs = np.empty((x.size, 2), dtype=np.float32)
            pairs[:, 0] = x
            pairs[:, 1] = y
            chunks.append(pairs.reshape(-1))
            series.append(
                {
                    "chart": chart,
                    "name": name,
                    "rank": rank,
                    "offset": offset,
                    "count": int(x.size),
                    "total": line.n,
                }
            )
            offset += int(x.size)
        buffer = np.concatenate(chunks).astype(np.float32).tobytes() if chunks else b""
        stragglers = self.stragglers.summary(list(self.ranks))
        view = {
            "revision": self.revision,
            "cell": self.cell,
            "ranks": [self.rank_summary(rank, now, stragglers) for rank in self.ranks],
            "metrics": self.metric_names(),
            "series": series,
            "points": offset,
            "stale_after": self.config.stale_after,
            "stragglers": stragglers,
            "colors": {"light": list(PALETTE_LIGHT), "dark": list(PALETTE_DARK)},
        }
        return _jsonable(view), buffer

    def color(self, rank: int, theme: str = "light") -> str:
        return rank_color(rank, theme)


def _jsonable(value: Any) -> Any:
    # NaN/inf are not JSON: the browser gets null (the buffer carries the real values)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
