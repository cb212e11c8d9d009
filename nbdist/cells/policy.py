"""The fault policy: every decision nbdist takes after a rank errs, dies, hangs past the deadline
or is interrupted — tear the process group down now, run the interrupt ladder, rebuild after.

A group is torn down only when a peer is really blocked on it: every model that holds the group
(DDP, FSDP) dies with it, so an ordinary error that every rank raised (a typo) never touches it.
On gloo, tearing a failed rank's group down releases the peers blocked on it at once
("Connection closed by peer"). Ranks still busy after that go down the interrupt ladder
(`nbdist.cells.ladder`). After the cell, a broken or desynchronised group (the ranks queued
different numbers of collectives: NCCL returns before a collective ran) is aborted and rebuilt as
a new generation on a fresh store, on gloo and NCCL alike.
"""

from __future__ import annotations

import time
from typing import Any

from nbdist.cells.flight_verdict import CHECK_HINT, death_lines
from nbdist.cells.group_health import (
    ahead_errors,
    cell_health,
    nccl_errors,
    nccl_failed,
    out_of_step,
)
from nbdist.cells.hang_report import blocked_report, hang_report
from nbdist.cells.ladder import InterruptLadder
from nbdist.cells.out_of_memory import name_out_of_memory
from nbdist.cells.rank_errors import CXX_EXCEPTION, classify_errors
from nbdist.cells.running_cell import RunningCell, finished_with_error
from nbdist.cells.survivors import after_reform
from nbdist.cells.whereabouts import (
    blocked_in_collective,
    cell_reports,
    desynchronised,
    telemetry_time,
)
from nbdist.cluster.ranks import format_ranks


class FaultPolicy:
    """One per running cell. The runner calls `while_waiting` on every turn of its wait loop,
    `on_deadline`, `on_interrupt` and, once the results are in, `after_cell`."""

    def __init__(self, run: RunningCell) -> None:
        self.run = run
        self.cluster = run.cluster
        self.config = run.config
        self.first_fault_at: float | None = None
        self.first_fault_wall = 0.0
        """time.time() of the first fault: telemetry older than this cannot show who is blocked."""
        self.torn_down = False
        """Process groups were torn down or made to fail during this cell: rebuild after it."""
        self.ladder_ran = False
        self.killed: dict[int, str] = {}
        """rank -> why nbdist killed its engine (its death detail)."""
        self.hang_report: list[str] = []
        self.started_wall = time.time()
        self.out_of_step = ""
        """Why the ranks' groups disagree after the cell, from their cell_end reports."""

    # ---------------------------------------------------------------- while the cell runs
    def while_waiting(self) -> None:
        """Release peers of a failed rank; once the fault has settled, ladder what stays stuck."""
        run = self.run
        if not run.pending:
            return
        failed_idle = [
            r for r in run.targets
            if r not in run.pending
            and self.cluster.ranks[r].state == "alive"
            and (finished_with_error(run, r) or nccl_failed(run, r, self.started_wall))
        ]
        dead = [r for r in run.targets if self.cluster.ranks[r].state == "dead"]
        if not failed_idle and not dead:
            return
        now = time.perf_counter()
        if self.first_fault_at is None:
            self.first_fault_at = now
            self.first_fault_wall = time.time()
        if self.should_tear_down_now(failed_idle):
            self._tear_down_failed(failed_idle)
        if self.should_run_ladder(now):
            self._climb_ladder(sorted(run.pending), reason="fault")

    def should_tear_down_now(self, failed_idle: list[int]) -> bool:
        """Tear down the process group on the ranks in `failed_idle` (their cell raised; they are
        idle) right now? Only when a rank still running is blocked on them: its telemetry, taken
        after the first rank failed, shows it inside a collective (or, on gloo, inside DDP's
        backward, whose gradient all-reduce runs in C++). Tearing down makes those peers fail at
        once instead of at the process-group timeout. When every rank raised, or the others are
        still running Python, the group and every model holding it stay exactly as they were.
        Once per cell."""
        if not failed_idle or self.torn_down or not self._recoverable_in_process():
            return False
        return bool(self.blocked_peers())

    def blocked_peers(self) -> list[int]:
        """Ranks still running whose fresh telemetry shows them waiting inside a collective."""
        return [
            r for r in sorted(self.run.pending)
            if telemetry_time(self.cluster, r) >= self.first_fault_wall
            and blocked_in_collective(self.cluster, r)
        ]

    def should_run_ladder(self, now: float) -> bool:
        """Ranks still running `fault_settle` seconds after the first fault are stuck."""
        if self.first_fault_at is None or not self.run.pending:
            return False
        return now - self.first_fault_at >= self.config.faults.fault_settle

    def _tear_down_failed(self, failed_idle: list[int]) -> None:
        self.torn_down = True
        grace = self.config.faults.teardown_grace
        done = self.cluster.teardown_process_group(failed_idle, timeout=grace)
        if done:
            self.run.result.actions.append(
                f"tore down the process group on rank(s) {format_ranks(done)} so that rank(s) "
                f"{format_ranks(sorted(self.run.pending))} blocked on them were released"
            )

    def on_deadline(self) -> None:
        """Hang diagnosis: where every rank is and who skipped a collective; then the ladder."""
        run = self.run
        self.hang_report = hang_report(run)
        for line in self.hang_report:
            run.sink.on_status(line)
        run.result.report_shown = getattr(run.sink, "shows_status", True)
        self._climb_ladder(sorted(run.pending), reason="deadline")

    def on_interrupt(self) -> None:
        """The stop button (KeyboardInterrupt in the notebook): ladder every rank still running."""
        self.run.sink.on_status(
            f"nbdist: interrupting rank(s) {format_ranks(sorted(self.run.pending))} (stop button)"
        )
        self.hang_report = blocked_report(self.run)
        for line in self.hang_report:
            self.run.sink.on_status(line)
        self.run.result.report_shown = getattr(self.run.sink, "shows_status", True)
        self._climb_ladder(sorted(self.run.pending), reason="interrupt")

    def _climb_ladder(self, ranks: list[int], reason: str) -> None:
        if not ranks:
            return
        self.ladder_ran = True
        ladder = InterruptLadder(self.run, tear_down_idle_peers=self._recoverable_in_process())
        outcome = ladder.climb(ranks, reason)
        self.torn_down = self.torn_down or outcome.torn_down
        self.killed.update(outcome.killed)

    def _recoverable_in_process(self) -> bool:
        """gloo and NCCL groups are aborted and re-formed inside the engines (NCCL's watchdog
        returns errors instead of ending them: nbdist.worker.process_group)."""
        return self.cluster.backend in ("gloo", "nccl")

    # ---------------------------------------------------------------- after the cell
    def after_cell(self) -> None:
        """Classify failures (root cause vs consequence) and make the next cell work."""
        result = self.run.result
        cluster = self.cluster
        destroyed = self.destroyed_by_cell()
        self._check_group_health()
        if (not result.errors and not self.ladder_ran and not self.torn_down and not destroyed
                and not self.out_of_step):
            return
        reports: dict[int, dict[str, Any]] = {}
        if result.errors or self.ladder_ran or self.torn_down:
            alive = [p.spec.rank for p in cluster.ranks if p.state == "alive"]
            if cluster.running and not cluster.controller_lost:
                reports = cell_reports(cluster, alive)
            classify_errors(result, reports, ladder_ran=self.ladder_ran, killed=self.killed)
            # the allocator's "std::bad_alloc" line comes before faulthandler's dump of every
            # thread, which runs long: read a long tail
            name_out_of_memory(result, self.config.start.memory_limit,
                               lambda rank: cluster.engine_log_tail(rank, 400))
            self._name_collective_deaths(reports)
        if cluster.controller_lost:
            return
        self._recover(reports, destroyed)

    def _check_group_health(self) -> None:
        """Every cell, from the ranks' cell_end reports: a rank whose NCCL collective failed or
        was aborted fails, with no value (the watchdog raised nothing in it); counts of queued
        collectives or transfers that disagree are noted for `_recover`."""
        health = cell_health(self.run, self.started_wall)
        result = self.run.result
        # NCCL only: on gloo an unmatched collective blocks (or fails) the rank that queued it
        complete = sorted(health) == sorted(self.run.targets) and self.cluster.backend == "nccl"
        for rank, error in (ahead_errors(health) if complete else {}).items():
            if rank not in result.errors:
                result.errors[rank] = error
                result.results.pop(rank, None)
        for rank, error in nccl_errors(health, self.started_wall).items():
            raised = result.errors.get(rank)
            if raised is None:
                result.errors[rank] = error
            elif error.kind == "root":  # its own error came after: the collective's first
                raised.traceback = f"{error.ename}: {error.evalue}\n{raised.traceback}"
            result.results.pop(rank, None)
            self.torn_down = True  # the group is aborted: rebuilt after the cell
        # NCCL only: gloo counts point-to-point transfers in its groups' sequence numbers, so a
        # pipeline's uneven sends would look out of step (an unmatched gloo collective blocks)
        if self.cluster.backend == "nccl":
            self.out_of_step = out_of_step(health, self.run.targets)

    def _name_collective_deaths(self, reports: dict[int, dict[str, Any]]) -> None:
        """A rank died while its peers were inside a collective with it: say which, with the
        sizes the survivors passed (their flight recorders outlive the dead rank's)."""
        result = self.run.result
        dead = sorted(r for r, e in result.errors.items() if e.kind == "dead")
        readings = {r: list(rep.get("flight") or []) for r, rep in reports.items()}
        lines = death_lines(dead, readings, self.started_wall) if dead else []
        if not lines:
            return
        aborted = any("SIGABRT" in result.errors[r].evalue
                      or CXX_EXCEPTION in result.errors[r].traceback for r in dead)
        if aborted and not self.config.faults.check_collectives:
            lines.append(CHECK_HINT)
        for rank in dead:
            result.errors[rank].traceback = "\n".join([*lines, result.errors[rank].traceback])

    def destroyed_by_cell(self) -> list[int]:
        """Ranks whose cell called dist.destroy_process_group() (a pasted script's last line):
        honoured, then re-formed after the cell so that the next one can use dist again."""
        payloads = self.cluster.telemetry.last_payload
        return [
            r for r in self.run.targets
            if ((payloads.get(r) or {}).get("group") or {}).get("destroyed_by_cell")
        ]

    def _recover(self, reports: dict[int, dict[str, Any]], destroyed: list[int]) -> None:
        """Dead ranks: say how to restart. A broken or desynchronised group: rebuild it."""
        actions = self.run.result.actions
        cluster = self.cluster
        dead = [p.spec.rank for p in cluster.ranks if p.state == "dead"]
        if dead:
            actions.append(
                f"rank(s) {format_ranks(dead)} are dead; %dist_restart (Cluster.restart()) brings"
                " back a full cluster with the same ranks, new processes and a new process group"
            )
            return
        out_of_step = desynchronised(reports) or self.out_of_step
        if not destroyed and not self._group_broken(reports) and not out_of_step:
            return
        if not self._recoverable_in_process() and not destroyed:
            actions.append(
                f"the {cluster.backend} process group may be broken and cannot be recovered"
                " in-process: run %dist_restart (Cluster.restart())"
            )
            return
        why = (f"the cell destroyed the process group on rank(s) {format_ranks(destroyed)} "
               "(dist.destroy_process_group()); " if destroyed else "")
        if out_of_step and not destroyed:
            why = f"{out_of_step}: the next collective would pair with a stale one; "
        try:
            seconds = cluster.rebuild_process_group()
            actions.append(
                f"{why}process group {'re-formed' if destroyed else 'rebuilt'} (generation "
                f"{cluster.generation}) in {seconds:.2f} s: {after_reform(cluster)}"
            )
        except Exception as exc:
            actions.append(
                f"{why}could not rebuild the process group ({exc}); run %dist_restart"
                " (Cluster.restart())"
            )

    def _group_broken(self, reports: dict[int, dict[str, Any]]) -> bool:
        """nbdist tore it down, a rank's group broke under it (a peer went away inside a
        collective), or the cell destroyed it. A collective that merely raised on its arguments
        on every rank broke nothing."""
        return self.torn_down or any(
            rep.get("group_broken", bool(rep.get("failed_in")))
            or not rep.get("pg_initialized", True)
            for rep in reports.values()
        )
