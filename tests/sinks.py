"""A sink that records what a cell showed, live, as a notebook would have displayed it."""

from __future__ import annotations

from typing import Any


class RecordingSink:
    """Every event in order (`events`: (rank, "stdout"/"stderr"/"display", payload), status lines
    as (-1, "status", text)); `statuses` and `text(rank, name)` read them back."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str, Any]] = []

    def on_stream(self, rank: int, name: str, text: str) -> None:
        self.events.append((rank, name, text))

    def on_display(self, rank: int, content: dict[str, Any]) -> None:
        self.events.append((rank, "display", content))

    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
        pass

    def on_status(self, text: str) -> None:
        self.events.append((-1, "status", text))

    @property
    def statuses(self) -> list[str]:
        return [text for rank, kind, text in self.events if kind == "status"]

    def text(self, rank: int, name: str | None = None) -> str:
        """What one rank streamed (both streams unless `name` says which)."""
        return "".join(t for r, kind, t in self.events
                       if r == rank and (kind == name if name else kind in ("stdout", "stderr")))
