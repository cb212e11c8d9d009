"""At a cell's deadline: first, from torch's flight recorder, who waits in which collective and
which rank never entered it (or passed other sizes); then where every rank is (collective and how
long it waited, or its Python stack). Without the recorder (torch < 2.8), nbdist's own count of
the collectives each rank entered from Python names the rank that skipped one."""

from __future__ import annotations

import time
from typing import Any

from nbdist.cells.flight_verdict import Readings, verdict
from nbdist.cells.running_cell import RunningCell, finished_with_error
from nbdist.cells.whereabouts import (
    cell_line,
    cell_reports,
    in_backward,
    telemetry_time,
    where_of,
    where_text,
)
from nbdist.cluster.ranks import format_ranks


def hang_report(run: RunningCell) -> list[str]:
    """The report's lines: the verdict, then one block per rank."""
    ask_where(run)
    finished = [r for r in run.targets if r not in run.pending]
    reports = cell_reports(run.cluster, finished) if finished else {}
    blocks = [f"deadline of {run.timeout or 0:g} s reached; where each rank is:"]
    counts: dict[int, int] = {}
    for rank in run.targets:
        if rank in run.pending:
            counts[rank] = int(where_of(run.cluster, rank).get("collectives_entered", 0))
            blocks.extend(_running_rank_lines(run, rank))
        else:
            blocks.append(f"  rank {rank}: {_finished_state(run, rank)} the cell")
    readings = _readings(run, reports)
    if readings is not None:
        return flight_lines(run, readings) + blocks
    return blocks + _desync_lines(run, counts, reports)


def blocked_report(run: RunningCell) -> list[str]:
    """For the stop button: the flight recorder's verdict alone (who waits in which collective,
    who never entered it); nothing when no rank waits in one or the recorder is unavailable."""
    ask_where(run)
    finished = [r for r in run.targets if r not in run.pending]
    readings = _readings(run, cell_reports(run.cluster, finished) if finished else {})
    return flight_lines(run, readings) if readings is not None else []


def ask_where(run: RunningCell) -> None:
    """Ask the ranks still running where they are now and wait, up to `where_answer_timeout`,
    for their answers: their last telemetry may predate the collective they wait in, or hold no
    flight-recorder reading yet (a short deadline), and the report's first line needs both."""
    asked_at = time.time()
    asked = []
    for rank in sorted(run.pending):
        process = run.cluster.ranks[rank]
        if process.report_signal is not None and process.state == "alive":
            run.cluster.signal_rank(rank, process.report_signal)
            asked.append(rank)
    give_up = time.perf_counter() + run.config.faults.where_answer_timeout
    while time.perf_counter() < give_up:
        asked = [r for r in asked if r in run.pending
                 and telemetry_time(run.cluster, r) < asked_at]
        if not asked:
            return
        run.pump(run.config.internal.poll_interval)


def _finished_state(run: RunningCell, rank: int) -> str:
    if run.cluster.ranks[rank].state == "dead":
        return "died during"
    return "failed" if finished_with_error(run, rank) else "finished"


def _readings(run: RunningCell, reports: dict[int, dict[str, Any]]) -> Readings | None:
    """Every rank's flight-recorder reading; None when a rank has none (an older torch)."""
    readings: Readings = {}
    for rank in run.targets:
        if rank in run.pending:
            found = where_of(run.cluster, rank).get("flight")
        else:
            found = (reports.get(rank) or {}).get("flight")
        if found is None and run.cluster.ranks[rank].state == "alive":
            return None
        readings[rank] = list(found or [])
    return readings


def flight_lines(run: RunningCell, readings: Readings) -> list[str]:
    """The verdict lines, with what each rank does instead and what its stack says it waits in."""
    doing: dict[int, str] = {}
    hints: dict[int, str] = {}
    for rank in run.targets:
        if rank not in run.pending:
            doing[rank] = f"it {_finished_state(run, rank)} the cell"
            continue
        stack = where_of(run.cluster, rank).get("stack") or []
        line = cell_line(stack)
        if in_backward(stack):
            hints[rank] = f"gradients in backward() at {line}" if line else "backward()"
        elif line:
            hints[rank] = f"at {line}"
        doing[rank] = f"it is running Python{f' at {line}' if line else ''}"
    return verdict(readings, doing, hints)


def _running_rank_lines(run: RunningCell, rank: int) -> list[str]:
    where = where_of(run.cluster, rank)
    coll = where.get("collective")
    stack = where.get("stack") or []
    if coll:
        waited = time.time() - float(coll.get("since", time.time()))
        where = f"{coll['name']} at {coll['location']}"
        lines = [f"  rank {rank}: waiting in {where} for {waited:.1f} s"]
    else:
        line = cell_line(stack)
        inner = stack[-1] if stack else "?"
        at = f"{line} (innermost: {inner})" if line and not inner.startswith(line) else inner
        lines = [f"  rank {rank}: running Python at {at}"]
    lines.extend(f"      {frame}" for frame in stack[-6:])
    return lines


def _desync_lines(run: RunningCell, pending_counts: dict[int, int],
                  reports: dict[int, dict[str, Any]]) -> list[str]:
    """Name the rank the others wait for: one still in Python that has not reached the collective
    yet (a hang on that rank), or one that finished the cell after fewer collectives (it skipped
    one: a desync)."""
    cluster = run.cluster
    waiting = {r: c for r, c in pending_counts.items() if where_of(cluster, r).get("collective")}
    if not waiting:
        return []  # nobody blocked in a collective: a plain hang, the stacks say it all
    counts = dict(pending_counts)
    for rank, rep in reports.items():
        counts[rank] = int(rep.get("collectives_entered", 0))
    deepest = max(waiting.values())  # the waiters' count: the collective they wait in is #deepest
    name = where_of(cluster, max(waiting, key=lambda r: waiting[r]))["collective"]["name"]
    waiters = format_ranks(sorted(r for r, c in waiting.items() if c == deepest))
    lines = []
    for rank in sorted(r for r, c in counts.items() if c < deepest and r not in waiting):
        if rank in run.pending:
            where = where_text(cluster, rank) or "see its stack"
            lines.append(
                f"rank {rank} has not reached {name} #{deepest} that rank(s) "
                f"{waiters} wait in: it is still running Python ({where})"
            )
        else:
            lines.append(
                f"desync: rank {rank} finished the cell after {counts[rank]} collective(s) while "
                f"rank(s) {waiters} wait in {name} #{deepest}: rank {rank} skipped a "
                "collective (or the others ran one more)"
            )
    for rank in sorted(r for r, c in waiting.items() if c != deepest):
        lines.append(
            f"desync: rank {rank} waits in collective #{waiting[rank]} while rank(s) {waiters} "
            f"wait in #{deepest}: the ranks called a different number of collectives"
        )
    return lines
