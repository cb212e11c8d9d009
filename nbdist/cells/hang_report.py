"""At a cell's deadline: where every rank is (collective and how long it waited, or its Python
stack), and which rank the others wait for — one that is behind, or one that skipped a collective."""

from __future__ import annotations

import time

from nbdist.cells.running import RunningCell, finished_with_error
from nbdist.cells.whereabouts import cell_reports, where_of, where_text
from nbdist.cluster.ranks import format_ranks


def hang_report(run: RunningCell) -> list[str]:
    """The report's lines: one block per rank, then the desync finder's verdict, if any."""
    report = [f"deadline of {run.timeout or 0:g} s reached; where each rank is:"]
    counts: dict[int, int] = {}
    for rank in run.targets:
        if rank in run.pending:
            counts[rank] = int(where_of(run.cluster, rank).get("collectives_entered", 0))
            report.extend(_running_rank_lines(run, rank))
        else:
            state = "failed" if finished_with_error(run, rank) else "finished"
            report.append(f"  rank {rank}: {state} the cell")
    return report + _desync_lines(run, counts)


def _running_rank_lines(run: RunningCell, rank: int) -> list[str]:
    where = where_of(run.cluster, rank)
    coll = where.get("collective")
    if coll:
        waited = time.time() - float(coll.get("since", time.time()))
        lines = [
            f"  rank {rank}: waiting in {coll['name']} #{coll['index']} at {coll['location']} "
            f"for {waited:.1f} s"
        ]
    else:
        stack = where.get("stack") or []
        lines = [f"  rank {rank}: running Python at {stack[-1] if stack else '?'}"]
    lines.extend(f"      {line}" for line in (where.get("stack") or [])[-6:])
    return lines


def _desync_lines(run: RunningCell, pending_counts: dict[int, int]) -> list[str]:
    """Name the rank the others wait for: one still in Python that has not reached the collective
    yet (a hang on that rank), or one that finished the cell after fewer collectives (it skipped
    one: a desync)."""
    cluster = run.cluster
    waiting = {r: c for r, c in pending_counts.items() if where_of(cluster, r).get("collective")}
    if not waiting:
        return []  # nobody blocked in a collective: a plain hang, the stacks say it all
    finished = [r for r in run.targets if r not in run.pending]
    counts = dict(pending_counts)
    for rank, rep in cell_reports(cluster, finished).items():
        counts[rank] = int(rep.get("collectives_entered", 0))
    deepest = max(waiting.values())
    coll = where_of(cluster, max(waiting, key=lambda r: waiting[r]))["collective"]
    waiters = format_ranks(sorted(r for r, c in waiting.items() if c == deepest))
    lines = []
    for rank in sorted(r for r, c in counts.items() if c < deepest and r not in waiting):
        if rank in run.pending:
            lines.append(
                f"rank {rank} has not reached {coll['name']} #{coll['index']} that rank(s) {waiters} "
                f"wait in: it is still running Python ({where_text(cluster, rank) or 'see its stack'})"
            )
        else:
            lines.append(
                f"desync: rank {rank} finished the cell after {counts[rank]} collective(s) while "
                f"rank(s) {waiters} wait in {coll['name']} #{coll['index']}: rank {rank} skipped a "
                "collective (or the others ran one more)"
            )
    for rank in sorted(r for r, c in waiting.items() if c != deepest):
        lines.append(
            f"desync: rank {rank} waits in collective #{waiting[rank]} while rank(s) {waiters} wait "
            f"in #{deepest}: the ranks called a different number of collectives"
        )
    return lines

