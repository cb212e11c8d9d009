"""Merge the ranks' profiler captures into one timeline: each rank's collective calls matched
across ranks by (group, order), the wait before the last rank arrived, and a row per rank split
into compute, communication, wait and idle. Pure functions over plain dicts; no torch needed.

A capture is what `nbdist.worker.profiling` exports: ``{"rank", "host", "start_us", "end_us",
"events": [{"name", "ts", "dur", "tid", "cat", "top"}], ...}``, times in wall-clock µs.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

COLLECTIVE_PREFIX = "nbdist.collective:"
IMPLICIT_GROUP = "implicit"
"""Group key of collectives torch starts by itself (DDP's bucket all-reduce, FSDP's gathers in C++):
matched by order among themselves."""
KINDS = ("compute", "communication", "wait", "idle")
_BACKEND_MARKS = ("gloo:", "nccl:")
_EPSILON_US = 50.0


@dataclass
class CollectiveCall:
    """One rank's part in one collective."""

    name: str
    group: str
    arrival: float
    end: float
    seq: int = 0


@dataclass
class Collective:
    """One collective, matched across the ranks that took part (by group and order)."""

    name: str
    group: str
    seq: int
    arrivals: dict[int, float]
    ends: dict[int, float]
    waits: dict[int, float] = field(default_factory=dict)

    @property
    def last_rank(self) -> int:
        return max(self.arrivals, key=lambda rank: (self.arrivals[rank], rank))

    @property
    def last_arrival(self) -> float:
        return max(self.arrivals.values())


@dataclass
class RankRow:
    rank: int
    host: str
    start: float
    end: float
    segments: list[tuple[float, float, str]]
    """(start µs, end µs, kind) in time order, not overlapping; kind is one of `KINDS`."""
    totals: dict[str, float]
    """µs per kind over the rank's profiled window."""
    events: list[dict[str, Any]]
    dropped: int = 0


@dataclass
class Timeline:
    rows: list[RankRow]
    collectives: list[Collective]
    start: float
    end: float
    clock_offsets: dict[str, float] = field(default_factory=dict)
    """µs taken off each host's clock to line it up with rank 0's host (`clocks.align_clocks`)."""

    @property
    def ranks(self) -> list[int]:
        return [row.rank for row in self.rows]

    def row(self, rank: int) -> RankRow:
        return next(row for row in self.rows if row.rank == rank)


def is_communication(name: str) -> bool:
    return (name.startswith(("c10d::", COLLECTIVE_PREFIX, "record_param_comms"))
            or name.startswith(_BACKEND_MARKS) or "nccl" in name.lower())


def rank_calls(events: Sequence[dict[str, Any]]) -> list[CollectiveCall]:
    """A rank's collective calls in arrival order, each with its per-group sequence number.

    An explicit call (``nbdist.collective:<name>|<group>`` range) arrives when it starts; the
    ``c10d::`` ops inside it, or on their own for collectives torch starts itself, are paired in
    order with the backend's events (gloo's worker threads, NCCL kernels), whose end is when the
    collective finished on this rank (an async call returns before that)."""
    ordered = sorted(events, key=lambda e: e["ts"])
    explicit = [e for e in ordered if e["name"].startswith(COLLECTIVE_PREFIX)]
    ops = [e for e in ordered if e["name"].startswith("c10d::")]
    # NCCL: the kernel is the collective (the CPU only queued it); gloo: its worker threads
    kernels = [e for e in ordered if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    backend = kernels or [e for e in ordered if e["name"].startswith(_BACKEND_MARKS)]
    done, on_device = _pair_backend(ops, backend)
    calls: list[CollectiveCall] = []
    claimed: set[int] = set()
    for label in explicit:
        name, _, group = label["name"][len(COLLECTIVE_PREFIX):].partition("|")
        end = label["ts"] + label["dur"]
        finish, arrival = end, label["ts"]
        for index, op in enumerate(ops):
            mine = op["tid"] == label["tid"] and label["ts"] <= op["ts"] <= end
            if mine and index not in claimed:
                claimed.add(index)
                finish = max(finish, done[index])
                arrival = on_device[index] if on_device[index] is not None else arrival
        calls.append(CollectiveCall(name, group or "?", arrival, finish))
    for index, op in enumerate(ops):
        if index not in claimed:
            name = op["name"].removeprefix("c10d::").strip("_")
            arrival = on_device[index] if on_device[index] is not None else op["ts"]
            calls.append(CollectiveCall(name, IMPLICIT_GROUP, arrival, done[index]))
    calls.sort(key=lambda call: call.arrival)
    counters: dict[str, int] = defaultdict(int)
    for call in calls:
        counters[call.group] += 1
        call.seq = counters[call.group]
    return calls


def _pair_backend(ops: Sequence[dict[str, Any]], backend: Sequence[dict[str, Any]]
                  ) -> tuple[list[float], list[float | None]]:
    """Each c10d op's end (its own, or that of the backend event paired with it in order: the
    first unpaired one that starts after the op does) and, for a GPU kernel, when the kernel
    started: the rank's real arrival, as the CPU runs ahead of the stream."""
    ends = [op["ts"] + op["dur"] for op in ops]
    starts: list[float | None] = [None] * len(ops)
    next_event = 0
    for index, op in enumerate(ops):
        while next_event < len(backend) and backend[next_event]["ts"] < op["ts"] - _EPSILON_US:
            next_event += 1
        if next_event < len(backend):
            event = backend[next_event]
            ends[index] = max(ends[index], event["ts"] + event["dur"])
            if event.get("cat") == "kernel":
                starts[index] = event["ts"]
            next_event += 1
    return ends, starts


def match_collectives(calls_by_rank: dict[int, list[CollectiveCall]]) -> list[Collective]:
    """The same (group, seq) on each rank is one collective; the wait of each rank is the time
    from its arrival to the last rank's (never past its own end)."""
    matched: dict[tuple[str, int], Collective] = {}
    for rank, calls in calls_by_rank.items():
        for call in calls:
            key = (call.group, call.seq)
            collective = matched.setdefault(
                key, Collective(call.name, call.group, call.seq, {}, {})
            )
            collective.arrivals[rank] = call.arrival
            collective.ends[rank] = call.end
    for collective in matched.values():
        last = collective.last_arrival
        for rank, arrival in collective.arrivals.items():
            own = max(0.0, collective.ends[rank] - arrival)
            collective.waits[rank] = min(max(0.0, last - arrival), own)
    return sorted(matched.values(), key=lambda c: (min(c.arrivals.values()), c.group, c.seq))


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _paint(start: float, end: float, layers: Sequence[tuple[str, list[tuple[float, float]]]]
           ) -> list[tuple[float, float, str]]:
    """Split [start, end) into segments; where layers overlap the earlier layer wins, and what no
    layer covers is idle."""
    cuts = {start, end}
    for _, intervals in layers:
        for a, b in intervals:
            cuts.update((min(max(a, start), end), min(max(b, start), end)))
    points = sorted(cuts)
    segments: list[tuple[float, float, str]] = []
    pointers = [0] * len(layers)
    for a, b in zip(points, points[1:], strict=False):
        if b <= a:
            continue
        kind = "idle"
        for i, (name, intervals) in enumerate(layers):
            while pointers[i] < len(intervals) and intervals[pointers[i]][1] <= a:
                pointers[i] += 1
            if pointers[i] < len(intervals) and intervals[pointers[i]][0] <= a:
                kind = name
                break
        if segments and segments[-1][2] == kind and segments[-1][1] == a:
            segments[-1] = (segments[-1][0], b, kind)
        else:
            segments.append((a, b, kind))
    return segments


def compute_intervals(events: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """Operators that ran (GPU kernels too), leaving out communication and any range with a
    collective inside it (FSDP's ``FSDP::all_gather``, a backward hook launching DDP's
    all-reduce): their own non-communication children still count."""
    comm_threads = {e["tid"] for e in events if e["name"].startswith(_BACKEND_MARKS)}
    comm_starts: dict[Any, list[float]] = defaultdict(list)
    for e in events:
        if is_communication(e["name"]):
            comm_starts[e["tid"]].append(e["ts"])
    for starts in comm_starts.values():
        starts.sort()
    intervals = []
    for e in events:
        if e["tid"] in comm_threads or is_communication(e["name"]):
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        starts = comm_starts.get(e["tid"], [])
        first = bisect.bisect_left(starts, start)
        if first < len(starts) and starts[first] < end:
            continue  # a collective runs inside it
        intervals.append((start, end))
    return intervals


def classify(capture: dict[str, Any], collectives: Sequence[Collective]) -> RankRow:
    """The rank's row: compute (`compute_intervals`) over wait (in a collective before the last
    rank arrived) over communication (the rest of the collective); the rest is idle."""
    rank = int(capture["rank"])
    events = capture["events"]
    compute = _union(compute_intervals(events))
    waits, comms = [], []
    for collective in collectives:
        if rank not in collective.arrivals:
            continue
        arrival, end = collective.arrivals[rank], collective.ends[rank]
        waits.append((arrival, arrival + collective.waits[rank]))
        comms.append((arrival + collective.waits[rank], end))
    start, end = float(capture["start_us"]), float(capture["end_us"])
    segments = _paint(start, end, [("compute", compute), ("wait", _union(waits)),
                                   ("communication", _union(comms))])
    totals = dict.fromkeys(KINDS, 0.0)
    for a, b, kind in segments:
        totals[kind] += b - a
    return RankRow(rank, str(capture.get("host", "")), start, end, segments, totals,
                   list(events), int(capture.get("dropped", 0)))


def build_timeline(captures: Sequence[dict[str, Any]]) -> Timeline:
    """One timeline from each rank's capture (one per rank), each on its own wall clock: on one
    host they agree; across hosts, align them first (`nbdist.profiler.clocks.align_clocks`)."""
    captures = sorted(captures, key=lambda c: int(c["rank"]))
    calls = {int(c["rank"]): rank_calls(c["events"]) for c in captures}
    collectives = match_collectives(calls)
    rows = [classify(c, collectives) for c in captures]
    start = min((row.start for row in rows), default=0.0)
    end = max((row.end for row in rows), default=0.0)
    return Timeline(rows, collectives, start, end)
