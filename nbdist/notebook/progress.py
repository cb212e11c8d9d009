"""Progress bars from the ranks (tqdm and anything else that redraws a line with ``\\r``) shown as
displays updated in place, instead of one printed line per redraw: one per rank (`ProgressBars`),
or, on many ranks, one per loop for all of them (`AggregatedBars`: the slowest rank and the mean).

A line is a bar while its text holds a ``\\r``: what follows the last one is what a terminal would
show. The first redraw displays it (``display_id``), later ones update that display at most every
``min_interval`` seconds, and the bar's closing newline leaves its final text there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Hashable
from typing import Any

from nbdist.cluster.ranks import format_ranks

Show = Callable[[str], Any]
"""Display a text once and return a handle with ``update(text)``, or None (no frontend)."""

Key = tuple[int, str]
"""(rank, stream name)."""

_COUNT = re.compile(r"(\d+)/(\d+)")  # tqdm's "45/100"
_LISTED = 8
"""Ranks listed one per line in an aggregated bar whose texts hold no count."""


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
    """The live bars of one cell, one display per key (by default (rank, stream))."""

    def __init__(self, show: Show, min_interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._show = show
        self.min_interval = min_interval
        self._clock = clock
        self._bars: dict[Hashable, _Bar] = {}
        self.updates = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._bars

    def redraw(self, key: Hashable, text: str) -> bool:
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

    def finish(self, key: Hashable, text: str | None = None) -> None:
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


class AggregatedBars:
    """Every rank's bar of one loop in one display: each rank's n-th bar on a stream is the
    n-th loop's, and the display names the slowest rank and the mean progress."""

    def __init__(self, show: Show, ranks: int, min_interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._displays = ProgressBars(show, min_interval, clock)
        self.ranks = ranks
        self._loop: dict[Key, int] = {}  # (rank, stream) -> the loop its current bar belongs to
        self._active: set[Key] = set()
        self._texts: dict[tuple[str, int], dict[int, str]] = {}
        self._finished: dict[tuple[str, int], set[int]] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self._active

    def redraw(self, key: Key, text: str) -> bool:
        loop = self._group(key)
        self._texts[loop][key[0]] = text
        shown = self._displays.redraw(loop, self._render(loop))
        if shown:
            self._active.add(key)
        return shown

    def finish(self, key: Key, text: str | None = None) -> None:
        if key not in self._active:
            return
        loop = self._group(key)
        if text:
            self._texts[loop][key[0]] = text
        self._finished[loop].add(key[0])
        self._active.discard(key)
        self._loop[key] = loop[1] + 1
        if len(self._finished[loop]) >= self.ranks:
            self._displays.finish(loop, self._render(loop))
        else:
            self._displays.redraw(loop, self._render(loop))

    def finish_all(self) -> None:
        for key in list(self._active):
            self.finish(key)
        self._displays.finish_all()

    def _group(self, key: Key) -> tuple[str, int]:
        loop = (key[1], self._loop.get(key, 0))
        self._texts.setdefault(loop, {})
        self._finished.setdefault(loop, set())
        return loop

    def _render(self, loop: tuple[str, int]) -> str:
        return render_loop(self._texts[loop], self._finished[loop], self.ranks)


def render_loop(texts: dict[int, str], finished: set[int], ranks: int) -> str:
    """One loop's bars as text: the slowest rank's bar under a line with the mean; or, when the
    bars show no count (n/total), the first ranks' texts."""
    counts = {rank: _count(text) for rank, text in texts.items()}
    who = format_ranks(sorted(texts))
    done = f"{len(finished)} of {ranks} ranks done"
    if all(count is not None for count in counts.values()):
        fraction = {rank: count[0] / count[1] if count[1] else 1.0
                    for rank, count in counts.items() if count is not None}
        slowest = min(sorted(fraction), key=fraction.__getitem__)
        mean = sum(fraction.values()) / len(fraction)
        return (f"[ranks {who}] slowest rank {slowest}, mean {mean:.0%}, {done}\n"
                f"[rank {slowest}] {texts[slowest]}")
    listed = [f"[rank {rank}] {texts[rank]}" for rank in sorted(texts)[:_LISTED]]
    if len(texts) > _LISTED:
        listed.append(f"... and {len(texts) - _LISTED} more ranks")
    return "\n".join([f"[ranks {who}] {done}", *listed])


def _count(text: str) -> tuple[int, int] | None:
    match = _COUNT.search(text)
    return None if match is None else (int(match.group(1)), int(match.group(2)))
