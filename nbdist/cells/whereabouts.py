"""Where each rank is: read from its latest telemetry while it runs (collective, stack), or asked
of it after the cell (collectives entered, the collective that failed, process-group state)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore


def where_of(cluster: ClusterCore, rank: int) -> dict[str, Any]:
    """The rank's last "where" sample: ``collective`` (name, location, since), ``stack``,
    ``collectives_entered``; empty when it sent none."""
    payload = cluster.telemetry.last_payload.get(rank) or {}
    return payload.get("where") or {}


def where_text(cluster: ClusterCore, rank: int) -> str:
    """``in all_reduce at train.py:12``, ``at <innermost frame>``, or "" when unknown."""
    where = where_of(cluster, rank)
    coll = where.get("collective")
    if coll:
        return f"in {coll['name']} at {coll['location']}"
    stack = where.get("stack") or []
    line = cell_line(stack)
    if stack and line and not stack[-1].startswith(line):
        return f"at {line} ({stack[-1]})"
    return f"at {stack[-1]}" if stack else ""


def cell_line(stack: list[str]) -> str:
    """The innermost frame of the cell itself (``cell line 5``) in a stack from `where_of`, or
    "": a stack that ends inside torch must not be reported by torch's line number."""
    for frame in reversed(stack):
        if frame.startswith("cell line"):
            return frame.split(" in ")[0]
    return ""


def telemetry_time(cluster: ClusterCore, rank: int) -> float:
    """When the rank took its last telemetry sample (its clock, time.time()); 0.0 if never."""
    payload = cluster.telemetry.last_payload.get(rank) or {}
    return float(payload.get("t") or 0.0)


def blocked_in_collective(cluster: ClusterCore, rank: int) -> bool:
    """The rank's telemetry shows it inside a collective: an explicit one, or (gloo) autograd's
    backward, where DDP's reducer all-reduces gradients from C++ threads. A backward that is merely
    long is released too; on gloo that costs only a rebuild of the group."""
    where = where_of(cluster, rank)
    if where.get("collective") or any(not e.completed for e in where.get("flight") or []):
        return True
    return cluster.backend == "gloo" and in_backward(where.get("stack") or [], innermost=True)


def in_backward(stack: list[str], innermost: bool = False) -> bool:
    """A stack from `where_of` is inside autograd's backward (its innermost frame, or any)."""
    frames = stack[-1:] if innermost else stack
    return any(frame.endswith(("in _engine_run_backward", "in run_backward")) for frame in frames)


def cell_reports(cluster: ClusterCore, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """Ask the alive ones of `ranks` what the cell did to them (``collectives_entered``,
    ``failed_in``, ``pg_initialized``); a rank that cannot answer in time is left out."""
    return cluster.call("cell.report", ranks=ranks,
                        timeout=cluster.config.faults.cell_report_timeout).results


def desynchronised(reports: dict[int, dict[str, Any]]) -> str:
    """Why the ranks' world group is out of step ("" when it is not): their counts of queued
    collectives differ (per device backend), so the next collective would pair with a stale one.
    NCCL queues a collective and returns, so a rank that raised after its peers queued one, or
    before reaching it, finishes its cell without an error of its own."""
    counts: dict[str, dict[int, int]] = {}
    for rank, report in sorted(reports.items()):
        for kind, number in (report.get("sequence") or {}).items():
            counts.setdefault(kind, {})[rank] = int(number)
    for kind, by_rank in sorted(counts.items()):
        if len(set(by_rank.values())) > 1:
            listed = ", ".join(f"rank {rank}: {number}" for rank, number in by_rank.items())
            return f"the ranks queued different numbers of {kind} collectives ({listed})"
    return ""
