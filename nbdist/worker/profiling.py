"""torch.profiler on one rank, for one `%%distributed --profile` cell or a `with nbdist.profile()`
block, exported as plain dicts (wall-clock aligned) that `nbdist.profiler` merges across ranks.

While a profile runs, the public collectives are wrapped once more so each explicit call is a
``nbdist.collective:<name>|<group>`` range: the notebook matches calls across ranks by group and
order. Nothing is wrapped, and nothing costs anything, when no profile runs.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nbdist.worker.collectives import COLLECTIVES
from nbdist.worker.step_timing import call_argument, parameter_index

MAX_EVENTS = 20_000
"""Events kept per rank and capture; beyond it the shortest nested operators are dropped first
(collectives and top-level operators are always kept). The capture says how many were dropped."""
TOP_OPERATORS = 15
ANCHOR = "nbdist.anchor"
COLLECTIVE_PREFIX = "nbdist.collective:"
_COMM_MARKS = ("c10d::", "gloo:", "nccl", "record_param_comms", COLLECTIVE_PREFIX)


@dataclass
class _Session:
    profiler: Any
    anchor_wall_us: float
    cell_start_us: float | None = None
    cell_end_us: float | None = None
    wrapped: dict[str, Callable[..., Any]] = field(default_factory=dict)
    depth: threading.local = field(default_factory=threading.local)


_ACTIVE: _Session | None = None
LAST_CAPTURE: dict[str, Any] | None = None
"""The last finished capture on this rank (what the notebook collects)."""


def is_active() -> bool:
    return _ACTIVE is not None


def cell_started() -> None:
    """pre_run_cell: a profile started for the cell covers the cell, not the calls around it."""
    if _ACTIVE is not None and _ACTIVE.cell_start_us is None:
        _ACTIVE.cell_start_us = time.time_ns() / 1000


def cell_finished() -> None:
    if _ACTIVE is not None and _ACTIVE.cell_start_us is not None:
        _ACTIVE.cell_end_us = time.time_ns() / 1000


def start() -> bool:
    """Start profiling this rank (CPU; CUDA kernels too when a GPU is in use). A profile already
    running (e.g. a `with nbdist.profile()` block left open by a failed cell) is stopped first."""
    global _ACTIVE
    import torch
    from torch.profiler import ProfilerActivity, profile

    if _ACTIVE is not None:
        stop()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
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
    _wrap_collectives(_ACTIVE)
    return True


def stop(max_events: int = MAX_EVENTS) -> dict[str, Any] | None:
    """Stop the running profile (None if none) and return its capture (also kept as
    `LAST_CAPTURE`)."""
    global _ACTIVE, LAST_CAPTURE
    session, _ACTIVE = _ACTIVE, None
    if session is None:
        return None
    _unwrap_collectives(session)
    end_wall_us = time.time_ns() / 1000
    with _quiet_stderr():
        session.profiler.__exit__(None, None, None)
    LAST_CAPTURE = _capture(session, end_wall_us, max_events)
    return LAST_CAPTURE


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
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 here: nothing to hide
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def rank_path(path: str, rank: int) -> str:
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def current_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a broken group still has a rank in the environment
        pass
    return int(os.environ.get("RANK", "0"))


# ---------------------------------------------------------------- collectives as ranges
def _wrap_collectives(session: _Session) -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            session.wrapped[name] = fn
            setattr(dist, name, _labelled(name, fn, session))


def _unwrap_collectives(session: _Session) -> None:
    import torch.distributed as dist

    for name, fn in session.wrapped.items():
        if getattr(getattr(dist, name, None), "__nbdist_profiled__", False):
            setattr(dist, name, fn)


def _labelled(name: str, fn: Callable[..., Any], session: _Session) -> Callable[..., Any]:
    import torch

    group_at = parameter_index(fn, "group")

    @functools.wraps(fn)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(session.depth, "value", 0)
        if depth:  # all_gather_object -> all_gather: one call, the outer one
            return fn(*args, **kwargs)
        session.depth.value = 1
        try:
            group = call_argument(args, kwargs, "group", group_at, None)
            label = f"{COLLECTIVE_PREFIX}{name}|{_group_name(group)}"
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        finally:
            session.depth.value = 0

    labelled.__nbdist_profiled__ = True  # type: ignore[attr-defined]
    return labelled


def _group_name(group: Any) -> str:
    """The name of a call's group (None: the default group's)."""
    if group is None:
        import torch.distributed as dist

        group = dist.group.WORLD
    return str(getattr(group, "group_name", "") or "?")


# ---------------------------------------------------------------- export
def _capture(session: _Session, end_wall_us: float, max_events: int) -> dict[str, Any]:
    profiler = session.profiler
    events = list(profiler.events() or [])
    anchor = next((e for e in events if e.name == ANCHOR), None)
    middle = 0.0 if anchor is None else (anchor.time_range.start + anchor.time_range.end) / 2
    offset = session.anchor_wall_us - middle
    start_us = session.cell_start_us or session.anchor_wall_us
    end_us = session.cell_end_us or end_wall_us
    exported = [event for event in (_event_dict(e, offset) for e in events
                                            if not e.name.startswith(ANCHOR))
                if event["ts"] + event["dur"] >= start_us and event["ts"] <= end_us]
    kept = _thin(exported, max_events)
    return {
        "rank": current_rank(),
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
    device = str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1]
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


def _thin(events: list[dict[str, Any]], max_events: int) -> list[dict[str, Any]]:
    if len(events) <= max_events:
        return events

    def keep_first(event: dict[str, Any]) -> tuple[int, float]:
        comm = any(mark in event["name"] for mark in _COMM_MARKS)
        return (0 if comm else 1 if event["top"] else 2, -event["dur"])

    kept = sorted(events, key=keep_first)[:max_events]
    return sorted(kept, key=lambda e: e["ts"])


def _top_operators(profiler: Any) -> list[dict[str, Any]]:
    rows = []
    for avg in profiler.key_averages():
        if avg.key.startswith((ANCHOR, COLLECTIVE_PREFIX)):
            continue
        device_self = float(getattr(avg, "self_device_time_total", 0.0) or 0.0)
        rows.append({"name": avg.key, "count": int(avg.count),
                     "self_cpu_us": float(avg.self_cpu_time_total), "self_device_us": device_self})
    rows.sort(key=lambda row: -(row["self_cpu_us"] + row["self_device_us"]))
    return rows[:TOP_OPERATORS]
