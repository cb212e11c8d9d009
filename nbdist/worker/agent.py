"""The rank's telemetry thread: what its providers report (``"memory"``, ``"where"``...; None:
nothing new) goes out as a `Telemetry` message, attributed to the running cell."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from nbdist.config import InternalConfig, TelemetryConfig
from nbdist.protocol.wire import TELEMETRY_KEY
from nbdist.worker.thread_device import bind_thread, cuda_index

Provider = Callable[[], Any]

# the least spacing of payloads prompted by log(): a fast loop's records go out in batches
LOG_SPACING = InternalConfig.telemetry_log_spacing

LOG_KEYS = ("metrics", "timing")  # what a light payload, prompted by log() or a step, carries


class TelemetryAgent:
    def __init__(self, rank: int, interval: float, publish: Callable[[dict[str, Any]], None],
                 log_spacing: float = LOG_SPACING,
                 start_delay: float = InternalConfig.telemetry_start_delay,
                 collective_interval: float = TelemetryConfig.collective_report_interval,
                 device: Any = None) -> None:
        self.rank = rank
        # resolved here, on the main thread: "cuda" alone means its current device
        self.device_index = cuda_index(device)
        self.interval = interval
        self.log_spacing = min(log_spacing, interval)
        self.start_delay = start_delay
        self.collective_interval = collective_interval
        # when the main thread entered the collective it waits in, or None; while it waits,
        # "where" goes out every `collective_interval`, so the notebook soon knows
        self.blocked_since: Callable[[], float | None] | None = None
        self._publish = publish
        self._providers: dict[str, Provider] = {}
        self._publish_lock = threading.RLock()
        self._stop = threading.Event()
        self.wake = threading.Event()  # set by log() and optimizer steps
        self._last_publish = 0.0
        self._start: tuple[float, dict[str, Any]] | None = None  # (due, payload)
        self._thread: threading.Thread | None = None
        self.cell_running = False
        self.cell_id = 0

    def register(self, key: str, provider: Provider) -> None:
        self._providers[key] = provider

    def unregister(self, key: str) -> None:
        self._providers.pop(key, None)

    def start(self) -> None:
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
        # the start sample is taken now (it resets the cell's peak) but sent only if the cell
        # still runs start_delay later: a short cell costs one message, its cell_end payload
        payload = self.collect("cell_start", only=("memory",))
        due = time.monotonic() + self.start_delay
        with self._publish_lock:
            self._start = None if payload is None else (due, payload)
        self.wake.set()

    def cell_finished(self) -> None:
        with self._publish_lock:
            self._start = None
        self.cell_running = False
        self.publish_now("cell_end")

    def publish_now(self, reason: str = "tick", only: tuple[str, ...] | None = None) -> None:
        """Collect from every provider (or the ``only`` ones) and publish (from any thread)."""
        # one at a time: a cell_end payload (main thread) and a log payload (this thread) must
        # leave in the order they drained the records
        with self._publish_lock:
            payload = self.collect(reason, only)
            if payload is not None:
                self.send(payload)

    def send(self, payload: dict[str, Any]) -> None:
        """Publish a payload (one no provider made: a breakpoint's prompt), from any thread."""
        with self._publish_lock, contextlib.suppress(Exception):  # the notebook link is gone
            self._last_publish = time.monotonic()
            self._publish({TELEMETRY_KEY: payload})

    def collect(self, reason: str, only: tuple[str, ...] | None = None) -> dict[str, Any] | None:
        """The payload of every provider's answer; with ``only``, None when those had nothing."""
        bind_thread(self.device_index)  # this thread's CUDA calls on the rank's device
        payload: dict[str, Any] = {
            "rank": self.rank, "t": time.time(), "reason": reason, "cell": self.cell_id,
            "state": "running" if self.cell_running else "idle",
        }
        for key, provider in list(self._providers.items()):
            if only is None or key in only:
                try:
                    value = provider()
                except Exception:  # skipped this time: it never disturbs the rank's own work
                    continue
                if value is not None:
                    payload[key] = value
        if only is not None and not any(key in payload for key in only):
            return None
        return payload

    def _loop(self) -> None:
        """Each when due: ticks, a cell's start payload, log() batches, reports while blocked."""
        bind_thread(self.device_index)
        next_tick = time.monotonic() + self.interval
        while not self._stop.is_set():
            start = self._start
            due = min(next_tick, start[0] if start else math.inf)
            if self.cell_running and self.blocked_since is not None:
                due = min(due, time.monotonic() + self.collective_interval)
            woken = self.wake.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                break
            now = time.monotonic()
            with self._publish_lock:  # under the lock: a cell_finished meanwhile dropped it
                start = self._start
                if start and now >= start[0]:
                    self._start = None
                    self.send(start[1])
            if now >= next_tick:
                self.wake.clear()
                next_tick = now + self.interval
                if self.cell_running:
                    self.publish_now("tick")
            elif woken:  # log(): a fast loop sends a batch per log_spacing, not a message per step
                delay = self._last_publish + self.log_spacing - now
                if delay > 0 and self._stop.wait(delay):
                    break
                self.wake.clear()
                if self.cell_running:  # cell_started's wake too: sends nothing when none waits
                    self.publish_now("log", only=LOG_KEYS)
                # a wake outside a cell (nothing is sent) still counts, so it cannot spin
                self._last_publish = max(self._last_publish, time.monotonic())
            else:  # a light "where" payload while the rank waits inside a collective
                since = self.blocked_since() if self.cell_running and self.blocked_since else None
                interval = self.collective_interval
                if (since is not None and time.time() - since >= interval
                        and now - self._last_publish >= interval):
                    self.publish_now("collective", only=("where",))
