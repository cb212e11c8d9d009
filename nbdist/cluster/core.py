"""`ClusterCore`: ipyparallel engines started, set up, restarted and stopped as torch ranks; it
owns the rank table and the process-group generation, and stops what it started by PID."""

from __future__ import annotations

import atexit
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from nbdist import ipp_compat
from nbdist.cluster import rank_setup
from nbdist.cluster.arguments import (
    check_cluster_arguments,
    check_pushed_values,
    check_variable_name,
    share_gpu_chosen,
)
from nbdist.cluster.cell_channel import NotebookChannel, open_channel
from nbdist.cluster.gather import Gathered
from nbdist.cluster.launch_modes import AttachedMode, LaunchMode, Progress, launch_mode
from nbdist.cluster.liveness import Liveness
from nbdist.cluster.processes import OwnedProcesses
from nbdist.cluster.ranks import RankProcess, check_targets, validate_backend
from nbdist.cluster.rendezvous import Rendezvous
from nbdist.cluster.telemetry import TelemetryHub
from nbdist.config import DEFAULT, NbdistConfig
from nbdist.errors import ClusterNotRunningError, ClusterStartError, Interrupted, NbdistError
from nbdist.worker.net import free_port

__all__ = ["ClusterCore", "Progress", "RankProcess", "free_port"]


class ClusterCore:
    """A local (or launcher-provided) set of ranks forming one torch.distributed process group
    (`nbdist.Cluster` adds cells, status and dashboards)."""

    def __init__(self, n: int | None = None, backend: str = "auto", gpus_per_rank: int = 1,
                 threads: int | None = None, config: NbdistConfig | None = None,
                 master_addr: str | None = None, launcher: str = "local",
                 launcher_options: dict[str, Any] | None = None, profile: str | None = None,
                 interface: str | None = None) -> None:
        """`launcher`: local, mpi, slurm or ssh (`launcher_options`: nbdist.cluster.launchers).
        `profile`: the engines already running in that ipyparallel profile (`Cluster.attach`).
        `master_addr`: default 127.0.0.1 on one host, rank 0's address across hosts.
        `interface`: the network interface ranks talk over (GLOO/NCCL_SOCKET_IFNAME)."""
        options = check_cluster_arguments(
            n=n, gpus_per_rank=gpus_per_rank, threads=threads, config=config,
            master_addr=master_addr, launcher=launcher, launcher_options=launcher_options,
            profile=profile, interface=interface)
        self.requested_n = n
        self.requested_backend = validate_backend(backend, gpus_per_rank)
        self.gpus_per_rank = gpus_per_rank
        self.requested_threads = threads
        self.interface = interface
        self.launcher = launcher
        self.telemetry = TelemetryHub()
        self.backend = ""
        self.generation = -1
        self.ranks: list[RankProcess] = []
        self.start_seconds = 0.0
        self.controller_lost = False
        self._processes = OwnedProcesses(config or DEFAULT)
        self._liveness = Liveness(self, self._processes)
        self.launch_mode: LaunchMode = launch_mode(  # checks the launcher and its options
            self._processes, self._liveness.record_exit, launcher=launcher, options=options,
            interface=interface, profile=profile)
        self.rendezvous = Rendezvous(master_addr, interface)
        self.cell_channel: NotebookChannel | None = None  # cells to every rank

    @property
    def config(self) -> NbdistConfig:
        return self._processes.config

    @config.setter
    def config(self, config: NbdistConfig) -> None:
        self._processes.config = config  # its engines, liveness and launch mode read it there

    @property
    def running(self) -> bool:
        return self.launch_mode.client is not None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def client(self) -> Any:
        self._require_running()
        return self.launch_mode.client

    @property
    def workdir(self) -> str:
        return self._processes.workdir

    @property
    def master_addr(self) -> str:
        return self.rendezvous.master_addr

    def channel(self) -> NotebookChannel:
        self._require_running()
        return self.cell_channel  # type: ignore[return-value]

    def is_registered(self, engine_id: int) -> bool:
        """The controller still lists this engine (True when there is no client to ask)."""
        return not self.running or engine_id in self.launch_mode.client.ids

    def mark_dead(self, rank: int, detail: str, notify: bool = True) -> None:
        """The one place a rank becomes dead. `notify=False` off the notebook's thread (poll_dead
        tells the listeners later) and on stop."""
        self.ranks[rank].state, self.ranks[rank].exit_detail = "dead", detail
        if notify:
            self.telemetry.rank_state(rank, "dead", detail)

    def _require_running(self) -> None:
        if not self.running:
            raise ClusterNotRunningError("no cluster is running: start one with %dist_start "
                                         "(or nbdist.Cluster(...).start())")

    def targets(self, ranks: Iterable[int] | None) -> list[int]:
        """The ranks a call goes to (all by default), checked to exist and be alive."""
        self._require_running()
        return check_targets(self.ranks, ranks)

    def attach_to(self, target: dict[str, Any]) -> None:
        """Use the engines of the ipyparallel cluster `target` names (Client's arguments)."""
        self.launch_mode = AttachedMode(self._processes, self._liveness.record_exit, target)

    def start(self, progress: Progress | None = None) -> ClusterCore:
        """Start controller and engines, give them ranks and a process group; return once a real
        all_reduce succeeded on every rank. On failure nothing is left running."""
        if self.running:
            return self
        started = time.perf_counter()
        self._check_gpu_to_share()
        self._processes.create_workdir()
        try:
            say = progress or (lambda _msg: None)
            engine_ids = self.launch_mode.start(self.requested_n, say)
            ipp_compat.on_unregistration(self.launch_mode.client, self._liveness.engine_lost)
            self._bootstrap(say, engine_ids)
        except BaseException as exc:
            self._teardown_processes()
            if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
                raise Interrupted("the start was interrupted: everything it had started is "
                                  "stopped") from None
            raise
        self.start_seconds = time.perf_counter() - started
        atexit.register(_stop_at_exit, weakref.ref(self))
        return self

    @property
    def share_gpu(self) -> bool:
        """Whether ranks that outnumber the GPUs share them (--share-gpu, NBDIST_SHARE_GPU)."""
        return share_gpu_chosen(self.config.start.share_gpu)

    def _check_gpu_to_share(self) -> None:
        """--share-gpu on engines started here: this machine's GPUs counted before any starts
        (engines elsewhere are checked once they tell what they see)."""
        plan = self.launch_mode.plan
        if not self.share_gpu or plan is None or plan.spans_hosts:
            return
        if plan.launcher == "local" and rank_setup.local_gpu_count() == 0:
            rank_setup.require_gpu_to_share({"this machine": 0})

    def _bootstrap(self, say: Progress, ids: list[int]) -> None:
        client, mode = self.launch_mode.client, self.launch_mode
        say(f"{len(ids)} engine(s) registered; setting up ranks")
        probes = rank_setup.probe(client, ids, self.config.start.bootstrap_timeout)
        specs = rank_setup.plan_ranks(probes, self.requested_backend, self.gpus_per_rank,
                                      [p.spec.host for p in self.ranks] or None,
                                      share_gpu=self.share_gpu)
        self.backend = specs[0].backend
        sharing = rank_setup.sharing_note(specs)
        if sharing:
            say(sharing)
        self.rendezvous.choose(mode.spans_hosts, specs, probes)
        self.cell_channel = open_channel(self.cell_channel, client,
                                         self.rendezvous.notebook_host(client, probes),
                                         curve=mode.curve or self.rendezvous.spans_hosts)
        threads = rank_setup.rank_threads(specs, probes, self.requested_threads)
        self.ranks = rank_setup.new_generation(self, specs, probes, threads, living=[])
        for note in dict.fromkeys(note for rank in self.ranks for note in rank.notes):
            say(note)

    def all_pids(self) -> list[int]:
        return [pid for pid, _ct in self.launch_mode.owned_pids(self.ranks)]

    def poll_dead(self) -> dict[int, str]:
        """Ranks whose engine exited since the last check: rank -> 'signal 9' etc."""
        return self._liveness.poll_dead()

    def engine_log_tail(self, rank: int, lines: int) -> str:
        return self.launch_mode.log_tail(self.ranks[rank].pid, lines)

    def release_rank(self, rank: int) -> bool:
        """Make the collective a rank is blocked in fail (nbdist.worker.release); False if its
        engine has no such signal (not started by nbdist)."""
        proc = self.ranks[rank]
        if proc.release_signal is None or proc.state != "alive":
            return False
        self.launch_mode.signal(proc, proc.release_signal)
        return True

    def signal_rank(self, rank: int, sig: int) -> None:
        self.launch_mode.signal(self.ranks[rank], sig)

    def teardown_process_group(self, ranks: Iterable[int], timeout: float) -> list[int]:
        """Destroy the group on these (idle) ranks so peers blocked on them fail at once;
        returns the ranks where that finished in time."""
        return list(self.call("group.teardown", ranks=ranks, timeout=timeout).results)

    def rebuild_process_group(self) -> float:
        """New generation on a fresh port on every rank; returns seconds taken."""
        self._require_running()
        dead = [p.spec.rank for p in self.ranks if p.state == "dead"]
        if dead:
            raise NbdistError(
                f"rank(s) {dead} are dead: the process group cannot be rebuilt without them. "
                "Run %dist_restart (Cluster.restart()) for a full cluster.")
        started = time.perf_counter()
        rank_setup.new_generation(self, [], {}, {}, living=self.ranks)
        return time.perf_counter() - started

    def push(self, values: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Bind names on the ranks; tensors go to CPU for the trip and to each rank's device."""
        targets = [self.ranks[r] for r in self.targets(ranks)]
        values = check_pushed_values(values)
        try:
            gathered = self.channel().call(targets, "values.receive", (values,),
                                           self.config.start.bootstrap_timeout)
        except KeyboardInterrupt:
            raise Interrupted(f"the push of {', '.join(values)} was interrupted: some ranks may "
                              "have the new values and others not; push again before using "
                              "them") from None
        if gathered.failures:
            lines = [f"rank {rank}: {why}" for rank, why in sorted(gathered.failures.items())]
            raise ClusterStartError("push failed:\n" + "\n".join(lines))

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """One name from the ranks, {rank: value} in rank order (tensors arrive on CPU); the
        notebook's `__main__` rebuilds a value's cell-defined classes."""
        targets = [self.ranks[r] for r in self.targets(ranks)]
        check_variable_name(name, "pull")
        try:
            gathered = self.channel().call(targets, "values.send", ([name],),
                                           self.config.start.bootstrap_timeout)
        except KeyboardInterrupt:
            raise Interrupted(f"the pull of {name!r} was interrupted: nothing was fetched; the "
                              "ranks still hold it") from None
        if gathered.failures:
            first = min(gathered.failures)
            raise NbdistError(f"pull {name!r} from rank {first}: {gathered.failures[first]}")
        return {r: gathered.results[r][name] for r in sorted(gathered.results)}

    def call(self, command: str | Callable[..., Any], *args: Any,
             ranks: Iterable[int] | None = None, timeout: float | None = None) -> Gathered[int]:
        """The rank command `command` (its name, or the function registered under it) with
        `args` on the ranks: each rank's result, or why it has none (it raised, refused the
        command, is dead, did not answer in time); never raises for one. A command of the rank
        service's own thread answers while a cell runs there or pdb waits; one that touches the
        rank's namespace answers once the rank is done with a running cell."""
        command = command_name(command)
        self._require_running()
        self.poll_dead()
        wanted = list(range(self.world_size) if ranks is None else ranks)
        alive = [self.ranks[r] for r in wanted if self.ranks[r].state == "alive"]
        wait = self.config.start.bootstrap_timeout if timeout is None else timeout
        gathered = self.channel().call(alive, command, args, wait)
        gathered.failures.update({r: f"rank {r} is dead ({self.ranks[r].exit_detail})"
                                  for r in wanted if self.ranks[r].state != "alive"})
        return gathered

    def restart(self, progress: Progress | None = None) -> ClusterCore:
        """Same ranks, new engines, new process group (after a dead rank or a lost controller)."""
        say, mode = progress or (lambda _msg: None), self.launch_mode
        n = self.world_size or rank_setup.rank_count(self.requested_n, mode.plan)
        started = time.perf_counter()
        if not mode.can_restart_in_place(self.controller_lost):
            self._teardown_processes()
            self.ranks = []
            self.controller_lost = False
            self.start(progress)
        else:
            try:
                self._bootstrap(say, mode.restart_engines(n, self.ranks, say))
            except KeyboardInterrupt:
                # stop the engines started so far (half set up, they would hold ports and wait
                # for peers; the mode's loop thread may still be launching some) and leave every
                # rank dead, for the next restart
                mode.stop_engines(self.ranks)
                for proc in self.ranks:
                    if proc.state == "alive":
                        self.mark_dead(proc.spec.rank, "stopped: the restart was interrupted")
                raise Interrupted(
                    "the restart was interrupted: the engines it had started are stopped and no "
                    "rank is running; run %dist_restart (Cluster.restart()) again for a full "
                    "cluster") from None
        for proc in self.ranks:
            self.telemetry.rank_state(proc.spec.rank, "restarted", f"pid {proc.pid}")
        self.start_seconds = time.perf_counter() - started
        return self

    def replace_dead(self, progress: Progress | None = None) -> list[int]:
        """New processes for the dead ranks only (same numbers and devices) and a new group for
        all: the living keep their variables, the new start empty (no setup cell is re-run: it
        may hold collectives the others would repeat). Returns the ranks replaced."""
        self._require_running()
        self.poll_dead()
        dead = [p for p in self.ranks if p.state == "dead"]
        if not dead:
            return []
        started, mode = time.perf_counter(), self.launch_mode
        say = progress or (lambda _msg: None)
        mode.check_replaceable(self.controller_lost)
        alive = [p for p in self.ranks if p.state == "alive"]
        if not alive:
            raise NbdistError("every rank is dead: nothing is left to keep; run %dist_restart "
                              "(Cluster.restart())")
        say(f"replacing rank(s) {', '.join(str(p.spec.rank) for p in dead)}; "
            f"rank(s) {', '.join(str(p.spec.rank) for p in alive)} keep their state")
        # the living ranks' group waits for a dead peer: end it so they can join the new one
        self.teardown_process_group([p.spec.rank for p in alive],
                                    timeout=self.config.start.rebuild_timeout)
        new_ids = mode.start_replacements(len(dead), self.ranks, say)
        probes = rank_setup.probe(mode.client, new_ids, self.config.start.bootstrap_timeout)
        specs = [dataclasses.replace(p.spec, engine_id=eid)
                 for p, eid in zip(dead, new_ids, strict=True)]
        # the rank it replaces had its host's share of the cores worked out already
        threads = {p.spec.rank: self.requested_threads or p.threads for p in dead}
        for proc in rank_setup.new_generation(self, specs, probes, threads, living=alive):
            self.ranks[proc.spec.rank] = proc
            self.telemetry.rank_state(proc.spec.rank, "restarted", f"pid {proc.pid}")
        self.start_seconds = time.perf_counter() - started
        return [s.rank for s in specs]

    def stop(self) -> list[int]:
        """Stop every process this cluster started; returns their PIDs."""
        pids = self.all_pids()
        self._teardown_processes()
        return pids

    def _teardown_processes(self) -> None:
        self.launch_mode.stop(self.ranks)
        if self.cell_channel is not None:  # after the ranks: without it they would end themselves
            self.cell_channel.close()
        self.cell_channel = None
        self._processes.remove_workdir()
        for proc in self.ranks:
            self.mark_dead(proc.spec.rank, "stopped", notify=False)

    def __enter__(self) -> ClusterCore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        if not self.running:
            return "<nbdist.Cluster (not running)>"
        return (f"<nbdist.Cluster {self.world_size} ranks, {self.backend}, "
                f"generation {self.generation}>")


def command_name(command: str | Callable[..., Any]) -> str:
    """A command's name; a function (as callers named commands before the rank service) by the
    name it is registered under in this process."""
    if isinstance(command, str):
        return command
    from nbdist.worker.rank_service import COMMANDS

    found = next((c.name for c in COMMANDS.values() if c.function is command), None)
    if found is None:
        name = getattr(command, "__qualname__", repr(command))
        raise NbdistError(f"{name} is not a rank command: a rank runs only the commands its "
                          f"service registers ({', '.join(sorted(COMMANDS))}); run code on the "
                          "ranks with Cluster.run")
    return found


def _stop_at_exit(ref: weakref.ReferenceType[ClusterCore]) -> None:
    cluster = ref()
    if cluster is not None and cluster.running:
        cluster.stop()
