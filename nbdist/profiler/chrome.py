"""The merged timeline as one Chrome / Perfetto trace (JSON ``traceEvents``): one process per rank
(pid = rank), the rank's own threads as captured, plus an ``nbdist`` thread with the classified
row (compute / wait / communication) and each collective with who arrived last. Times are µs
from the earliest rank's start, on the aligned clock."""

from __future__ import annotations

import json
import os
from typing import Any

from nbdist.profiler.timeline import Timeline

NBDIST_TID = 1_000_000
"""Thread ids are whole numbers (what every trace viewer accepts): nbdist's rows get these two,
the rank's own threads their profiler thread number, device streams numbers from 2_000_000."""
COLLECTIVES_TID = 1_000_001
_THREAD_NAMES = {NBDIST_TID: "nbdist: compute / wait / communication",
                 COLLECTIVES_TID: "nbdist: collectives (matched across ranks)"}
_COLORS = {"compute": "good", "wait": "terrible", "communication": "bad"}  # Chrome's named colours


def trace_events(timeline: Timeline) -> list[dict[str, Any]]:
    origin = timeline.start
    events: list[dict[str, Any]] = []
    for row in timeline.rows:
        pid = row.rank
        label = f"rank {row.rank}" + (f" ({row.host})" if row.host else "")
        events += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
             "args": {"sort_index": row.rank}},
        ]
        tids = _thread_ids(row.events)
        names = {**_THREAD_NAMES, **{tid: _thread_label(key) for key, tid in tids.items()}}
        events += [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in names.items()
        ]
        for start, end, kind in row.segments:
            if kind != "idle":
                events.append({"ph": "X", "cat": "nbdist", "name": kind, "pid": pid,
                               "tid": NBDIST_TID, "ts": start - origin, "dur": end - start,
                               "cname": _COLORS[kind]})
        for event in row.events:
            events.append({"ph": "X", "cat": event.get("cat", "cpu_op"), "name": event["name"],
                           "pid": pid, "tid": tids[event["tid"]], "ts": event["ts"] - origin,
                           "dur": event["dur"]})
    events += _collective_events(timeline)
    return events


def _collective_events(timeline: Timeline) -> list[dict[str, Any]]:
    origin = timeline.start
    events: list[dict[str, Any]] = []
    for collective in timeline.collectives:
        last = collective.last_rank
        for rank, arrival in collective.arrivals.items():
            args = {"group": collective.group, "seq": collective.seq, "last_rank": last,
                    "wait_us": round(collective.waits[rank], 1)}
            events.append({"ph": "X", "cat": "collective", "pid": rank, "tid": COLLECTIVES_TID,
                           "name": f"{collective.name} #{collective.seq} (last: rank {last})",
                           "ts": arrival - origin, "dur": collective.ends[rank] - arrival,
                           "args": args})
    return events


def _thread_ids(events: list[dict[str, Any]]) -> dict[Any, int]:
    ids: dict[Any, int] = {}
    for event in events:
        key = event["tid"]
        if key not in ids:
            ids[key] = key if isinstance(key, int) and key < NBDIST_TID else 2_000_000 + len(ids)
    return ids


def _thread_label(key: Any) -> str:
    return f"thread {key}" if isinstance(key, int) else str(key)


def write_trace(timeline: Timeline, path: str | os.PathLike[str],
                metadata: dict[str, Any] | None = None) -> str:
    """Write the trace (opens in https://ui.perfetto.dev and chrome://tracing); returns the path."""
    document = {"traceEvents": trace_events(timeline), "displayTimeUnit": "ms",
                "otherData": {"generator": "nbdist", "origin_wall_us": timeline.start,
                              "ranks": timeline.ranks, **(metadata or {})}}
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, separators=(",", ":"))
    return path
