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


def waiting_on_device(cluster: ClusterCore, rank: int) -> bool:
    """An NCCL rank that SIGINT has not stopped and that waits for no absent peer: its main thread
    is in no blocking collective, and every member of each group it has a collective in flight
    on entered that collective too (per their telemetry). It waits on its GPU (`x.item()` behind
    queued kernels, a collective that has not reached its turn on the stream): Python runs no
    handler until the GPU is done, and aborting the group would cost a healthy one."""
    if cluster.backend != "nccl":
        return False
    where = where_of(cluster, rank)
    flight = where.get("flight")
    if where.get("collective") or not flight:  # no reading yet (or no recorder): not known
        return False
    for entry in flight:
        if entry.completed:
            continue
        for member in entry.ranks:
            theirs = [e for e in where_of(cluster, member).get("flight") or []
                      if e.group == entry.group]
            if not any(e.seq >= entry.seq for e in theirs):
                return False  # a member never entered it: blocked on that peer
    return True


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
    """Why the ranks' groups are out of step ("" when they are not): their counts of queued
    collectives differ (per group and device backend), or a rank sent tensors to another that
    received a different number. NCCL queues a collective and returns, so a rank that raised
    after its peers queued one, or before reaching it, finishes its cell without an error."""
    counts: dict[str, dict[int, int]] = {}
    for rank, report in sorted(reports.items()):
        for kind, number in (report.get("sequence") or {}).items():
            counts.setdefault(kind, {})[rank] = int(number)
    for kind, by_rank in sorted(counts.items()):
        if len(set(by_rank.values())) > 1:
            device, _, group = kind.partition("@")
            listed = ", ".join(f"rank {rank}: {number}" for rank, number in by_rank.items())
            return (f"the ranks queued different numbers of {device} collectives"
                    f"{f' in {group}' if group else ''} ({listed})")
    return _transfers_apart(reports)


def _transfers_apart(reports: dict[int, dict[str, Any]]) -> str:
    """A `dist.send` from one rank that its peer's `dist.recv` did not match, by count: NCCL's
    sequence numbers count no point-to-point transfer. A rank that received from any source
    (`src=None`) is compared by its total."""
    sent: dict[int, dict[int, int]] = {}
    received: dict[int, dict[str, int]] = {}
    for rank, report in reports.items():
        for key, number in (report.get("p2p") or {}).items():
            source, _, target = key.removeprefix("p2p ").partition("->")
            if int(target) != rank:
                sent.setdefault(int(target), {})[rank] = int(number)
            else:
                received.setdefault(rank, {})[source] = int(number)
    for target in sorted(reports):
        got = received.get(target, {})
        by = {str(source): n for source, n in sent.get(target, {}).items()}
        if "*" in got:
            apart = [("ranks", sum(by.values()), sum(got.values()))]
        else:
            apart = [(f"rank {source}", by.get(source, 0), got.get(source, 0))
                     for source in sorted(set(by) | set(got)) if int(source) in reports]
        for who, number, taken in apart:
            if number != taken:
                return (f"{who} sent {number} tensor(s) to rank {target} with dist.send; it "
                        f"received {taken} with dist.recv")
    return ""
