"""torch.profiler on one rank, for one `%%distributed --profile` cell or a `with nbdist.profile()`
block, exported as plain dicts (wall-clock aligned) that `nbdist.profiler` merges across ranks."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from nbdist.worker import collectives
from nbdist.worker.rank_service import command

MAX_EVENTS = 20_000
"""Events kept per rank and capture; beyond it the shortest nested operators are dropped first
(collectives and top-level operators are kept), and counted."""
TOP_OPERATORS = 15
ANCHOR = "nbdist.anchor"
_COMM_MARKS = ("c10d::", "gloo:", "nccl", "record_param_comms", collectives.PROFILE_PREFIX)


@dataclass
class _Session:
    profiler: Any
    anchor_wall_us: float
    cell_start_us: float | None = None
    cell_end_us: float | None = None


_ACTIVE: _Session | None = None
LAST_CAPTURE: dict[str, Any] | None = None  # what the notebook collects


def is_active() -> bool:
    return _ACTIVE is not None


def cell_started() -> None:
    """pre_run_cell: a profile started for the cell covers the cell, not the calls around it."""
    if _ACTIVE is not None and _ACTIVE.cell_start_us is None:
        _ACTIVE.cell_start_us = time.time_ns() / 1000


def cell_finished() -> None:
    if _ACTIVE is not None and _ACTIVE.cell_start_us is not None:
        _ACTIVE.cell_end_us = time.time_ns() / 1000


@command("profile.start", main_thread=True)
def start() -> None:
    """Profile this rank's CPU (and CUDA once in use); a profile already running (a `with
    nbdist.profile()` block a failed cell left open) is stopped first."""
    global _ACTIVE
    import torch
    from torch.profiler import ProfilerActivity, profile

    stop()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    with _quiet_stderr():
        profiler.__enter__()
    with torch.profiler.record_function(ANCHOR + ".warmup"):  # the first range is slow to open
        pass
    before = time.time_ns()
    with torch.profiler.record_function(ANCHOR):  # its middle is this wall-clock instant
        pass
    _ACTIVE = _Session(profiler, (before + time.time_ns()) / 2000)
    collectives.install()  # under plain torchrun too: each explicit call becomes a named range
    collectives.TRACKER.profiling = True


@command("profile.stop", main_thread=True)
def stop() -> dict[str, Any] | None:
    """The running profile's capture (None if none ran), also kept as `LAST_CAPTURE`."""
    global _ACTIVE, LAST_CAPTURE
    session, _ACTIVE = _ACTIVE, None
    if session is None:
        return None
    collectives.TRACKER.profiling = False
    end_wall_us = time.time_ns() / 1000
    with _quiet_stderr():
        session.profiler.__exit__(None, None, None)
    LAST_CAPTURE = _capture(session, end_wall_us)
    return LAST_CAPTURE


@command("profile.last", main_thread=True)
def last_capture() -> dict[str, Any] | None:
    return LAST_CAPTURE


@contextmanager
def profile(path: str | None = None) -> Iterator[None]:
    """Profile the block on this rank. Under nbdist the notebook merges the ranks' captures
    (`Cluster.collect_profile()`); with `path` (anywhere, e.g. under plain torchrun) this rank
    also writes its own Chrome trace: `{rank}` in `path` is replaced, else `.rank<N>` is added."""
    start()
    try:
        yield
    finally:
        capture = stop()
        if path is not None and capture is not None:
            from nbdist.profiler import build_report

            build_report([capture]).write_trace(rank_path(path, capture["rank"]))


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto writes "USDT: ... profiler_start/stop" lines to fd 2 on every start and stop, which
    would land in the cell's output of every rank; KINETO_LOG_LEVEL does not silence them."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def rank_path(path: str, rank: int) -> str:
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def _capture(session: _Session, end_wall_us: float) -> dict[str, Any]:
    profiler = session.profiler
    events = list(profiler.events() or [])
    anchor = next((e for e in events if e.name == ANCHOR), None)
    middle = 0.0 if anchor is None else (anchor.time_range.start + anchor.time_range.end) / 2
    offset = session.anchor_wall_us - middle
    start_us = session.cell_start_us or session.anchor_wall_us
    end_us = session.cell_end_us or end_wall_us
    exported = [_event_dict(e, offset) for e in events if not e.name.startswith(ANCHOR)]
    exported = [e for e in exported if e["ts"] + e["dur"] >= start_us and e["ts"] <= end_us]
    kept = exported
    if len(exported) > MAX_EVENTS:
        def keep_first(event: dict[str, Any]) -> tuple[int, float]:
            comm = any(mark in event["name"] for mark in _COMM_MARKS)
            return (0 if comm else 1 if event["top"] else 2, -event["dur"])

        kept = sorted(sorted(exported, key=keep_first)[:MAX_EVENTS], key=lambda e: e["ts"])
    return {
        "rank": int(os.environ.get("RANK", "0")),  # set on a rank and under torchrun
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_us": start_us,
        "end_us": end_us,
        "events": kept,
        "total_events": len(exported),
        "dropped": len(exported) - len(kept),
        "top_operators": _top_operators(profiler),
    }


def _event_dict(event: Any, offset: float) -> dict[str, Any]:
    start = float(event.time_range.start)
    device = str(event.device_type).rsplit(".", 1)[-1]
    on_cpu = device == "CPU"
    thread = event.thread if on_cpu else f"{device.lower()} {event.device_index}:{event.thread}"
    return {
        "name": event.name,
        "ts": start + offset,
        "dur": max(0.0, float(event.time_range.end) - start),
        "tid": thread,
        "cat": "cpu_op" if on_cpu else "kernel",
        "top": on_cpu and event.cpu_parent is None,
    }


def _top_operators(profiler: Any) -> list[dict[str, Any]]:
    rows = []
    for avg in profiler.key_averages():
        if avg.key.startswith((ANCHOR, collectives.PROFILE_PREFIX)):
            continue
        rows.append({"name": avg.key, "count": int(avg.count),
                     "self_cpu_us": float(avg.self_cpu_time_total),
                     "self_device_us": float(avg.self_device_time_total)})
    rows.sort(key=lambda row: -(row["self_cpu_us"] + row["self_device_us"]))
    return rows[:TOP_OPERATORS]
