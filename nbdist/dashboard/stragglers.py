"""Who the others wait for: per-rank step times and, per collective, the rank that arrived last.

Fed with each rank's ``"timing"`` payload (``nbdist.worker.metrics``). A collective is
matched across ranks by (group, torch's per-group sequence number); once every member has
reported it, the rank that waited least inside it arrived last, and the longest wait minus the
shortest is how late it was. Only waits are compared, never clocks of different hosts.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StragglerConfig:
    min_late: float = 0.005
    """A collective whose last rank came less late than this (seconds) names no straggler."""

    min_late_share: float = 0.25
    """...nor one whose lateness is under this share of the median step time."""

    window: int = 8
    """Complete collectives looked at: the straggler is last in most of the late ones and in
    the two most recent late ones."""

    late_by_window: int = 3
    """Latest complete collectives whose median is a rank's "late by" while none came late."""

    keep: int = 512
    """Collectives remembered while their ranks report (oldest forgotten first)."""

    step_window: int = 5
    """Steps whose median is a rank's "step time"."""


@dataclass
class Arrival:
    name: str
    size: int
    waits: dict[int, float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.waits) >= self.size

    def last(self) -> tuple[int, float]:
        """The rank that arrived last (waited least) and by how much (seconds)."""
        rank = min(self.waits, key=lambda r: (self.waits[r], r))
        return rank, max(self.waits.values()) - self.waits[rank]


class StragglerView:
    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.arrivals: OrderedDict[tuple[str, int], Arrival] = OrderedDict()
        self.complete: deque[tuple[tuple[str, int], Arrival]] = deque(maxlen=64)
        self.steps: dict[int, deque[tuple[float, float, float]]] = {}
        self.step_counts: dict[int, int] = {}
        self.flagged: int | None = None
        self.flag_changes = 0

    def ingest(self, rank: int, timing: dict[str, Any]) -> None:
        changed = bool(timing.get("steps"))
        for record in timing.get("steps") or ():
            t, duration, waited = (float(v) for v in record[:3])
            self.steps.setdefault(rank, deque(maxlen=64)).append((t, duration, waited))
            self.step_counts[rank] = self.step_counts.get(rank, 0) + 1
        for group, seq, size, name, waited in timing.get("collectives") or ():
            key = (str(group), int(seq))
            arrival = self.arrivals.get(key)
            if arrival is None:
                arrival = self.arrivals[key] = Arrival(str(name), int(size))
                while len(self.arrivals) > self.config.keep:
                    self.arrivals.popitem(last=False)
            if rank in arrival.waits:
                continue  # a replayed payload (a dashboard attached late)
            arrival.waits[rank] = float(waited)
            if arrival.complete:
                self.complete.append((key, arrival))
                del self.arrivals[key]
                changed = True
        if changed:
            self._update_flag()

    def step_time(self, rank: int) -> tuple[float | None, float | None]:
        """Median recent step time of ``rank`` and the share of it spent waiting in collectives."""
        steps = list(self.steps.get(rank, ()))[-self.config.step_window:]
        if not steps:
            return None, None
        duration = statistics.median(s[1] for s in steps)
        total = sum(s[1] for s in steps)
        waited = sum(s[2] for s in steps)
        return duration, (min(1.0, waited / total) if total > 0 else None)

    def _threshold(self) -> float:
        medians = [d for d in (self.step_time(r)[0] for r in self.steps) if d is not None]
        typical = statistics.median(medians) if medians else 0.0
        return max(self.config.min_late, self.config.min_late_share * typical)

    def late_ones(self) -> list[tuple[int, float]]:
        """(last rank, lateness) of the recent complete collectives that came late enough."""
        return [arrival.last() for arrival in self._late_arrivals(self._recent())]

    def _recent(self) -> list[tuple[tuple[str, int], Arrival]]:
        return list(self.complete)[-self.config.window:]

    def _late_arrivals(self, recent: list[tuple[tuple[str, int], Arrival]]) -> list[Arrival]:
        threshold = self._threshold()
        return [arrival for _, arrival in recent if arrival.last()[1] >= threshold]

    def _update_flag(self) -> None:
        late = self.late_ones()
        flagged = None
        if len(late) >= 2 and late[-1][0] == late[-2][0]:
            rank = late[-1][0]
            if 2 * sum(1 for r, _ in late if r == rank) > len(late):
                flagged = rank
        if flagged != self.flagged:
            self.flag_changes += 1
            self.flagged = flagged

    def summary(self, ranks: list[int]) -> dict[str, Any]:
        """What the dashboard shows: the last collectives, the flagged rank, per-rank times."""
        recent = self._recent()
        last = None
        if recent:
            key, arrival = recent[-1]
            rank, late = arrival.last()
            last = {"rank": rank, "late": late, "name": arrival.name, "group": key[0],
                    "seq": key[1], "size": arrival.size}
        # a step has one collective that waits for the straggler and others that do not: "late
        # by" looks at the late ones when there are any, else at the last few
        late_ones = self._late_arrivals(recent)
        late_by: dict[int, list[float]] = {}
        for arrival in late_ones or [a for _, a in recent[-self.config.late_by_window:]]:
            latest = max(arrival.waits.values())
            for rank, waited in arrival.waits.items():
                late_by.setdefault(rank, []).append(latest - waited)
        per_rank = {}
        for rank in ranks:
            step, wait_share = self.step_time(rank)
            lateness = late_by.get(rank)
            per_rank[rank] = {
                "step_time": step,
                "wait_share": wait_share,
                "late_by": statistics.median(lateness) if lateness else None,
                "steps_timed": self.step_counts.get(rank, 0),
            }
        late = [arrival.last() for arrival in late_ones]
        return {
            "last": last,
            "flagged": self.flagged,
            "flagged_late": statistics.median(x for r, x in late if r == self.flagged)
            if self.flagged is not None else None,
            "collectives": len(recent),
            "late_collectives": len(late),
            "ranks": per_rank,
        }


def describe(summary: dict[str, Any]) -> str:
    """One line for the static view (the widget words it the same way)."""
    last = summary.get("last")
    if not last:
        return "stragglers: no collective seen by every rank yet"
    flagged = summary.get("flagged")
    if flagged is not None:
        return (f"straggler: rank {flagged} arrived last, {ms(summary.get('flagged_late'))} late "
                f"(last in {summary.get('late_collectives')} of the last "
                f"{summary.get('collectives')} collectives)")
    return (f"no straggler: at the last collective ({last['name']}) rank {last['rank']} "
            f"arrived last by {ms(last['late'])}")


def ms(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "–"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"
