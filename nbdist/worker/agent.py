"""The rank's telemetry thread: every few hundred ms it publishes what providers report.

Providers are plain callables registered by key (``"memory"``, ``"metrics"``, ``"where"``); each
returns something picklable or ``None`` (nothing new). The payload travels to the notebook as an
ipyparallel ``data_message`` under the key ``"nbdist"`` and is attributed to the running cell.
A provider that raises is disabled for that tick and never disturbs the rank's own work.
``nbdist.log`` sets :attr:`TelemetryAgent.wake` so logged metrics leave within ``log_spacing``
(a light ``"log"`` payload: metrics only) instead of waiting for the next tick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nbdist.config import InternalConfig, TelemetryConfig

Provider = Callable[[], Any]

TELEMETRY_KEY = "nbdist"

LOG_SPACING = InternalConfig.telemetry_log_spacing
"""The default least spacing of publishes prompted by ``log()``: a fast loop's records go out in
batches (≤ 10 light payloads/s per rank, each ≈ 1 ms of CPU in the controller and the notebook)
while a logged value still reaches the widget well within B6's 250 ms (the widget syncs at 5 Hz)."""


LOG_KEYS = ("metrics", "timing")
"""What a light payload, prompted by ``log()`` or an optimizer step, carries."""


class TelemetryAgent:
    def __init__(
        self,
        rank: int,
        interval: float,
        publish: Callable[[dict[str, Any]], None],
        log_spacing: float = LOG_SPACING,
        start_delay: float = InternalConfig.telemetry_start_delay,
        collective_interval: float = TelemetryConfig.collective_report_interval,
    ) -> None:
        self.rank = rank
        self.interval = interval
        self.log_spacing = min(log_spacing, interval)
        self.start_delay = start_delay
        self.collective_interval = collective_interval
        self.blocked_since: Callable[[], float | None] | None = None
        """When the rank's main thread entered the collective it still waits in (time.time()),
        or None; while it waits, "where" is reported every `collective_interval` so that the
        notebook knows within that time that a peer's failure leaves this rank blocked."""
        self._publish = publish
        self._providers: dict[str, Provider] = {}
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self.wake = threading.Event()
        """Set by ``nbdist.log`` (metrics are waiting) and by :meth:`stop`; the thread then
        publishes the metrics once ``log_spacing`` has passed since its last publish."""
        self._last_publish = 0.0
        self._start_payload: dict[str, Any] | None = None
        self._start_due: float | None = None
        self._thread: threading.Thread | None = None
        self.cell_running = False
        self.cell_id = 0
        self.seq = 0
        self.provider_errors: dict[str, str] = {}
        self.on_cell_start: list[Callable[[], None]] = []
        """Called on the main thread as each cell starts (step timing forgets the gap between
        cells); one that raises is recorded in ``provider_errors``."""

    def register(self, key: str, provider: Provider) -> None:
        with self._lock:
            self._providers[key] = provider

    def unregister(self, key: str) -> None:
        with self._lock:
            self._providers.pop(key, None)

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nbdist-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._thread = None

    def cell_started(self) -> None:
        self.cell_id += 1
        self.cell_running = True
        for callback in list(self.on_cell_start):
            try:
                callback()
            except Exception as exc:
                self.provider_errors["cell_start"] = repr(exc)
        # the start sample is taken now (it resets the cell's peak) but sent by the thread only
        # if the cell still runs start_delay later: a short cell then costs one message (its
        # cell_end payload says everything), not two -- about 2 ms of every no-op cell
        payload = self.collect("cell_start", only=("memory",))
        with self._publish_lock:
            self._start_payload = payload
            self._start_due = time.monotonic() + self.start_delay
        self.wake.set()

    def cell_finished(self) -> None:
        with self._publish_lock:
            self._start_payload = None
            self._start_due = None
        self.cell_running = False
        self.publish_now("cell_end")

    def _send_start(self) -> None:
        with self._publish_lock:
            payload, self._start_payload, self._start_due = self._start_payload, None, None
            if payload is not None and self.cell_running and payload.get("cell") == self.cell_id:
                self._send(payload)

    def publish_now(self, reason: str = "tick", only: tuple[str, ...] | None = None) -> None:
        """Collect from every provider (or the ``only`` ones) and publish (from any thread)."""
        # one publish at a time: the cell_end payload (main thread) and a log payload (this
        # thread) must leave in the order they drained the records, or a loss line would break
        with self._publish_lock:
            payload = self.collect(reason, only)
            if payload is not None:
                self._send(payload)

    def send(self, payload: dict[str, Any]) -> None:
        """Publish a payload no provider made (a breakpoint's prompt), from any thread."""
        with self._publish_lock:
            self._send(payload)

    def _send(self, payload: dict[str, Any]) -> None:
        """Publish one payload; the caller holds ``_publish_lock``."""
        self._last_publish = time.monotonic()
        try:
            self._publish({TELEMETRY_KEY: payload})
        except Exception as exc:  # the notebook link is gone or closing: never hurt the rank
            self.provider_errors["publish"] = repr(exc)

    def collect(self, reason: str, only: tuple[str, ...] | None = None) -> dict[str, Any] | None:
        """The payload of every provider's answer; with ``only``, None when those had nothing."""
        with self._lock:
            providers = [(key, provider) for key, provider in self._providers.items()
                         if only is None or key in only]
        payload: dict[str, Any] = {
            "rank": self.rank,
            "t": time.time(),
            "reason": reason,
            "state": "running" if self.cell_running else "idle",
            "cell": self.cell_id,
        }
        for key, provider in providers:
            try:
                value = provider()
            except Exception as exc:
                self.provider_errors[key] = repr(exc)
                continue
            if value is not None:
                payload[key] = value
        if only is not None and not any(key in payload for key in only):
            return None
        self.seq += 1
        payload["seq"] = self.seq
        return payload

    def _loop(self) -> None:
        next_tick = time.monotonic() + self.interval
        while not self._stop.is_set():
            start_due = self._start_due
            due = next_tick if start_due is None else min(next_tick, start_due)
            if self.cell_running and self.blocked_since is not None:
                due = min(due, time.monotonic() + self.collective_interval)
            woken = self.wake.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                break
            now = time.monotonic()
            # cell_started wakes us so that the wait includes its start payload; that wake goes
            # down the log() path below, which sends nothing when no metrics are waiting (and
            # so can never swallow a log() that came in meanwhile)
            start_due = self._start_due
            if start_due is not None and now >= start_due:
                self._send_start()
                if not woken and now < next_tick:
                    continue
            if woken and now < next_tick:
                # log() asked: hold back until log_spacing has passed since the last publish so
                # that a fast loop sends one batch rather than one message per step
                delay = self._last_publish + self.log_spacing - now
                if delay > 0 and self._stop.wait(delay):
                    break
                self.wake.clear()
                if self.cell_running:
                    self.publish_now("log", only=LOG_KEYS)
                # a wake outside a cell (nothing is sent) still counts, so it cannot spin
                self._last_publish = max(self._last_publish, time.monotonic())
                continue
            if now < next_tick:
                self._report_if_blocked(now)
                continue
            self.wake.clear()
            next_tick = now + self.interval
            if self.cell_running:
                self.publish_now("tick")


    def _report_if_blocked(self, now: float) -> None:
        """Between ticks: a light "where" payload while the rank waits inside a collective."""
        since = self.blocked_since() if self.cell_running and self.blocked_since else None
        if since is None or time.time() - since < self.collective_interval:
            return
        if now - self._last_publish >= self.collective_interval:
            self.publish_now("collective", only=("where",))


_AGENT: TelemetryAgent | None = None


def install_agent(agent: TelemetryAgent) -> TelemetryAgent:
    """Make `agent` this rank's one telemetry thread, stopping the one a previous bootstrap left."""
    global _AGENT
    if _AGENT is not None:
        _AGENT.stop()
    _AGENT = agent
    return agent
