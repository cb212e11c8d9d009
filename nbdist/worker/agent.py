"""The rank's telemetry thread: every few hundred ms it publishes what providers report.

Providers are plain callables registered by key (``"memory"``, ``"metrics"``, ``"where"``); each
returns something picklable or ``None`` (nothing new). The payload travels to the notebook as an
ipyparallel ``data_message`` under the key ``"nbdist"`` and is attributed to the running cell.
A provider that raises is disabled for that tick and never disturbs the rank's own work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Provider = Callable[[], Any]

TELEMETRY_KEY = "nbdist"


class TelemetryAgent:
    def __init__(self, rank: int, interval: float, publish: Callable[[dict[str, Any]], None]) -> None:
        self.rank = rank
        self.interval = interval
        self._publish = publish
        self._providers: dict[str, Provider] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.cell_running = False
        self.cell_id = 0
        self.seq = 0
        self.provider_errors: dict[str, str] = {}

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
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._thread = None

    def cell_started(self) -> None:
        self.cell_id += 1
        self.cell_running = True
        self.publish_now("cell_start")

    def cell_finished(self) -> None:
        self.cell_running = False
        self.publish_now("cell_end")

    def publish_now(self, reason: str = "tick") -> None:
        """Collect from every provider and publish (from any thread)."""
        payload = self.collect(reason)
        if payload is not None:
            try:
                self._publish({TELEMETRY_KEY: payload})
            except Exception as exc:  # the notebook link is gone or closing: never hurt the rank
                self.provider_errors["publish"] = repr(exc)

    def collect(self, reason: str) -> dict[str, Any] | None:
        with self._lock:
            providers = list(self._providers.items())
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
        self.seq += 1
        payload["seq"] = self.seq
        return payload

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            if self.cell_running:
                self.publish_now("tick")


_AGENT: TelemetryAgent | None = None


def current_agent() -> TelemetryAgent | None:
    """The agent of this rank, or None outside an nbdist engine."""
    return _AGENT


def install_agent(agent: TelemetryAgent) -> TelemetryAgent:
    global _AGENT
    if _AGENT is not None:
        _AGENT.stop()
    _AGENT = agent
    return agent
