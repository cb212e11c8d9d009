"""After every cell, from each rank's cell_end telemetry: a group NCCL's watchdog failed (the cell
fails there, naming the collective, and returns no value), a rank whose NCCL communicators nbdist
aborted while it ran, and ranks whose counts of queued collectives or transfers disagree."""

from __future__ import annotations

from typing import Any

from nbdist.cells.result import RankError
from nbdist.cells.running_cell import RunningCell
from nbdist.cells.whereabouts import desynchronised

HOW = {"TIMEOUT": "timed out", "COMM_ERROR": "failed (NCCL error)",
       "REMOTE_ERROR": "failed on another rank"}


def cell_health(run: RunningCell, since: float) -> dict[int, dict[str, Any]]:
    """Each target rank's health report from its cell_end payload, sent at or after `since` (its
    clock, time.time()): a tick's, taken while the cell ran, could catch one rank before a
    collective and another after it."""
    found = {rank: _cell_end_health(run, rank, since) for rank in run.targets}
    return {rank: health for rank, health in found.items() if health}


def _cell_end_health(run: RunningCell, rank: int, since: float) -> dict[str, Any]:
    payload = run.cluster.telemetry.last_payload.get(rank) or {}
    if payload.get("reason") != "cell_end" or float(payload.get("t") or 0.0) < since:
        return {}
    return payload.get("health") or {}


def nccl_failed(run: RunningCell, rank: int, since: float) -> bool:
    """A rank that finished the cell "ok" whose NCCL group the watchdog failed: a fault like a
    rank that raised, for the peers still running."""
    return bool(_cell_end_health(run, rank, since).get("nccl_failed"))


def nccl_errors(health: dict[int, dict[str, Any]], since: float) -> dict[int, RankError]:
    """A rank whose NCCL group the watchdog failed, or whose communicators nbdist aborted during
    the cell: whatever it computed after that collective read a buffer NCCL never filled."""
    errors = {}
    for rank, report in sorted(health.items()):
        failed = report.get("nccl_failed") or {}
        if failed:
            group, info = sorted(failed.items())[0]
            what = info.get("collective") or f"a collective of the {group}"
            errors[rank] = RankError(
                rank=rank, kind="root", ename="NCCLCollectiveFailed",
                evalue=(f"{what} {HOW.get(info.get('error'), 'failed')}: NCCL's watchdog "
                        "aborted the group's communicators and raised nothing in the cell, so "
                        "what the cell computed after it is not valid and no value is returned"),
                where=what)
        elif float(report.get("nccl_aborted_at") or 0.0) >= since:
            errors[rank] = RankError(
                rank=rank, kind="collective", ename="NCCLCollectiveAborted",
                evalue=("nbdist aborted this rank's NCCL communicators while the cell ran: what "
                        "it computed after its collective is not valid; no value is returned"),
                where="an NCCL collective (aborted by nbdist)")
    return errors


def ahead_errors(health: dict[int, dict[str, Any]]) -> dict[int, RankError]:
    """Ranks that queued more NCCL collectives on a group than a peer: the last ones can never
    complete (NCCL returned at once, and the group is aborted and rebuilt after the cell), so
    whatever the cell read from their tensors is not valid."""
    counts: dict[str, dict[int, int]] = {}
    for rank, report in health.items():
        for key, number in (report.get("sequence") or {}).items():
            if key.partition("@")[0] == "cuda":
                counts.setdefault(key, {})[rank] = int(number)
    errors = {}
    for key, by_rank in sorted(counts.items()):
        least = min(by_rank.values())
        group = key.partition("@")[2] or "default group"
        behind = ", ".join(str(r) for r, n in sorted(by_rank.items()) if n == least)
        for rank, number in sorted(by_rank.items()):
            if number == least:
                continue
            which = f"#{least + 1}" if number == least + 1 else f"#{least + 1}-#{number}"
            errors.setdefault(rank, RankError(
                rank=rank, kind="collective", ename="NCCLCollectiveNeverMatched",
                evalue=(f"it queued NCCL collective {which} of the {group}, which rank(s) "
                        f"{behind} never reached: it cannot complete, the group is rebuilt, and "
                        "no value is returned"),
                where=f"NCCL collective #{least + 1} of the {group}"))
    return errors


def out_of_step(health: dict[int, dict[str, Any]], targets: list[int]) -> str:
    """Why the groups are out of step after a cell every rank finished ("" when they are not, or
    when a target rank sent no report)."""
    if sorted(health) != sorted(targets):
        return ""
    return desynchronised(health)
