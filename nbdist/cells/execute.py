"""Run one cell on a set of ranks: dispatch, live output, results, errors — no IPython imports.

A cell reaches every rank, local or remote, over the cell channel (``nbdist.cluster.cell_channel``);
the notebook's main thread reads what comes back, renders it, watches deadlines and dead ranks,
and asks the fault policy (``nbdist.cells.policy``) what to do when something goes wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from nbdist.cells.breakpoints import BreakpointPrompts
from nbdist.cells.output import CellOutput, NullSink, OutputSink
from nbdist.cells.policy import FaultPolicy
from nbdist.cells.rank_errors import dead_rank_error, rank_error_from_remote
from nbdist.cells.rank_output import RankOutput, read_message
from nbdist.cells.result import CellResult, RankError
from nbdist.cells.running_cell import finished_with_error
from nbdist.cells.syntax import check_syntax
from nbdist.cells.widgets import relay_widgets
from nbdist.cluster.cell_channel import SEND_TIMEOUT_MS
from nbdist.errors import NbdistError
from nbdist.protocol.wire import (
    TELEMETRY_KEY,
    Cell,
    CellDone,
    Display,
    Malformed,
    Prompt,
    Stream,
    Telemetry,
)

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore

__all__ = ["CellResult", "OutputSink", "NullSink", "run_cell"]


def run_cell(
    cluster: ClusterCore,
    code: str,
    ranks: Iterable[int] | None = None,
    timeout: float | None = None,
    sink: OutputSink | None = None,
) -> CellResult:
    """Run `code` on `ranks` (all by default) and return the per-rank outcome. Never blocks past
    `timeout` (plus the interrupt ladder's bounded steps); KeyboardInterrupt runs the ladder.
    A cell that does not parse raises its SyntaxError here, before any rank sees it."""
    targets = cluster.targets(ranks)
    check_syntax(code)
    if timeout is None:
        timeout = cluster.config.faults.cell_timeout
    if timeout is not None and timeout <= 0:
        raise NbdistError(f"--timeout {timeout}: must be a positive number of seconds")
    return CellRun(cluster, code, targets, timeout, sink or NullSink()).execute()


class CellRun:
    """One execution of a cell; lives for the duration of `run_cell`. The mechanics only:
    dispatch, events, output, results; every decision after a fault is its `policy`'s."""

    def __init__(self, cluster: ClusterCore, code: str, targets: list[int], timeout: float | None,
                 sink: OutputSink) -> None:
        self.cluster = cluster
        self.config = cluster.config
        self.sink = sink
        self.targets = targets
        self.timeout = timeout
        self.result = CellResult(code=code, ranks=list(targets))
        self.pending: set[int] = set(targets)
        self.outputs: dict[int, RankOutput] = {}
        self.output = CellOutput(sink, self.config, cluster.workdir)
        self.displays_shown: dict[int, int] = {}
        self.finished_at: dict[int, float] = {}
        self.started = time.perf_counter()
        # first liveness check one interval in: a short cell then reads nothing from /proc
        self._next_dead_check = self.started + self.config.internal.dead_check_interval
        self.policy = FaultPolicy(self)
        self.channel = cluster.channel()
        self.breakpoints = BreakpointPrompts(self.channel, cluster.ranks, sink)
        self.token = self.channel.new_token()
        self._handlers: dict[type, Callable[[int, Any], None]] = {
            Stream: self._on_stream, Display: self._on_display, Telemetry: self._on_telemetry,
            Prompt: self.breakpoints.on_prompt, CellDone: self._on_done,
            Malformed: self._on_malformed}

    # ---------------------------------------------------------------- dispatch
    def execute(self) -> CellResult:
        self.cluster.telemetry.cell_has_metrics = False
        if self.cluster.controller_lost:
            # the channel could still run it, but nothing else works: say so before sending
            self._controller_lost()
            self._finalize()
            return self.result
        relay_widgets(self.channel, self.cluster.ranks)
        self._send()
        try:
            self.channel.hold()  # this thread reads the answers while the cell runs
            self._wait()
        except KeyboardInterrupt:
            self.result.interrupted = True
            self.policy.on_interrupt()
        finally:
            self.channel.release()
        self._finalize()
        return self.result

    def _send(self) -> None:
        import zmq

        for rank in self.targets:
            self.outputs[rank] = RankOutput()
            endpoint = self.cluster.ranks[rank].endpoint
            try:
                if endpoint is None:
                    raise NbdistError("the rank has no cell channel (its setup did not finish)")
                self.channel.send_message(rank, endpoint, Cell(self.token, self.result.code))
            except (zmq.Again, NbdistError) as exc:  # a full queue: the engine reads no cell
                self.pending.discard(rank)
                self.result.errors[rank] = RankError(
                    rank=rank, kind="lost", ename="NbdistError",
                    evalue=str(exc) if isinstance(exc, NbdistError) else
                    f"the rank took no new cell within {SEND_TIMEOUT_MS / 1000:g} s "
                    "(its engine is not reading any)")

    # ---------------------------------------------------------------- waiting
    def _wait(self) -> None:
        deadline = None if self.timeout is None else self.started + self.timeout
        while self.pending:
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                self.result.timed_out = True
                self.policy.on_deadline()
                return
            wait = self.config.internal.poll_interval * 5
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - now))
            self.pump(wait)
            if self.cluster.controller_lost:
                self._controller_lost()
                return
            self.policy.while_waiting()

    def pump(self, wait: float) -> None:
        """Handle events for up to `wait` seconds (returns early once something arrived, or when
        output held back is due)."""
        due = self.output.tick()
        if due is not None:
            wait = min(wait, due)
        for message in self.channel.receive(wait):
            out = self.outputs.get(message.rank)
            if message.token != self.token or out is None:
                continue  # an earlier cell's late output, given up on
            body = read_message(message.body, out)
            if body is not None:
                self._handlers[type(body)](message.rank, body)
        now = time.perf_counter()
        if now >= self._next_dead_check:
            self._next_dead_check = now + self.config.internal.dead_check_interval
            for rank, detail in self.cluster.poll_dead().items():
                if rank in self.pending:
                    self.pending.discard(rank)
                    self.finished_at[rank] = now
                    self.output.rank_done(rank, "dead")
                    self.sink.on_status(f"nbdist: rank {rank} died ({detail})")

    def pump_until(self, seconds: float, ranks: set[int] | None = None) -> bool:
        """Pump until `ranks` (default: all pending) finish or time is up; True if they did."""
        end = time.perf_counter() + seconds
        watch = self.pending if ranks is None else ranks
        while watch & self.pending:
            remaining = end - time.perf_counter()
            if remaining <= 0:
                return False
            self.pump(min(remaining, self.config.internal.poll_interval * 5))
        return True

    def _on_stream(self, rank: int, stream: Stream) -> None:
        self.output.stream(rank, stream.name, stream.text)

    def _on_display(self, rank: int, display: Display) -> None:
        self.displays_shown[rank] = self.displays_shown.get(rank, 0) + 1
        self.sink.on_display(rank, display.content)

    def _on_telemetry(self, rank: int, telemetry: Telemetry) -> None:
        payload = telemetry.data[TELEMETRY_KEY]
        self.cluster.telemetry.publish(rank, payload)
        try:
            self.sink.on_telemetry(rank, payload)
        except Exception:
            pass  # the dashboard path never breaks a cell

    def _on_done(self, rank: int, _done: Any = None) -> None:
        if rank in self.pending:
            self.pending.discard(rank)
            self.finished_at[rank] = time.perf_counter()
            failed = finished_with_error(self, rank)
            self.output.rank_done(rank, "failed" if failed else "finished")

    def _on_malformed(self, rank: int, malformed: Malformed) -> None:
        self.sink.on_status(f"nbdist: rank {rank}: {malformed.reason}")
        if malformed.tag == CellDone.TAG:
            self._on_done(rank)

    def _controller_lost(self) -> None:
        for rank in sorted(self.pending):
            self.result.errors[rank] = RankError(rank=rank, kind="lost", evalue="controller lost")
        self.pending.clear()
        self.result.actions.append(
            "the ipyparallel controller is gone (controller lost): run %dist_restart "
            "(Cluster.restart()) to start a new controller and engines"
        )

    # ---------------------------------------------------------------- results
    def _finalize(self) -> None:
        result = self.result
        for rank in self.targets:
            out = self.outputs.get(rank)
            if out is None:
                continue
            for name in ("stdout", "stderr"):
                full = getattr(out, name)
                getattr(result, name)[rank] = full
                self.output.finish_stream(rank, name, full)
            result.displays[rank] = list(out.outputs)
            if out.execute_result:
                result.results[rank] = out.execute_result
            if rank in result.errors:
                continue
            if self.cluster.ranks[rank].state == "dead":
                result.errors[rank] = self._dead_rank_error(rank)
            elif out.error is not None:
                result.errors[rank] = rank_error_from_remote(rank, out.error)
        self.output.close(result)
        self.policy.after_cell()
        result.report = self.policy.hang_report + result.report
        result.elapsed = time.perf_counter() - self.started

    def _dead_rank_error(self, rank: int) -> RankError:
        # nbdist's own kill says where the rank was stuck: better than the bare exit signal
        detail = (
            self.policy.killed.get(rank)
            or self.cluster.ranks[rank].exit_detail
            or "engine process exited"
        )
        out = self.outputs.get(rank) or RankOutput()
        # faulthandler dumps every thread after its "Fatal Python error" line: read past them
        return dead_rank_error(rank, detail, out.stdout + out.stderr,
                               self.cluster.engine_log_tail(rank, 400))
