"""Every rank's recent collectives side by side (``%dist_status --collectives``), and the
flight-recorder trace saved as one file per rank, the way torch's analyser reads it
(``python -m torch.distributed.flight_recorder.fr_trace DIR``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nbdist.cells.flight_verdict import mismatches
from nbdist.errors import NbdistError
from nbdist.text import render_table
from nbdist.worker.flight_recorder import EnteredCollective

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore

TRACE_PREFIX = "nbdist_fr_rank"
"""Each rank's file is TRACE_PREFIX + rank: the analyser takes the rank from the suffix."""


def recent_collectives(cluster: ClusterCore, limit: int = 8) -> dict[int, list[EnteredCollective]]:
    """Rank -> its last `limit` collectives (torch's flight recorder, else nbdist's own record). A
    rank busy in a cell cannot answer: its latest telemetry reading (per group, the collective it
    waits in) stands in."""
    answers = cluster.call("collectives.recent", limit,
                           timeout=cluster.config.faults.cell_report_timeout)
    found: dict[int, list[EnteredCollective]] = {}
    for process in cluster.ranks:
        rank = process.spec.rank
        entries = answers.results.get(rank)
        if entries is None:
            where = (cluster.telemetry.last_payload.get(rank) or {}).get("where") or {}
            entries = where.get("flight")
        if entries is not None:
            found[rank] = list(entries)
    if not found and cluster.ranks:
        raise NbdistError("no rank answered: each is busy in a cell or dead (%dist_status)")
    return found


@dataclass(frozen=True)
class CollectivesView:
    """What ``%dist_status --collectives`` shows (its text, as a notebook displays it)."""

    text: str

    def __repr__(self) -> str:
        return self.text


def collectives_table(found: dict[int, list[EnteredCollective]]) -> CollectivesView:
    """One row per (group, sequence id), one column per rank: the operation and its sizes."""
    keys = sorted({(e.group, e.seq) for entries in found.values() for e in entries})
    ranks = sorted(found)
    rows = []
    notes = []
    for group, seq in keys:
        at = {rank: e for rank in ranks for e in found[rank] if (e.group, e.seq) == (group, seq)}
        rows.append([group, seq, *(_cell(at.get(rank)) for rank in ranks)])
        notes.extend(mismatches(at))
    table = render_table(["group", "#", *(f"rank {rank}" for rank in ranks)], rows)
    return CollectivesView("\n".join([table, *notes]))


def _cell(entry: EnteredCollective | None) -> str:
    if entry is None:
        return "-"
    state = "" if entry.completed else " (in flight)"
    return f"{entry.op} {entry.shapes()}".rstrip() + state


def save_trace(cluster: ClusterCore, directory: str | os.PathLike[str],
               stacks: bool = True) -> list[Path]:
    """Write every alive rank's trace to `directory` (created owner-only); returns the files."""
    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    alive = [p.spec.rank for p in cluster.ranks if p.state == "alive"]
    timeout = cluster.config.faults.cell_report_timeout + (30.0 if stacks else 0.0)
    answers = cluster.call("collectives.trace", stacks, ranks=alive, timeout=timeout)
    if answers.failures:
        listed = "; ".join(f"rank {r}: {why}" for r, why in sorted(answers.failures.items()))
        raise NbdistError(f"could not read the flight recorder of every rank: {listed}")
    paths = []
    for rank, trace in sorted(answers.results.items()):
        path = folder / f"{TRACE_PREFIX}{rank}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(trace)
        paths.append(path)
    return paths
