"""Rank telemetry fanned out to listeners (dashboards, tests); one that raises is reported once
and never breaks a cell. `last_payload` keeps each rank's last full payload (fault reports)."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class TelemetryListener(Protocol):
    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None: ...

    def on_rank_state(self, rank: int, state: str, detail: str) -> None: ...


class TelemetryHub:
    def __init__(self) -> None:
        self._listeners: list[TelemetryListener] = []
        self._reported: set[tuple[int, str]] = set()
        self.last_payload: dict[int, dict[str, Any]] = {}
        self.cell_has_metrics = False

    def subscribe(self, listener: TelemetryListener) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)

    def unsubscribe(self, listener: TelemetryListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def publish(self, rank: int, payload: dict[str, Any]) -> None:
        previous = self.last_payload.get(rank)
        reason = payload.get("reason")
        if reason == "log" and previous is not None:
            # metrics only: keep the last memory and "where", and the time that says how fresh
            # that "where" is (nbdist.cells.policy relies on it)
            self.last_payload[rank] = {**previous, **payload, "t": previous.get("t")}
        elif reason in ("collective", "asked") and previous is not None:
            # "where" only, taken now: keep the last memory and metrics
            self.last_payload[rank] = {**previous, **payload}
        else:
            self.last_payload[rank] = payload
        if payload.get("metrics"):
            self.cell_has_metrics = True
        for listener in list(self._listeners):
            self._call(listener, "on_telemetry", rank, payload)

    def rank_state(self, rank: int, state: str, detail: str = "") -> None:
        for listener in list(self._listeners):
            self._call(listener, "on_rank_state", rank, state, detail)

    def _call(self, listener: TelemetryListener, method: str, *args: Any) -> None:
        try:
            getattr(listener, method)(*args)
        except Exception as exc:
            key = (id(listener), method)
            if key not in self._reported:
                self._reported.add(key)
                print(f"nbdist: dashboard listener failed ({exc!r}); the cell goes on",
                      file=sys.stderr)
