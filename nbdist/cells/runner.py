"""Run one cell on a set of ranks: dispatch, live output, results, errors — no IPython imports.

A cell reaches local ranks over the direct channel (``nbdist.cells.direct``), read on the
caller's thread; through ipyparallel otherwise (ranks on other machines), whose
output and telemetry arrive on its IO thread, where callbacks only enqueue them. Either way the
caller's thread (the notebook's main thread) renders them, watches deadlines and dead ranks, and
asks the fault policy (``nbdist.cells.policy``) what to do when something goes wrong.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nbdist.cells.breakpoints import BreakpointPrompts
from nbdist.cells.direct import new_metadata, read_message
from nbdist.cells.output import NullSink, OutputSink
from nbdist.cells.policy import FaultPolicy
from nbdist.cells.rank_errors import dead_rank_error, rank_error_from_remote
from nbdist.cells.result import CellResult, RankError
from nbdist.cells.syntax import check_syntax
from nbdist.cluster.cell_channel import SEND_TIMEOUT_MS
from nbdist.errors import NbdistError
from nbdist.worker.agent import TELEMETRY_KEY

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore
    from nbdist.cluster.cell_channel import NotebookChannel

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
        self.events: queue.SimpleQueue[tuple[int, str, Any]] = queue.SimpleQueue()
        self.asyncs: dict[int, Any] = {}
        self.metadata: dict[int, dict[str, Any]] = {}
        self.streamed: dict[tuple[int, str], int] = {}
        self.truncated: set[tuple[int, str]] = set()
        self.displays_shown: dict[int, int] = {}
        self.callbacks: list[tuple[Any, Any]] = []
        self.finished_at: dict[int, float] = {}
        self.started = time.perf_counter()
        # first liveness check one interval in: a short cell then costs no /proc reads (~2 ms)
        self._next_dead_check = self.started + self.config.internal.dead_check_interval
        self.policy = FaultPolicy(self)
        self.breakpoints = BreakpointPrompts(cluster.workdir, sink)
        self.direct: NotebookChannel | None = None  # the cell went over the direct channel
        self.token = ""

    # ---------------------------------------------------------------- dispatch
    def execute(self) -> CellResult:
        self.cluster.telemetry.cell_has_metrics = False
        if self.cluster.controller_lost:
            # the direct channel could still run it, but nothing else works: say so before sending
            self._controller_lost()
            self._finalize()
            return self.result
        try:
            ports = self._direct_ports()
            if ports is not None:
                self._send_direct(ports)
            else:
                self._send_through_ipyparallel()
            try:
                self._wait()
            except KeyboardInterrupt:
                self.result.interrupted = True
                self.policy.on_interrupt()
        finally:
            self._detach()
        self._finalize()
        return self.result

    def _direct_ports(self) -> dict[int, int] | None:
        """Each target's direct cell channel (nbdist.cells.direct), or None: through ipyparallel."""
        if not (self.config.start.direct_cells and self.cluster.cell_channel):
            return None
        ports = {rank: self.cluster.ranks[rank].cell_port for rank in self.targets}
        return None if None in ports.values() else ports  # type: ignore[return-value]

    def _send_direct(self, ports: dict[int, int]) -> None:
        import zmq

        channel = self.direct = self.cluster.cell_channel
        assert channel is not None
        self.token = channel.new_token()
        for rank, port in ports.items():
            self.metadata[rank] = new_metadata()
            try:
                channel.send_cell(rank, port, self.token, self.result.code)
            except zmq.Again:  # its queue is full: the engine has not read a cell in a long while
                self.pending.discard(rank)
                self.result.errors[rank] = RankError(
                    rank=rank, kind="lost", ename="NbdistError",
                    evalue=f"the rank took no new cell within {SEND_TIMEOUT_MS / 1000:g} s "
                           "(its engine is not reading any)")

    def _send_through_ipyparallel(self) -> None:
        # views first: building one is ~0.4 ms of Python, and doing it between sends makes
        # the main thread and ipyparallel's IO thread trade the GIL once per rank
        views = {rank: self.cluster.view(rank) for rank in self.targets}
        for rank in self.targets:
            ar = views[rank].execute(self.result.code, silent=False, block=False)
            self.asyncs[rank] = ar
            # the AsyncResult's own metadata dict: client.metadata[msg_id] may already have
            # been dropped by ipyparallel, and the lookup then makes a new, empty one (the
            # rank's value and output lost: 3 cells in 300 here)
            self.metadata[rank] = ar.metadata
            self._attach(rank, ar)

    def _receive_direct(self, wait: float) -> None:
        assert self.direct is not None
        for message in self.direct.receive(wait):
            md = self.metadata.get(message.rank)
            if message.token != self.token or md is None:
                continue  # an earlier cell's late output, given up on
            event = read_message(message, md)
            if event is not None:
                self._handle(message.rank, *event)

    def _attach(self, rank: int, ar: Any) -> None:
        def on_iopub(msg: dict[str, Any]) -> None:
            msg_type = msg["header"]["msg_type"]
            if msg_type == "stream":
                self.events.put((rank, "stream", msg["content"]))
            elif msg_type == "display_data":
                self.events.put((rank, "display", msg["content"]))
            elif msg_type == "data_message":
                payload = self.metadata[rank]["data"].get(TELEMETRY_KEY)
                if payload is not None:
                    self.events.put((rank, "telemetry", payload))

        def on_done(_future: Any) -> None:
            self.events.put((rank, "done", None))

        for child in ar._children:
            child.iopub_callbacks.append(on_iopub)
            self.callbacks.append((child, on_iopub))
        ar._output_future.add_done_callback(on_done)

    def _detach(self) -> None:
        for child, callback in self.callbacks:
            try:
                child.iopub_callbacks.remove(callback)
            except ValueError:
                pass
        self.callbacks.clear()

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
        """Handle events for up to `wait` seconds (returns early once something arrived)."""
        if self.direct is not None:
            self._receive_direct(wait)
            wait = 0.0  # and whatever ipyparallel delivered meanwhile (nothing, for a cell)
        try:
            item = self.events.get(timeout=wait) if wait > 0 else self.events.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            self._handle(*item)
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                item = None
        now = time.perf_counter()
        if now >= self._next_dead_check:
            self._next_dead_check = now + self.config.internal.dead_check_interval
            for rank, detail in self.cluster.poll_dead().items():
                if rank in self.pending:
                    self.pending.discard(rank)
                    self.finished_at[rank] = now
                    self.sink.on_status(f"nbdist: rank {rank} died ({detail})")

    def pump_until(self, seconds: float, ranks: set[int] | None = None) -> bool:
        """Pump until the given ranks (default: all pending) are done or time is up; True if done."""
        end = time.perf_counter() + seconds
        watch = self.pending if ranks is None else ranks
        while watch & self.pending:
            remaining = end - time.perf_counter()
            if remaining <= 0:
                return False
            self.pump(min(remaining, self.config.internal.poll_interval * 5))
        return True

    def _handle(self, rank: int, kind: str, content: Any) -> None:
        if kind == "stream":
            self._emit_stream(rank, content["name"], content["text"])
        elif kind == "display":
            self.displays_shown[rank] = self.displays_shown.get(rank, 0) + 1
            self.sink.on_display(rank, content)
        elif kind == "telemetry" and "debug" in content:
            self.breakpoints.on_payload(rank, content["debug"])  # a rank stopped at breakpoint()
        elif kind == "telemetry":
            self.cluster.telemetry.publish(rank, content)
            try:
                self.sink.on_telemetry(rank, content)
            except Exception:
                pass  # the dashboard path never breaks a cell
        elif kind == "done":
            if rank in self.pending:
                self.pending.discard(rank)
                self.finished_at[rank] = time.perf_counter()

    def _emit_stream(self, rank: int, name: str, text: str) -> None:
        key = (rank, name)
        shown = self.streamed.get(key, 0)
        limit = self.config.output.max_output_chars
        self.streamed[key] = shown + len(text)
        if key in self.truncated:
            return
        if shown + len(text) > limit:
            keep = max(0, limit - shown)
            if keep:
                self.sink.on_stream(rank, name, text[:keep])
            self.truncated.add(key)
            self.sink.on_status(
                f"nbdist: rank {rank} {name} truncated after {limit:,} characters "
                f"(NbdistConfig.max_output_chars; the full text is in the result's .{name}[{rank}])"
            )
            return
        self.sink.on_stream(rank, name, text)

    def _emit_tail(self, rank: int, name: str, full: str) -> None:
        """After a truncated stream, its last lines: where a flood ends is what matters (the
        final loss, the error message), and the head alone would hide it."""
        tail = full[-self.config.output.output_tail_chars:]
        if len(tail) < len(full) and "\n" in tail[:-1]:
            tail = tail[tail.index("\n") + 1:]  # start on a whole line
        omitted = len(full) - self.config.output.max_output_chars - len(tail)
        if omitted <= 0:
            tail = full[self.config.output.max_output_chars:]
        self.sink.on_status(f"nbdist: rank {rank} {name}: {max(omitted, 0):,} characters left out; "
                            f"its last {len(tail):,}:")
        self.sink.on_stream(rank, name, tail)

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
            md = self.metadata.get(rank)
            if md is None:
                continue
            for name in ("stdout", "stderr"):
                full = md.get(name) or ""
                getattr(result, name)[rank] = full
                shown = self.streamed.get((rank, name), 0)
                if len(full) > shown:  # output that raced the callbacks' registration
                    self._emit_stream(rank, name, full[shown:])
                if (rank, name) in self.truncated:
                    self._emit_tail(rank, name, full)
            outputs = md.get("outputs") or []
            result.displays[rank] = list(outputs)
            for content in outputs[self.displays_shown.get(rank, 0):]:
                self.sink.on_display(rank, content)
            if md.get("execute_result"):
                result.results[rank] = md["execute_result"]
            if rank in result.errors:
                continue
            proc = self.cluster.ranks[rank]
            if proc.state == "dead":
                result.errors[rank] = self._dead_rank_error(rank)
                continue
            error = md.get("error")
            if error is None and rank in self.asyncs and self.asyncs[rank].done():
                error = _exception_of(self.asyncs[rank])
            if error is not None:
                result.errors[rank] = rank_error_from_remote(rank, error)
        self.policy.after_cell()
        result.report = self.policy.hang_report + result.report
        result.elapsed = time.perf_counter() - self.started

    def _dead_rank_error(self, rank: int) -> RankError:
        # nbdist's own kill says where the rank was stuck: better than the bare exit signal
        detail = self.policy.killed.get(rank) or self.cluster.ranks[rank].exit_detail or "engine process exited"
        md = self.metadata.get(rank, {})
        output = (md.get("stdout") or "") + (md.get("stderr") or "")
        # faulthandler dumps every thread after its "Fatal Python error" line: read past them
        return dead_rank_error(rank, detail, output, self.cluster.engine_log_tail(rank, 400))


def _exception_of(ar: Any) -> Any:
    try:
        exc = ar.exception(timeout=0)
    except Exception:
        return None
    if exc is None:
        return None
    elist = getattr(exc, "elist", None)
    if elist:
        return elist[0]
    return exc
