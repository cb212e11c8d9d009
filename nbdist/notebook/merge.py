"""The ranks' streams as lines: `StreamLines` cuts each rank's text into lines (a line redrawn
with ``\\r`` is a progress bar); `LineMerger` shows a line several ranks print alike once, with
its ranks.

Merging keeps each rank's order: a line waits in a group for the same line from the other ranks;
groups leave in the order they were opened, and a rank joins only a group opened after its
previous line's, so no rank's lines ever swap. A group waits `interval` seconds, and up to
`hold_max` for a rank that printed the lines before it alike and could still join it (it has
printed nothing since the group opened): on a busy machine that rank is late, not different.
Lines come in chunks of thousands: both classes work a chunk at a time.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable

from nbdist.notebook.progress import Key, visible_text

Event = tuple[str, "list[str] | str"]
"""("lines", [complete lines]), ("redraw", a bar's current text) or ("done", a bar's last)."""

Merged = tuple[int, str]
"""A line to show: the ranks that printed it (bit r set: rank r) and its text."""


class StreamLines:
    """Each (rank, stream)'s text cut into events, in order (see `Event`)."""

    def __init__(self) -> None:
        self._partial: dict[Key, str] = {}

    def feed(self, key: Key, text: str) -> list[Event]:
        buffered = self._partial.get(key, "") + text
        if "\r" not in buffered:  # no progress bar: the common case, a chunk of plain lines
            *complete, self._partial[key] = buffered.split("\n")
            return [("lines", complete)] if complete else []
        *complete, rest = buffered.replace("\r\n", "\n").split("\n")
        events: list[Event] = []
        for line in complete:
            if "\r" in line:
                events.append(("done", visible_text(line)))
            elif events and events[-1][0] == "lines":
                events[-1][1].append(line)  # type: ignore[union-attr]
            else:
                events.append(("lines", [line]))
        if "\r" in rest:
            visible = visible_text(rest)
            if visible:
                events.append(("redraw", visible))
            # what the next chunk can still change: from the \r before the last text on
            start = rest.rstrip("\r").rfind("\r")
            rest = rest[start:] if start > 0 else rest
        self._partial[key] = rest
        return events

    def flush(self) -> list[tuple[Key, Event]]:
        """Every unfinished line as an event; forgets them."""
        out: list[tuple[Key, Event]] = [
            (key, ("done", visible_text(rest)) if "\r" in rest else ("lines", [rest]))
            for key, rest in self._partial.items() if rest]
        self._partial.clear()
        return out


def ranks_of(mask: int) -> list[int]:
    """The ranks in a mask (bit r set: rank r), in order."""
    ranks = []
    while mask:
        low = mask & -mask
        ranks.append(low.bit_length() - 1)
        mask ^= low
    return ranks


class LineMerger:
    """One stream's complete lines from every rank, merged; `ranks` are those expected to print
    (None: unknown, so every line waits its interval for company, and no longer).

    A group is made for nearly every line, so it is kept small for the garbage collector: a tuple
    (number, text, due time, the bit of the rank that opened it, which line of that rank's it is)
    in `_pending`; once others join, its ranks as the bits of an int in `_masks`."""

    def __init__(self, ranks: Iterable[int] | None, interval: float,
                 hold_max: float | None = None) -> None:
        self.expected = None if ranks is None else sum(1 << rank for rank in set(ranks))
        self.interval = interval
        self._hold = max(0.0, (interval if hold_max is None else hold_max) - interval)
        self._pending: deque[tuple[int, str, float, int, int]] = deque()
        self._masks: dict[int, int] = {}  # group number -> its ranks, one bit each, once joined
        self._by_text: dict[str, int | list[int]] = {}  # the pending groups of each text, in order
        self._latest: dict[int, int] = {}  # rank -> number of the last group it joined
        self._counts: dict[int, int] = {}  # rank -> how many lines it printed
        self._shown_with: dict[int, int] = {}  # a rank's bit -> the ranks of its last line shown
        self._last_shown = 0  # the ranks of the last line shown
        self._opened = 0

    def add(self, rank: int, lines: list[str], now: float) -> None:
        """One rank's complete lines, in the order it printed them."""
        by_text, masks, pending = self._by_text, self._masks, self._pending
        bit, opened, due_at = 1 << rank, self._opened, now + self.interval
        latest, count = self._latest.get(rank, -1), self._counts.get(rank, 0)
        for index, text in enumerate(lines, count):
            same = by_text.get(text)
            if same is None:  # the usual case: no other rank's line waits with this text
                by_text[text] = latest = opened
            elif type(same) is int:
                if same > latest:
                    masks[same] = masks.get(same, 0) | bit
                    latest = same
                    continue
                by_text[text] = [same, opened]
                latest = opened
            else:  # several groups wait with this text: the first after this rank's latest
                if same[-1] <= latest:  # type: ignore[index]
                    same.append(opened)  # type: ignore[union-attr]
                    latest = opened
                else:
                    latest = same[bisect_right(same, latest)]  # type: ignore[arg-type,index]
                    masks[latest] = masks.get(latest, 0) | bit
                    continue
            pending.append((opened, text, due_at, bit, index))
            opened += 1
        self._opened = opened
        self._latest[rank] = latest
        self._counts[rank] = count + len(lines)

    def rank_done(self, rank: int) -> None:
        """The rank prints nothing more: lines no longer wait for it."""
        if self.expected is not None:
            self.expected &= ~(1 << rank)

    def due(self, now: float) -> list[Merged]:
        """The lines to show now: from the oldest group, each that every expected rank joined,
        that has waited `interval` and waits for no late rank (`_late`), or that has waited
        `hold_max`."""
        pending, expected, masks, by_text = self._pending, self.expected, self._masks, self._by_text
        if not pending or expected == 0:
            return self.flush()  # (every rank is done: nothing is waited for)
        out: list[Merged] = []
        shown_with, hold, last_shown = self._shown_with, self._hold, self._last_shown
        while pending:
            number, text, due_at, opener, index = pending[0]
            if now < due_at:
                if expected is None or (masks.get(number, 0) | opener) & expected != expected:
                    break
            elif expected is not None and now < due_at + hold:
                # the ranks its opener's last line was shown with (at first: all) not in it yet
                wanted = shown_with.get(opener, expected) & expected
                wanted &= ~(masks.get(number, 0) | opener)
                if wanted and self._late(number, wanted, index):
                    break
            pending.popleft()
            same = by_text[text]
            if type(same) is int or len(same) == 1:  # type: ignore[arg-type]
                del by_text[text]
            else:  # the oldest group leaves first: it is the first of its text
                del same[0]  # type: ignore[union-attr]
            mask = masks.pop(number, 0) | opener
            if mask != last_shown:  # (the same ranks as the line before: nothing changes)
                for rank in ranks_of(mask):
                    shown_with[1 << rank] = mask
                last_shown = mask
            out.append((mask, text))
        self._last_shown = last_shown
        return out

    def _late(self, number: int, wanted: int, index: int) -> bool:
        """Whether group `number`, its opener's line `index`, waits for a late rank among
        `wanted` (expected ranks not in it, whose last line shown was shown with the opener's):
        one that has printed fewer lines than the opener had with this one, and that can still
        join it (its last line is older than the group)."""
        latest, counts = self._latest, self._counts
        return any(latest.get(rank, -1) < number and counts.get(rank, 0) <= index
                   for rank in ranks_of(wanted))

    def next_due(self, now: float) -> float | None:
        """Seconds until the oldest group must be shown (None: nothing waits)."""
        if not self._pending:
            return None
        due_at = self._pending[0][2]
        if now >= due_at:  # it waits for a late rank
            due_at += self._hold
        return max(0.0, due_at - now)

    def flush(self) -> list[Merged]:
        """Every line still waiting, in order."""
        masks = self._masks
        out = [(masks.get(number, 0) | opener, text)
               for number, text, _due, opener, _index in self._pending]
        self._pending.clear()
        self._masks.clear()
        self._by_text.clear()
        return out
