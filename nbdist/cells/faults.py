"""What nbdist does when a rank fails, hangs, dies or is interrupted during a cell.

Policy (measured on gloo): a rank that failed is idle, so tearing its process group down releases
peers blocked on it at once ("Connection closed by peer"). Ranks still busy after that are taken
down the interrupt ladder: SIGINT, then teardown on idle peers, then SIGKILL of that engine only.
After the cell, a broken group is rebuilt as a new generation on a fresh store (gloo), or the user
is told to restart (NCCL: PyTorch advises against recovering NCCL in-process).
"""

from __future__ import annotations

import re
import signal
import time
from typing import TYPE_CHECKING, Any

from nbdist.errors import NbdistError
from nbdist.cluster.ranks import format_ranks
from nbdist.cells.result import RankError
from nbdist.worker import bootstrap

if TYPE_CHECKING:
    from nbdist.cells.runner import CellRun

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def rank_error_from_remote(rank: int, error: Any) -> RankError:
    ename = getattr(error, "ename", type(error).__name__)
    evalue = getattr(error, "evalue", str(error))
    traceback = getattr(error, "traceback", "") or ""
    if isinstance(traceback, list):
        traceback = "\n".join(traceback)
    kind = "interrupted" if ename == "KeyboardInterrupt" else "root"
    where = _last_cell_line(traceback) if kind == "interrupted" else ""
    return RankError(rank=rank, kind=kind, ename=ename, evalue=evalue, traceback=traceback, where=where)


def _last_cell_line(traceback: str) -> str:
    matches = re.findall(r"line (\d+)", _ANSI.sub("", traceback))
    return f"cell line {matches[0]}" if matches else ""


def dead_rank_error(run: CellRun, rank: int) -> RankError:
    proc = run.cluster.ranks[rank]
    detail = run.killed.get(rank) or proc.exit_detail or "engine process exited"
    lines = []
    out = (run.metadata.get(rank, {}).get("stdout") or "") + (run.metadata.get(rank, {}).get("stderr") or "")
    tail = [line for line in out.splitlines() if line.strip()][-5:]
    if tail:
        lines.append("its last output lines:")
        lines.extend(f"  {line}" for line in tail)
    log_tail = _crash_excerpt(run.cluster.engine_log_tail(rank, 80))
    if log_tail:
        lines.append("its engine log ends with:")
        lines.extend(f"  {line}" for line in log_tail.splitlines())
    return RankError(rank=rank, kind="dead", ename="RankDied", evalue=detail, traceback="\n".join(lines))


def _crash_excerpt(log: str) -> str:
    """From an engine log: faulthandler's block ("Fatal Python error: ...") if there is one."""
    lines = [ln for ln in log.splitlines() if "[KernelNanny" not in ln]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    if starts:
        return "\n".join(lines[starts[-1]:starts[-1] + 12])
    return "\n".join(lines[-8:])


def apply_fault_policy(run: CellRun) -> None:
    """Called while waiting: release peers of a failed rank, then ladder what stays stuck."""
    if not run.pending:
        return
    failed_idle = [
        r for r in run.targets
        if r not in run.pending and run.cluster.ranks[r].state == "alive" and _finished_with_error(run, r)
    ]
    dead = [r for r in run.targets if run.cluster.ranks[r].state == "dead"]
    if not failed_idle and not dead:
        return
    now = time.perf_counter()
    if run.first_fault_at is None:
        run.first_fault_at = now
    if failed_idle and not run.torn_down and run.cluster.backend == "gloo":
        run.torn_down = True
        done = run.cluster.teardown_process_group(failed_idle, timeout=run.config.teardown_grace)
        if done:
            run.result.actions.append(
                f"tore down the process group on rank(s) {format_ranks(done)} so that rank(s) "
                f"{format_ranks(sorted(run.pending))} blocked on them were released"
            )
    if now - run.first_fault_at >= run.config.fault_settle and run.pending:
        interrupt_ladder(run, sorted(run.pending), reason="fault")


def _finished_with_error(run: CellRun, rank: int) -> bool:
    md = run.metadata.get(rank) or {}
    if md.get("error") is not None:
        return True
    ar = run.asyncs.get(rank)
    if ar is None or not ar.done():
        return False
    try:
        return ar.exception(timeout=0) is not None
    except Exception:
        return False


def interrupt_ladder(run: CellRun, ranks: list[int], reason: str) -> None:
    """SIGINT -> (grace) -> make collectives still blocked fail (release signal) and tear down idle
    peers' groups -> (grace) -> SIGKILL those still stuck."""
    if not ranks:
        return
    run.ladder_ran = True
    cluster = run.cluster
    stuck = set(ranks) & run.pending
    for rank in sorted(stuck):
        cluster.signal_rank(rank, signal.SIGINT)
    run.result.actions.append(f"sent SIGINT to rank(s) {format_ranks(sorted(stuck))} ({reason})")
    if _wait_after_sigint(run, stuck):
        return
    stuck &= run.pending
    released = [r for r in sorted(stuck) if cluster.release_rank(r)]
    if released:
        run.torn_down = True
        run.result.actions.append(
            f"rank(s) {format_ranks(released)} stayed blocked inside a collective; made it fail "
            "there (the process group is rebuilt after the cell)"
        )
    idle = [p.spec.rank for p in cluster.ranks if p.state == "alive" and p.spec.rank not in run.pending]
    if idle and cluster.backend == "gloo":
        run.torn_down = True
        done = cluster.teardown_process_group(idle, timeout=run.config.teardown_grace)
        run.result.actions.append(
            f"tore down the process group on idle rank(s) {format_ranks(done)} to release "
            f"rank(s) {format_ranks(sorted(stuck))} blocked on them"
        )
    if released or idle:
        if _pump(run, run.config.teardown_grace, stuck):
            return
        stuck &= run.pending
    for rank in sorted(stuck):
        where = _where_text(run, rank)
        run.killed[rank] = f"killed by nbdist (SIGKILL) after it stayed stuck{f' {where}' if where else ''}"
        cluster.signal_rank(rank, signal.SIGKILL)
    run.result.actions.append(
        f"killed the engine of rank(s) {format_ranks(sorted(stuck))} (last step of the ladder); "
        "run %dist_restart (Cluster.restart()) for a full cluster"
    )
    _pump(run, 3.0, stuck)
    for rank in stuck & run.pending:  # the kill is certain; do not wait for the notification
        run.pending.discard(rank)
        cluster.ranks[rank].state = "dead"
        cluster.ranks[rank].exit_detail = run.killed[rank]
        cluster.telemetry.rank_state(rank, "dead", run.killed[rank])


def _wait_after_sigint(run: CellRun, stuck: set[int]) -> bool:
    """Give SIGINT time to work; True if every rank stopped. Cut short (after collective_grace)
    once each rank still running has sent telemetry taken after the signal that shows it inside
    a collective: those cannot see SIGINT, so waiting the full interrupt_grace would be wasted."""
    sent = time.time()
    started = time.perf_counter()
    grace = run.config.interrupt_grace
    if _pump(run, min(run.config.collective_grace, grace), stuck):
        return True
    while time.perf_counter() - started < grace:
        waiting = stuck & run.pending
        fresh = all(_telemetry_time(run, r) > sent for r in waiting)
        if fresh and all(_blocked_in_collective(run, r) for r in waiting):
            return False
        if _pump(run, min(0.1, grace - (time.perf_counter() - started)), stuck):
            return True
    return not (stuck & run.pending)


def _telemetry_time(run: CellRun, rank: int) -> float:
    payload = run.cluster.telemetry.last_payload.get(rank) or {}
    return float(payload.get("t") or 0.0)


def _blocked_in_collective(run: CellRun, rank: int) -> bool:
    """The rank's telemetry shows it inside a collective: an explicit one, or (gloo) autograd's
    backward, where DDP's reducer all-reduces gradients from C++ threads. A backward that is merely
    long is released too; on gloo that costs only a rebuild of the group (~0.05 s)."""
    where = _where(run, rank)
    if where.get("collective"):
        return True
    stack = where.get("stack") or []
    return (
        run.cluster.backend == "gloo"
        and bool(stack)
        and stack[-1].endswith(("in _engine_run_backward", "in run_backward"))
    )


def _pump(run: CellRun, seconds: float, ranks: set[int]) -> bool:
    """Wait for ranks to finish; a second KeyboardInterrupt skips to the next step."""
    try:
        return run.pump_until(seconds, ranks)
    except KeyboardInterrupt:
        run.result.actions.append("second interrupt: skipping to the next step")
        return not (ranks & run.pending)


def _where(run: CellRun, rank: int) -> dict[str, Any]:
    payload = run.cluster.telemetry.last_payload.get(rank) or {}
    return payload.get("where") or {}


def _where_text(run: CellRun, rank: int) -> str:
    where = _where(run, rank)
    coll = where.get("collective")
    if coll:
        return f"in {coll['name']} at {coll['location']}"
    stack = where.get("stack") or []
    return f"at {stack[-1]}" if stack else ""


def on_deadline(run: CellRun) -> None:
    """Hang diagnosis: where every rank is and who skipped a collective; then the ladder."""
    timeout = run.timeout or 0
    report = [f"deadline of {timeout:g} s reached; where each rank is:"]
    counts: dict[int, int] = {}
    for rank in run.targets:
        where = _where(run, rank)
        if rank in run.pending:
            coll = where.get("collective")
            counts[rank] = int(where.get("collectives_entered", 0))
            if coll:
                waited = time.time() - float(coll.get("since", time.time()))
                report.append(
                    f"  rank {rank}: waiting in {coll['name']} #{coll['index']} at {coll['location']} "
                    f"for {waited:.1f} s"
                )
            else:
                stack = where.get("stack") or []
                report.append(f"  rank {rank}: running Python at {stack[-1] if stack else '?'}")
            for line in (where.get("stack") or [])[-6:]:
                report.append(f"      {line}")
        else:
            state = "failed" if _finished_with_error(run, rank) else "finished"
            report.append(f"  rank {rank}: {state} the cell")
    run.hang_report = report
    _desync(run, counts)
    for line in run.hang_report:
        run.sink.on_status(line)
    run.result.report_shown = getattr(run.sink, "shows_status", True)
    interrupt_ladder(run, sorted(run.pending), reason="deadline")


def _desync(run: CellRun, pending_counts: dict[int, int]) -> None:
    """Name the rank the others wait for: one still in Python that has not reached the collective
    yet (a hang on that rank), or one that finished the cell after fewer collectives (it skipped
    one: a desync)."""
    waiting = {r: c for r, c in pending_counts.items() if _where(run, r).get("collective")}
    if not waiting:
        return  # nobody blocked in a collective: a plain hang, the stacks say it all
    finished = [r for r in run.targets if r not in run.pending]
    counts = dict(pending_counts)
    for rank, rep in _reports(run, finished).items():
        counts[rank] = int(rep.get("collectives_entered", 0))
    deepest = max(waiting.values())
    coll = _where(run, max(waiting, key=lambda r: waiting[r]))["collective"]
    waiters = format_ranks(sorted(r for r, c in waiting.items() if c == deepest))
    behind = sorted(r for r, c in counts.items() if c < deepest and r not in waiting)
    for rank in behind:
        if rank in run.pending:
            run.hang_report.append(
                f"rank {rank} has not reached {coll['name']} #{coll['index']} that rank(s) {waiters} "
                f"wait in: it is still running Python ({_where_text(run, rank) or 'see its stack'})"
            )
        else:
            run.hang_report.append(
                f"desync: rank {rank} finished the cell after {counts[rank]} collective(s) while "
                f"rank(s) {waiters} wait in {coll['name']} #{coll['index']}: rank {rank} skipped a "
                "collective (or the others ran one more)"
            )
    mismatched = sorted(r for r, c in waiting.items() if c != deepest)
    for rank in mismatched:
        run.hang_report.append(
            f"desync: rank {rank} waits in collective #{waiting[rank]} while rank(s) {waiters} wait "
            f"in #{deepest}: the ranks called a different number of collectives"
        )


def _reports(run: CellRun, ranks: list[int]) -> dict[int, dict[str, Any]]:
    alive = [r for r in ranks if run.cluster.ranks[r].state == "alive"]
    asyncs = {}
    for r in alive:
        try:
            asyncs[r] = run.cluster.view(r).apply_async(bootstrap.cell_report)
        except NbdistError:
            continue
    out = {}
    deadline = time.monotonic() + 5.0
    for rank, ar in asyncs.items():
        try:
            out[rank] = ar.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            continue
    return out


def after_cell(run: CellRun) -> None:
    """Classify failures (root cause vs consequence) and make the next cell work."""
    result = run.result
    cluster = run.cluster
    if not result.errors and not run.ladder_ran and not run.torn_down:
        return
    alive = [p.spec.rank for p in cluster.ranks if p.state == "alive"]
    reports = _reports(run, alive) if cluster.running and not cluster.controller_lost else {}
    for rank, err in result.errors.items():
        rep = reports.get(rank) or {}
        failed_in = rep.get("failed_in")
        released = err.kind == "root" or (
            # SIGINT from nbdist's own ladder (not the user's stop button) while in a collective
            err.kind == "interrupted" and not result.interrupted and not result.timed_out
        )
        if failed_in and released:
            err.kind = "collective"
            err.where = f"{failed_in['name']} at {failed_in['location']}"
        elif failed_in and err.kind == "interrupted":
            err.where = f"{failed_in['name']} at {failed_in['location']}"
    if not [e for e in result.errors.values() if e.kind in ("root", "dead")]:
        # nobody raised first-hand: keep the collective errors' full tracebacks as the cause
        for err in result.errors.values():
            if err.kind == "collective" and not run.ladder_ran:
                err.kind = "root"
    if result.timed_out:
        for rank in run.killed:
            result.errors[rank].kind = "dead"
    broken = run.torn_down or any(
        rep.get("failed_in") or not rep.get("pg_initialized", True) for rep in reports.values()
    )
    dead = [p.spec.rank for p in cluster.ranks if p.state == "dead"]
    if cluster.controller_lost:
        return
    if dead:
        result.actions.append(
            f"rank(s) {format_ranks(dead)} are dead; %dist_restart (Cluster.restart()) brings back "
            "a full cluster with the same ranks, new processes and a new process group"
        )
        return
    if not broken:
        return
    if cluster.backend != "gloo":
        result.actions.append(
            f"the {cluster.backend} process group may be broken and cannot be recovered in-process: "
            "run %dist_restart (Cluster.restart())"
        )
        return
    try:
        seconds = cluster.rebuild_process_group()
        result.actions.append(
            f"process group rebuilt (generation {cluster.generation}) in {seconds:.2f} s: "
            "the next cell can use dist as before"
        )
    except Exception as exc:
        result.actions.append(
            f"could not rebuild the process group ({exc}); run %dist_restart (Cluster.restart())"
        )
