"""Progress bars from the ranks (tqdm and anything else that redraws a line with ``\\r``) shown as
one output per rank, updated in place, instead of one printed line per redraw.

A line is a bar while its text holds a ``\\r``: what follows the last one is what a terminal would
show. The first redraw displays it (``display_id``), later ones update that display at most every
``min_interval`` seconds, and the bar's closing newline leaves its final text there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Show = Callable[[str], Any]
"""Display a text once and return a handle with ``update(text)``, or None (no frontend)."""


def visible_text(line: str) -> str:
    """What a terminal shows of a line redrawn with carriage returns (the last non-empty part)."""
    parts = [part for part in line.split("\r") if part]
    return parts[-1] if parts else ""


class _Bar:
    __slots__ = ("handle", "shown_at", "text", "shown_text")

    def __init__(self, handle: Any, now: float, text: str) -> None:
        self.handle = handle
        self.shown_at = now
        self.text = text
        self.shown_text = text


class ProgressBars:
    """The live bars of one cell, by (rank, stream)."""

    def __init__(self, show: Show, min_interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._show = show
        self.min_interval = min_interval
        self._clock = clock
        self._bars: dict[tuple[int, str], _Bar] = {}
        self.updates = 0

    def __contains__(self, key: tuple[int, str]) -> bool:
        return key in self._bars

    def redraw(self, key: tuple[int, str], text: str) -> bool:
        """The bar's current text; False when there is no frontend to show it in."""
        now = self._clock()
        bar = self._bars.get(key)
        if bar is None:
            handle = self._show(text)
            if handle is None:
                return False
            self._bars[key] = _Bar(handle, now, text)
            return True
        bar.text = text
        if now - bar.shown_at >= self.min_interval:
            self._update(bar, now)
        return True

    def finish(self, key: tuple[int, str], text: str | None = None) -> None:
        """The bar's line ended: leave its final text shown and forget it."""
        bar = self._bars.pop(key, None)
        if bar is None:
            return
        if text:
            bar.text = text
        self._update(bar, self._clock())

    def finish_all(self) -> None:
        for key in list(self._bars):
            self.finish(key)

    def _update(self, bar: _Bar, now: float) -> None:
        if bar.text != bar.shown_text:
            bar.handle.update(bar.text)
            bar.shown_text = bar.text
            self.updates += 1
        bar.shown_at = now
