"""Where a running cell's live output goes: the `OutputSink` protocol the notebook implements,
and `NullSink` for callers that only want the returned result."""

from __future__ import annotations

from typing import Any, Protocol


class OutputSink(Protocol):
    """Where live output goes while a cell runs (the magic renders it; tests record it)."""

    def on_stream(self, rank: int, name: str, text: str) -> None: ...

    def on_display(self, rank: int, content: dict[str, Any]) -> None: ...

    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None: ...

    def on_status(self, text: str) -> None: ...


class NullSink:
    shows_status = False  # on_status lines go nowhere: the result must carry them

    def on_stream(self, rank: int, name: str, text: str) -> None:
        pass

    def on_display(self, rank: int, content: dict[str, Any]) -> None:
        pass

    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
        pass

    def on_status(self, text: str) -> None:
        pass
