"""The interrupt ladder: how nbdist frees ranks that stay busy — SIGINT, then make collectives
still blocked fail and tear down idle peers' groups, then SIGKILL of that engine only."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from nbdist.cells.running_cell import RunningCell
from nbdist.cells.whereabouts import (
    blocked_in_collective,
    telemetry_time,
    waiting_on_device,
    where_text,
)
from nbdist.cluster.ranks import format_ranks


@dataclass
class LadderOutcome:
    """What the ladder did that outlives it: whether it broke process groups, whom it killed."""

    torn_down: bool = False
    killed: dict[int, str] = field(default_factory=dict)
    """rank -> why nbdist killed it (shown as the rank's death detail)."""


class InterruptLadder:
    """Climbs the steps for some ranks of one running cell, stopping once they are all done.
    Each step records what it did in the cell's ``result.actions``."""

    def __init__(self, run: RunningCell, tear_down_idle_peers: bool) -> None:
        self.run = run
        self.cluster = run.cluster
        self.config = run.config
        # the policy's call: tearing groups down is how gloo peers are released (not NCCL)
        self.tear_down_idle_peers = tear_down_idle_peers
        self.outcome = LadderOutcome()

    def climb(self, ranks: list[int], reason: str) -> LadderOutcome:
        """SIGINT -> (grace) -> make collectives still blocked fail (release signal) and tear down
        idle peers' groups -> (grace) -> SIGKILL those still stuck. `reason` names who asked."""
        stuck = set(ranks) & self.run.pending
        for rank in sorted(stuck):
            self.cluster.signal_rank(rank, signal.SIGINT)
        self.run.result.actions.append(
            f"sent SIGINT to rank(s) {format_ranks(sorted(stuck))} ({reason})"
        )
        sent = time.time()
        if self._wait_after_sigint(stuck) or self._wait_for_device(stuck, sent):
            return self.outcome
        stuck &= self.run.pending
        if self._release(stuck):
            if self._pump(self.config.faults.teardown_grace, stuck):
                return self.outcome
            stuck &= self.run.pending
        self._kill(stuck)
        return self.outcome

    def _wait_for_device(self, stuck: set[int], sent: float) -> bool:
        """NCCL ranks waiting on their GPU (`waiting_on_device`, from telemetry taken after
        SIGINT) get up to `device_wait_grace` to finish before their group is aborted; True if
        every rank stopped. The wait ends early once none of them waits on its GPU any more."""
        started = time.perf_counter()
        grace = self.config.faults.device_wait_grace
        device = self._on_device(stuck, sent)
        if not device:
            return False
        self.run.result.actions.append(
            f"rank(s) {format_ranks(device)} wait on the GPU, not on a peer: SIGINT takes effect "
            f"once the GPU is done; waiting up to {grace:g} s before the next step")
        while time.perf_counter() - started < grace and self._on_device(stuck, sent):
            step = min(self.config.internal.poll_interval * 5,
                       grace - (time.perf_counter() - started))
            if self._pump(step, stuck):
                return True
        return not (stuck & self.run.pending)

    def _on_device(self, stuck: set[int], sent: float) -> list[int]:
        waiting = sorted(stuck & self.run.pending)
        return [r for r in waiting if telemetry_time(self.cluster, r) > sent
                and waiting_on_device(self.cluster, r)]

    def _release(self, stuck: set[int]) -> bool:
        """Make blocked collectives fail; tear down idle peers' groups. True if it did either."""
        released = [r for r in sorted(stuck) if self.cluster.release_rank(r)]
        if released:
            self.outcome.torn_down = True
            self.run.result.actions.append(
                f"rank(s) {format_ranks(released)} stayed blocked inside a collective; made it"
                " fail there (the process group is rebuilt after the cell)"
            )
        idle = [
            p.spec.rank for p in self.cluster.ranks
            if p.state == "alive" and p.spec.rank not in self.run.pending
        ]
        if idle and self.tear_down_idle_peers:
            self.outcome.torn_down = True
            grace = self.config.faults.teardown_grace
            done = self.cluster.teardown_process_group(idle, timeout=grace)
            self.run.result.actions.append(
                f"tore down the process group on idle rank(s) {format_ranks(done)} to release "
                f"rank(s) {format_ranks(sorted(stuck))} blocked on them"
            )
        return bool(released or idle)

    def _kill(self, stuck: set[int]) -> None:
        for rank in sorted(stuck):
            where = where_text(self.cluster, rank)
            self.outcome.killed[rank] = (
                f"killed by nbdist (SIGKILL) after it stayed stuck{f' {where}' if where else ''}"
            )
            self.cluster.signal_rank(rank, signal.SIGKILL)
        self.run.result.actions.append(
            f"killed the engine of rank(s) {format_ranks(sorted(stuck))} (last step of the"
            " ladder); run %dist_restart (Cluster.restart()) for a full cluster"
        )
        self._pump(self.config.faults.kill_confirm_wait, stuck)
        # the kill is certain; do not wait for the notification
        for rank in stuck & self.run.pending:
            self.run.pending.discard(rank)
            self.cluster.mark_dead(rank, self.outcome.killed[rank])

    def _wait_after_sigint(self, stuck: set[int]) -> bool:
        """Give SIGINT time to work; True if every rank stopped. Cut short (after
        collective_grace) once each rank still running has sent telemetry taken after the signal
        that shows it inside a collective: those cannot see SIGINT, so waiting the full
        interrupt_grace would be wasted."""
        sent = time.time()
        started = time.perf_counter()
        grace = self.config.faults.interrupt_grace
        if self._pump(min(self.config.faults.collective_grace, grace), stuck):
            return True
        while time.perf_counter() - started < grace:
            waiting = stuck & self.run.pending
            fresh = all(telemetry_time(self.cluster, r) > sent for r in waiting)
            if fresh and all(blocked_in_collective(self.cluster, r) for r in waiting):
                return False
            left = grace - (time.perf_counter() - started)
            step = min(self.config.internal.poll_interval * 5, left)
            if self._pump(step, stuck):
                return True
        return not (stuck & self.run.pending)

    def _pump(self, seconds: float, ranks: set[int]) -> bool:
        """Wait for ranks to finish; a second KeyboardInterrupt skips to the next step."""
        try:
            return self.run.pump_until(seconds, ranks)
        except KeyboardInterrupt:
            self.run.result.actions.append("second interrupt: skipping to the next step")
            return not (ranks & self.run.pending)
