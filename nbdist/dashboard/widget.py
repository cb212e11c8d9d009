"""The live dashboard widget: a TelemetryHub listener that pushes a downsampled view to the browser.

Thin on purpose: data handling is in ``model.py``, the static SVG in ``svg.py``, drawing in
``dashboard.js``. At cell end its output is replaced by the static SVG (see ``finalize``).
"""

from __future__ import annotations

import base64
import html
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from nbdist.dashboard.model import DashboardConfig, DashboardModel
from nbdist.dashboard.svg import format_number, render_svg
from nbdist.text import format_bytes

_HERE = Path(__file__).parent


class Dashboard(anywidget.AnyWidget):
    """Per-rank memory, metrics and state, live while a cell runs; history kept across cells.

    ``Dashboard(ranks)`` then ``hub.subscribe(dashboard)``; ``dashboard.show()`` (or ``display``)
    puts it under the current cell, live, and ``dashboard.finalize()`` at cell end replaces that
    output with the final static SVG, which is what saved and exported notebooks show.
    """

    _esm = _HERE / "dashboard.js"
    _css = _HERE / "dashboard.css"

    view = traitlets.Dict().tag(sync=True)
    """JSON part of what the browser draws (see ``DashboardModel.build_view``)."""
    points = traitlets.Bytes(b"").tag(sync=True)
    """float32 (x, y) pairs of every downsampled line, sent as one binary buffer."""
    metric = traitlets.Unicode("").tag(sync=True)
    """Metric plotted against step ("" = loss, else the first logged)."""
    log_scale = traitlets.Bool(False).tag(sync=True)
    """Logarithmic y axis for the metric chart."""
    theme = traitlets.Unicode("auto").tag(sync=True)
    """"auto" follows JupyterLab's theme; "light" or "dark" force one."""
    title = traitlets.Unicode("nbdist").tag(sync=True)

    def __init__(
        self,
        ranks: int = 0,
        config: DashboardConfig | None = None,
        *,
        stale_after: float | None = None,
        title: str = "nbdist",
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> None:
        config = config or DashboardConfig()
        if stale_after is not None:
            config.stale_after = stale_after
        super().__init__(title=title, **kwargs)
        self.model = DashboardModel(ranks, config, clock=clock)
        self.config = config
        self._clock = clock
        self._last_sync = -float("inf")
        self._dirty = False
        self._handles: list[Any] = []
        self.syncs = 0
        self.sync_seconds: deque[float] = deque(maxlen=1000)
        """Kernel time spent building and sending each sync (downsampling included)."""
        self.log_latency: deque[float] = deque(maxlen=100_000)
        """Seconds from a rank's ``log()`` to the value being set on this widget's model (B6)."""
        self.errors: list[str] = []
        # the model is fed on the main thread and may be flushed by the trailing-edge thread
        self._lock = threading.RLock()
        self._flusher: threading.Thread | None = None
        self._kick = threading.Event()
        self._closing = threading.Event()
        self._sync_now()

    # -- TelemetryListener ---------------------------------------------------------------------
    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
        try:
            with self._lock:
                self.model.ingest(rank, payload)
            self.sync()
        except Exception as exc:  # the hub also guards, but keep our own record of what broke
            self._record_error(exc)

    def on_rank_state(self, rank: int, state: str, detail: str = "") -> None:
        try:
            with self._lock:
                self.model.set_rank_state(rank, state, detail)
            self.sync(force=True)  # a death is news: do not wait for the throttle
        except Exception as exc:
            self._record_error(exc)

    def attach(self, hub: Any) -> Dashboard:
        """Subscribe to a TelemetryHub and replay its last payload per rank.

        A dashboard created *from inside* a hub callback (the first payload with metrics) would
        otherwise miss that very payload: the hub had already listed its listeners.
        """
        hub.subscribe(self)
        for rank, payload in sorted(dict(getattr(hub, "last_payload", {})).items()):
            self.on_telemetry(rank, payload)
        return self

    # -- pushing to the browser ----------------------------------------------------------------
    def sync(self, force: bool = False) -> bool:
        """Push the current view unless one went out less than ``sync_interval`` ago.

        A held-back update is pushed by a small trailing-edge thread once the interval has
        passed: ranks tick in phase, so the second rank of a burst would otherwise wait a whole
        telemetry interval for the next payload.
        """
        if not force and self._clock() - self._last_sync < self.config.sync_interval:
            self._dirty = True
            self._ensure_flusher()
            return False
        self._sync_now()
        return True

    def flush(self) -> None:
        """Push what is pending (the throttle may have held back the last update)."""
        if self._dirty:
            self._sync_now()

    def _sync_now(self) -> None:
        with self._lock:
            started = time.perf_counter()
            view, points = self.model.build_view()
            with self.hold_sync():  # one comm message for both traits
                self.points = points
                self.view = view
            wall = time.time()
            pending = self.model.pending_log_times
            if pending:
                self.log_latency.extend(wall - t for t in pending)
                pending.clear()
            self._last_sync = self._clock()
            self._dirty = False
            self.syncs += 1
            self.sync_seconds.append(time.perf_counter() - started)

    def _ensure_flusher(self) -> None:
        self._kick.set()
        with self._lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._flusher = threading.Thread(
                target=self._flush_loop, name="nbdist-dashboard-flush", daemon=True
            )
            self._flusher.start()

    def _flush_loop(self) -> None:
        # ipykernel's IOPub socket is thread-safe, so a comm update may leave from here. The thread
        # wakes when an update is held back and sleeps exactly until it is due (polling would add
        # up to a poll period to every value's latency); it ends after a few idle seconds so that
        # no thread outlives the cells that feed it.
        interval = self.config.sync_interval
        while not self._closing.is_set():
            if not self._kick.wait(3.0):
                with self._lock:  # _ensure_flusher sets the kick first, then looks at this thread
                    if not self._kick.is_set():
                        self._flusher = None
                        return
                continue
            self._kick.clear()
            due = self._last_sync + interval - self._clock()
            if due > 0 and self._closing.wait(min(due, interval)):
                return
            if self._dirty:
                try:
                    self._sync_now()
                except Exception as exc:
                    self._record_error(exc)

    def close(self) -> None:
        self._closing.set()
        self._kick.set()
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join(timeout=2)
        super().close()

    def _record_error(self, exc: BaseException) -> None:
        if len(self.errors) < 20:
            self.errors.append(repr(exc))
        if len(self.errors) == 1:
            print(f"nbdist: dashboard update failed ({exc!r}); the cell goes on", file=sys.stderr)

    # -- display -------------------------------------------------------------------------------
    def svg(self) -> str:
        """The static rendering (what a saved or exported notebook shows)."""
        return render_svg(
            self.model, self.metric or None, self.log_scale, title=f"{self.title} dashboard"
        )

    def summary(self) -> str:
        parts = []
        for rank in self.model.ranks:
            info = self.model.rank_summary(rank)
            loss = next(iter(info["last"].items()), None)
            memory = (info["memory"] or {}).get("allocated")
            metric = f" {loss[0]}={format_number(loss[1])}" if loss else ""
            parts.append(f"rank {rank}: {info['state']}{metric} mem={format_bytes(memory)}")
        return f"nbdist dashboard ({len(parts)} ranks) " + "; ".join(parts)

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        data = dict(data)
        data["text/plain"] = self.summary()
        try:
            data["image/svg+xml"] = self.svg()
        except Exception as exc:  # a broken static copy must not hide the live widget
            self._record_error(exc)
        return data, metadata

    def _ipython_display_(self) -> None:
        self.show()

    def show(self) -> Any:
        """Display under the current cell and remember the output so ``finalize`` can refresh it."""
        from IPython.display import display

        self.flush()
        data, metadata = self._repr_mimebundle_()  # type: ignore[misc]
        handle = display(data, metadata=metadata, raw=True, display_id=True)
        if handle is not None:
            self._handles.append(handle)
        return handle

    def finalize(self) -> None:
        """At cell end: push the last values and replace this cell's live output(s) by the static
        bundle (``static_bundle``); the model lives on, so the next cell or ``%dist_dashboard``
        shows it live again with the whole history.

        Outputs displayed in earlier cells keep the snapshot taken when their own cell ended.
        """
        try:
            with self._lock:
                self.model.cell_finished()
            self._sync_now()
            if not self._handles:
                return
            data = self.static_bundle()
            for handle in self._handles:
                handle.update(data, metadata={}, raw=True)
            self._handles.clear()
        except Exception as exc:
            self._record_error(exc)

    def static_bundle(self) -> dict[str, Any]:
        """The finished cell's output: the final charts, with no widget view left in it.

        JupyterLab draws a widget-view output only through a live model (restored from notebook
        metadata only when a kernel is up) and never falls back to the bundle's other types, so a
        saved output that kept the view showed "Error displaying widget: model not found" or
        "Loading widget..." instead of the SVG. ``text/html`` carries the SVG as an ``<img>``:
        it is the one rich type JupyterLab shows in an untrusted notebook (every notebook executed
        elsewhere, e.g. by nbclient), and its sanitizer drops inline ``<svg>`` but keeps ``<img>``.
        """
        summary = self.summary()
        data: dict[str, Any] = {"text/plain": summary}
        try:
            svg = self.svg()
        except Exception as exc:
            self._record_error(exc)
            return data
        encoded = base64.b64encode(svg.encode()).decode("ascii")
        data["image/svg+xml"] = svg
        data["text/html"] = (
            f'<img class="nbdist-static-img" alt="{html.escape(summary)}" '
            f'style="max-width:100%;height:auto" src="data:image/svg+xml;base64,{encoded}">'
        )
        return data
