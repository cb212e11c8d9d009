"""Which ranks are still alive: local engines' exit statuses, engines the controller dropped, a
Slurm job's end, turned into dead ranks with a reason by the one poll, `poll_dead`."""

from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from nbdist.cluster.processes import OwnedProcesses
from nbdist.cluster.ranks import RankProcess
from nbdist.worker.process_tree import same_process

if TYPE_CHECKING:  # pragma: no cover
    from nbdist.cluster import ClusterCore

class Liveness:
    """Exit statuses and lost engines as they are learnt (any thread), reported by poll_dead."""

    def __init__(self, cluster: ClusterCore, processes: OwnedProcesses) -> None:
        self.cluster = cluster
        self.processes = processes
        self._lock = threading.Lock()
        self._exit_codes: dict[int, Any] = {}
        self._lost_ranks: list[int] = []

    def record_exit(self, stop_data: dict[str, Any]) -> None:
        """A launcher's on_stop callback (on its wait thread)."""
        with self._lock:
            self._exit_codes[int(stop_data.get("pid", -1))] = stop_data.get("exit_code")

    def engine_lost(self, engine_id: int) -> None:
        """The controller dropped this engine (ipp_compat.on_unregistration, on ipyparallel's IO
        thread): a remote rank is dead at once, before ipyparallel makes its task an EngineError
        (a cell finishing now reports "died", with the host, not "raised"), and queued so that
        poll_dead, on the notebook's thread, tells the listeners."""
        with self._lock:
            for proc in self.cluster.ranks:
                here = self.cluster.launch_mode.pid_is_here(proc)
                if proc.spec.engine_id == engine_id and proc.state == "alive" and not here:
                    self.cluster.mark_dead(proc.spec.rank, _lost_detail(proc), notify=False)
                    self._lost_ranks.append(proc.spec.rank)

    def poll_dead(self) -> dict[int, str]:
        """Ranks found dead since the last check, with why; also a lost controller."""
        cluster, job = self.cluster, self.cluster.launch_mode.job
        with self._lock:
            lost, self._lost_ranks = self._lost_ranks, []
        newly_dead = {rank: cluster.ranks[rank].exit_detail for rank in lost}
        for rank, detail in newly_dead.items():
            cluster.telemetry.rank_state(rank, "dead", detail)
        job_end = job.ended_detail() if job else None  # cancelled, time limit...
        for proc in (p for p in cluster.ranks if p.state == "alive"):  # one may die meanwhile
            detail = job_end or self._exit_detail(proc)
            if detail is not None and job and job_end is None:  # the job's end is the cause
                job_end = job.ended_detail(fresh=True)
                detail = job_end or detail
            if detail is not None:
                cluster.mark_dead(proc.spec.rank, detail)
                newly_dead[proc.spec.rank] = detail
        if self.processes.controller and not self.processes.controller_alive():
            cluster.controller_lost = True
        return newly_dead

    def _exit_detail(self, proc: RankProcess) -> str | None:
        """Why this rank's engine is gone; None while it runs and the controller lists it."""
        if not self.cluster.launch_mode.pid_is_here(proc):
            return None if self.cluster.is_registered(proc.spec.engine_id) else _lost_detail(proc)
        if same_process(proc.pid, proc.create_time) is not None:
            if self.cluster.is_registered(proc.spec.engine_id):
                return None
            self.cluster.signal_rank(proc.spec.rank, signal.SIGKILL)  # dropped: unusable, end it
            return "unregistered from the controller"
        code = self._wait_exit_code(proc.pid)  # recorded already, or a moment after the reaping
        if not isinstance(code, int):
            return "exited (exit status unknown)"
        if code >= 0:
            return f"exited with code {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (signal {-code})"

    def _wait_exit_code(self, pid: int) -> Any:
        """The launcher's wait thread reaps the engine and records its status a moment later."""
        internal = self.processes.config.internal
        deadline = time.monotonic() + internal.exit_status_timeout
        while time.monotonic() < deadline:
            with self._lock:
                if pid in self._exit_codes:
                    return self._exit_codes[pid]
            time.sleep(internal.exit_status_poll_interval)
        return "unknown"


def _lost_detail(proc: RankProcess) -> str:
    return (f"engine on {proc.spec.host} lost: the controller stopped hearing its heartbeat "
            "(process or host gone)")
