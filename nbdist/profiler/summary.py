"""The profile's summary: per rank compute / communication / wait / idle, the rank the others
waited for (the straggler) and the top operators over all ranks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbdist.profiler.timeline import KINDS, Timeline
from nbdist.text import render_table

STRAGGLER_MIN_WAIT_US = 1000.0
"""Below this much waiting caused in total (1 ms), no rank is named a straggler."""


@dataclass
class Straggler:
    rank: int
    last_in: int
    """Collectives this rank arrived at last (of `collectives`)."""
    collectives: int
    caused_wait_us: float
    """What the others waited for it, summed over the collectives it was last at."""


@dataclass
class ProfileSummary:
    totals: dict[int, dict[str, float]]
    """rank -> kind -> µs (kinds: compute, communication, wait, idle)."""
    collectives: dict[int, int]
    straggler: Straggler | None
    top_operators: list[dict[str, Any]]
    """name, count, self_cpu_us, self_device_us summed over the ranks; biggest first."""
    dropped: dict[int, int]

    def table(self) -> str:
        rows = []
        for rank, totals in sorted(self.totals.items()):
            rows.append([str(rank), *(format_us(totals[kind]) for kind in KINDS),
                         str(self.collectives.get(rank, 0))])
        lines = [render_table(["rank", *KINDS, "collectives"], rows, align="right"),
                 self.straggler_line()]
        if self.top_operators:
            ops = []
            for op in self.top_operators[:8]:
                ops.append([op["name"][:48], str(op["count"]), format_us(op["self_cpu_us"]),
                            format_us(op["self_device_us"]) if op["self_device_us"] else "–"])
            header = ["operator", "calls", "self CPU", "self device"]
            lines += ["top operators (all ranks):", render_table(header, ops)]
        dropped = sum(self.dropped.values())
        if dropped:
            lines.append(f"({dropped} short nested events left out to keep the timeline small)")
        return "\n".join(lines)

    def straggler_line(self) -> str:
        s = self.straggler
        if s is None:
            return "no straggler: no rank kept the others waiting (≥ 1 ms in total)"
        return (f"straggler: rank {s.rank}, last to arrive at {s.last_in} of {s.collectives} "
                f"collective(s); the others waited {format_us(s.caused_wait_us)} for it")


def format_us(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f} s"
    if value >= 1e3:
        return f"{value / 1e3:.1f} ms"
    return f"{value:.0f} µs"


def find_straggler(timeline: Timeline) -> Straggler | None:
    """The rank whose late arrivals cost the others the most waiting."""
    caused: dict[int, float] = defaultdict(float)
    last_in: dict[int, int] = defaultdict(int)
    shared = [c for c in timeline.collectives if len(c.arrivals) > 1]
    for collective in shared:
        last = collective.last_rank
        last_in[last] += 1
        caused[last] += sum(w for rank, w in collective.waits.items() if rank != last)
    if not caused:
        return None
    rank = max(caused, key=lambda r: (caused[r], -r))
    if caused[rank] < STRAGGLER_MIN_WAIT_US:
        return None
    return Straggler(rank, last_in[rank], len(shared), caused[rank])


def merge_operators(per_rank: Sequence[Sequence[dict[str, Any]]], limit: int = 15
                    ) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for operators in per_rank:
        for op in operators:
            row = merged.setdefault(op["name"], {"name": op["name"], "count": 0,
                                                 "self_cpu_us": 0.0, "self_device_us": 0.0})
            row["count"] += int(op.get("count", 0))
            row["self_cpu_us"] += float(op.get("self_cpu_us", 0.0))
            row["self_device_us"] += float(op.get("self_device_us", 0.0))
    rows = sorted((r for r in merged.values() if r["self_cpu_us"] + r["self_device_us"] > 0),
                  key=lambda r: -(r["self_cpu_us"] + r["self_device_us"]))
    return rows[:limit]


def summarize(timeline: Timeline, top_operators: Sequence[Sequence[dict[str, Any]]] = ()
              ) -> ProfileSummary:
    counts = {row.rank: sum(1 for c in timeline.collectives if row.rank in c.arrivals)
              for row in timeline.rows}
    return ProfileSummary(
        totals={row.rank: dict(row.totals) for row in timeline.rows},
        collectives=counts,
        straggler=find_straggler(timeline),
        top_operators=merge_operators(top_operators),
        dropped={row.rank: row.dropped for row in timeline.rows},
    )
