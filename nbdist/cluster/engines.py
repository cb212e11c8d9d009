"""A cluster's engines as ipyparallel gives them: `LaunchMode`, what every launch mode answers
(client, registration, signals), and `LaunchedMode`, the controller and engines nbdist starts.
PIDs only ever come from launchers whose processes run on this machine (`has_local_pid`)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from subprocess import CalledProcessError
from typing import Any

from nbdist import ipp_compat
from nbdist.cluster import rank_setup, slurm
from nbdist.cluster.controller import controller_command
from nbdist.cluster.fork_launcher import ForkServerProcess
from nbdist.cluster.gather import gather
from nbdist.cluster.launchers import (
    ENGINE_LOG_NOISE,
    ENGINE_SET_CLASS,
    LauncherPlan,
    build_launcher_plan,
    engine_set_launchers,
    has_local_pid,
    warn_unauthenticated_rendezvous,
)
from nbdist.cluster.processes import OwnedProcesses, Pid, private_files, process_trees
from nbdist.cluster.ranks import RankProcess
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterStartError, NbdistError
from nbdist.text import tail
from nbdist.worker.engine import USER_UMASK_ENV
from nbdist.worker.process_tree import same_process, terminate_all

ExitHandler = Callable[[dict[str, Any]], None]  # gets ipyparallel's {"pid", "exit_code"}
Progress = Callable[[str], None]

_ANSWER_SECONDS = 10.0  # how long a registered engine gets to tell its PID (a dead one never does)


class LaunchMode:
    """What every mode answers. The defaults fit engines nbdist may signal but did not start."""

    name = ""
    spans_hosts = False  # engines may run elsewhere: controller and rendezvous off loopback
    plan: LauncherPlan | None = None  # how ipyparallel starts the engines, if this mode does
    curve = False  # CurveZMQ on ipyparallel's traffic and the cell channel (`--curve`)
    owns_engines = False  # nbdist started them: they end themselves when the kernel is gone
    job: slurm.SlurmJob | None = None  # the engines' Slurm job, when there is one

    def __init__(self, processes: OwnedProcesses, on_exit: ExitHandler) -> None:
        self.processes = processes
        self.on_exit = on_exit
        self.client: Any = None  # the engines' ipyparallel client while the cluster runs

    @property
    def config(self) -> NbdistConfig:
        return self.processes.config

    def start(self, requested_n: int | None, say: Progress) -> list[int]:
        """Connect (and start what this mode starts); the engine ids to make ranks of."""
        raise NotImplementedError

    def can_restart_in_place(self, controller_lost: bool) -> bool:
        """Whether restart keeps the controller and only replaces the engines."""
        return not controller_lost and self.client is not None and self.processes.controller_alive()

    def restart_engines(self, n: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        """New engines for every rank (the controller stays); their ids."""
        raise NotImplementedError

    def check_replaceable(self, controller_lost: bool) -> None:
        raise NbdistError(
            f"replacing single ranks works for local engines only (this cluster's are "
            f"{self.name}): run %dist_restart (Cluster.restart()) for a full set of new ranks")

    def start_replacements(self, count: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        """`count` new engines beside the living ones; their ids."""
        raise NotImplementedError

    def stop_engines(self, ranks: list[RankProcess]) -> None:
        """Stop every engine but keep the controller (a restart, or one interrupted)."""

    def stop(self, ranks: list[RankProcess]) -> None:
        """Stop everything this mode started, by PID, and close the client."""
        if self.client is not None:
            with contextlib.suppress(Exception):  # whatever state its controller is in
                self.client.close()
        self.client = None

    def pid_is_here(self, rank: RankProcess) -> bool:
        """The rank's PID is a process on this machine (signalled and watched by PID)."""
        return rank.local

    def signal(self, rank: RankProcess, sig: int) -> None:
        """By PID here (if it is still that process); through the controller for an engine on
        another machine (its nanny delivers it)."""
        if not self.pid_is_here(rank):
            with contextlib.suppress(Exception):
                self.client.send_signal(int(sig), targets=[rank.spec.engine_id], block=False)
        elif same_process(rank.pid, rank.create_time) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, sig)

    def owned_pids(self, ranks: list[RankProcess]) -> list[Pid]:
        """Every process this cluster started and stops: none of an attached cluster's."""
        return []

    def launchers(self) -> list[Any]:
        """ipyparallel's per-process launchers of the engines nbdist started."""
        return []

    def log_tail(self, pid: int, lines: int) -> str:
        """The end of the log of the engine with this PID (crash messages land there)."""
        return ""

    def wait_for_registration(self, n: int | None, say: Progress,
                              known: Iterable[int] = ()) -> list[int]:
        """Wait for n new engines to register (n None: all there are, at least one); fail fast
        if engine processes, or a controller nbdist started, exit meanwhile."""
        known_ids = set(known)
        timeout = self.config.start.engine_start_timeout
        deadline = time.monotonic() + timeout
        while True:
            new_ids = sorted(set(self.client.ids) - known_ids)[:n]
            if len(new_ids) == n or (n is None and new_ids):
                strangers = self._strangers(new_ids)
                if not strangers:
                    return new_ids
                known_ids.update(strangers)  # dead, or left by an interrupted start: not a rank
                self._ask_to_exit(strangers)
                continue
            if self.job is not None and self.job.while_starting(say):
                # the start-up deadline runs from when the job runs; the queue has its own
                deadline = time.monotonic() + timeout
            exited = [la for la in self.launchers() if la.state == "after"]
            if exited:
                raise ClusterStartError(f"{len(exited)} engine process(es) exited while "
                                        f"starting.\n{_log_tails(exited)}")
            self._check_controller("while engines were starting")
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"{len(new_ids)} of {n or 'at least 1'} engine(s) registered within "
                    f"{timeout:.0f} s (NbdistConfig.engine_start_timeout)\n"
                    + _log_tails(self.launchers()))
            time.sleep(self.config.internal.startup_poll_interval)

    def _strangers(self, engine_ids: list[int]) -> list[int]:
        """The engines among `engine_ids` that are not processes just started: one killed as it
        registers keeps its id until its heartbeats stop, and would fail the first call to it."""
        launchers = self.launchers()
        if not launchers or not all(has_local_pid(la) for la in launchers):
            return []  # remote PIDs say nothing here
        ours = {pid for pid, _ct in process_trees(la.pid for la in launchers)}
        pids = gather({e: self.client[e].apply_async(os.getpid) for e in engine_ids},
                      _ANSWER_SECONDS)
        return [e for e in engine_ids if pids.results.get(e) not in ours]

    def _check_controller(self, when: str) -> None:
        if self.processes.controller and not self.processes.controller_alive():
            raise ClusterStartError(f"the ipyparallel controller exited {when}.\n"
                                    + tail(self.ipp.controller.get_output(), 30))

    def _ask_to_exit(self, engine_ids: list[int]) -> None:
        """Engines on other machines cannot be killed by PID: ask them to exit (best effort)."""
        if self.client is not None and engine_ids:
            with contextlib.suppress(Exception):
                self.client.shutdown(targets=[e for e in engine_ids if e in self.client.ids],
                                     block=False)


class LaunchedMode(LaunchMode):
    """A controller and engines nbdist starts through an ipyparallel launcher (mpiexec, a Slurm
    job, ssh; `LocalMode` here): owned, but stopped through the launcher where their PIDs are not
    here (ssh kill, scancel), and replaced only all together by a restart."""

    owns_engines = True
    plan: LauncherPlan

    def __init__(self, processes: OwnedProcesses, on_exit: ExitHandler, launcher: str,
                 options: dict[str, Any], interface: str | None) -> None:
        super().__init__(processes, on_exit)
        self.name, self.options, self.interface = launcher, options, interface
        self.plan = build_launcher_plan(launcher, options, interface=interface)  # checks them
        self.spans_hosts, self.curve = self.plan.spans_hosts, self.plan.curve
        self.ipp: Any = None
        # by PID, for log_tail: ipyparallel drops a stopped engine's launcher and log file
        self._launchers_by_pid: dict[int, Any] = {}
        self.fork_server: ForkServerProcess | None = None  # local engines fork from it

    def start(self, requested_n: int | None, say: Progress) -> list[int]:
        import ipyparallel as ipp

        n = rank_setup.rank_count(requested_n, self.plan)
        say(f"starting controller and {n} engine(s) ({self.name}) in {self.processes.workdir}")
        plan = self.plan = build_launcher_plan(self.name, self.options, n=n,
                                               interface=self.interface)
        if self.spans_hosts:
            warn_unauthenticated_rendezvous()
        cluster_kwargs = self._cluster_kwargs(plan)
        # a user's own wins; this one ends with the kernel, and removes the private directory then
        plan.config.LocalControllerLauncher.setdefault(
            "controller_cmd", controller_command(self.processes.workdir))
        profile_dir = os.path.join(self.processes.workdir, "profile")
        with private_files() as user_umask, starting("ipyparallel controller"):
            _engines_restore_umask(plan, user_umask)
            _create_profile_dir(profile_dir)
            slurm.prepare_submission(plan.config, profile_dir)
            self.ipp = ipp.Cluster(n=n, profile_dir=profile_dir, delay=0, config=plan.config,
                                   log=_quiet_logger(), shutdown_atexit=False,
                                   engine_timeout=int(self.config.start.engine_start_timeout),
                                   **cluster_kwargs)
            self.ipp.start_controller_sync()
        self.processes.record_controller(self.ipp.controller.pid)
        self._start_engines(n, say)
        self._engines_starting()
        self.client = self.ipp.connect_client_sync()
        return self.wait_for_registration(n, say)

    def _cluster_kwargs(self, plan: LauncherPlan) -> dict[str, Any]:
        return dict(plan.cluster_kwargs)  # ipyparallel.Cluster's (LocalMode adds its own)

    def _engines_starting(self) -> None:
        """Once the first engines are launched, before they register (LocalMode's step)."""

    def restart_engines(self, n: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        old_ids = set(self.client.ids)
        self.stop_engines(ranks)
        old_ids.update(self.client.ids)  # any that registered while being stopped
        say(f"starting {n} new engine(s)")
        return self._more_engines(n, old_ids, say)

    def _more_engines(self, n: int, known: set[int], say: Progress) -> list[int]:
        self._start_engines(n, say)
        return self.wait_for_registration(n, say, known)

    def _start_engines(self, n: int, say: Progress) -> None:
        if self.fork_server is not None and not self.fork_server.alive():
            say(f"{self.fork_server.why_gone()}\nstarting the engines cold instead")
            self.ipp.engine_launcher_class = "ipyparallel.cluster.launcher.LocalEngineSetLauncher"
            self.fork_server.reap()
            self.fork_server = None
        try:
            # private: the engines' logs (and the Slurm job's, via its umask)
            with private_files(), starting(f"{n} engine(s)"):
                self.ipp.start_engines_sync(n)
        except CalledProcessError as exc:  # the batch system's submit command refused the job
            sets = list(self.ipp.engines.values())
            self.ipp.engines.clear()
            raise slurm.submit_error(exc, sets, self.config.batch.batch_command_timeout) from None
        batch = slurm.job_launcher(self.ipp.engines.values())
        self.job = slurm.SlurmJob(batch, self.config.batch) if batch is not None else None
        for launcher in self.launchers():
            if has_local_pid(launcher):  # a remote PID must never be mistaken for a local one
                launcher.on_stop(self.on_exit)
                self._launchers_by_pid[launcher.pid] = launcher
                ipp_compat.run_wait_callbacks_at_once(launcher)
        if cold := {getattr(la, "fallback_reason", "") for la in self.launchers()} - {""}:
            say(f"engines started cold, not forked: {'; '.join(sorted(cold))}")

    def launchers(self) -> list[Any]:
        if self.ipp is None:
            return []
        return [la for es in self.ipp.engines.values() for la in engine_set_launchers(es)]

    def owned_pids(self, ranks: list[RankProcess]) -> list[Pid]:
        """The controller's family, the fork server, the engines here and their helpers."""
        fork = self.fork_server
        server = [(fork.pid, fork.create_time)] if fork is not None else []
        return sorted(set(self.processes.controller_family() + server + self._engine_pids(ranks)))

    def _engine_pids(self, ranks: list[RankProcess]) -> list[Pid]:
        """The engine processes here with their children (a remote PID never selects one), and
        the processes the ranks here started (DataLoader workers...), as probed at bootstrap."""
        return (process_trees(la.pid for la in self.launchers() if has_local_pid(la))
                + [pid for rank in ranks if self.pid_is_here(rank) for pid in rank.helper_pids])

    def log_tail(self, pid: int, lines: int) -> str:
        """The Slurm job's log for an engine that is not a process here."""
        launcher = self._launchers_by_pid.get(pid)
        if launcher is None:
            return self.job.log_tail(lines) if self.job is not None else ""
        return tail(_engine_log(launcher), lines, skip=ENGINE_LOG_NOISE)

    def stop_engines(self, ranks: list[RankProcess]) -> None:
        """Those here and their helpers by PID, the others through ipyparallel, else asked."""
        terminate_all(self._engine_pids(ranks), grace=self.config.start.stop_timeout)
        self._stop_through_ipyparallel(ranks)
        self.ipp.engines.clear()

    def _stop_through_ipyparallel(self, ranks: list[RankProcess]) -> None:
        """Stop the engines through ipyparallel (ssh kill, scancel...); if that fails, ask the
        ranks elsewhere to exit."""
        job, self.job = self.job, None
        try:
            self.ipp.stop_engines_sync()
            stopped = True
        except Exception:
            stopped = False
        if job is not None:  # scancel returns at once: wait until no step or engine is left
            stopped = job.cancel(self.config.start.stop_timeout
                                 + self.config.batch.batch_command_timeout)
        if not stopped:
            self._ask_to_exit([p.spec.engine_id for p in ranks
                               if not self.pid_is_here(p) and p.state == "alive"])

    def stop(self, ranks: list[RankProcess]) -> None:
        if self.ipp is not None and not self.plan.engine_pids_local:  # ssh kill, scancel first
            self._stop_through_ipyparallel(ranks)
        super().stop(ranks)
        terminate_all(self.owned_pids(ranks), grace=self.config.start.stop_timeout)
        if self.ipp is not None:  # drop it and its threads: an exit still being reported
            # would rewrite the cluster file after the workdir went
            ipp_compat.end_wait_threads(self.launchers(), list(self._launchers_by_pid.values()),
                                        1.0)
            ipp_compat.end_loop_thread(self.ipp, self.config.start.stop_timeout)
            self.ipp = None
        if self.fork_server is not None:
            self.fork_server.reap()
            self.fork_server = None


@contextmanager
def starting(what: str) -> Iterator[None]:
    """ipyparallel's own failures while starting (a command that is not there, a trait value
    it refuses) as one ClusterStartError that says what could not start and why."""
    try:
        yield
    except (NbdistError, CalledProcessError):
        raise
    except Exception as exc:
        raise ClusterStartError(f"could not start the {what}: {type(exc).__name__}: {exc}") from exc


def _create_profile_dir(path: str) -> None:
    from IPython.core.profiledir import ProfileDir

    ProfileDir.create_profile_dir(path)
    # the one file the umask misses: IPython copies its startup README with the source's mode
    readme = os.path.join(path, "startup", "README")
    if os.path.exists(readme):
        os.chmod(readme, 0o600)


def _engines_restore_umask(plan: LauncherPlan, user_umask: int) -> None:
    """Engines inherit the private umask they start under: each puts the user's back first
    thing, so what user code writes on a rank is as open as under torchrun (a remote shell
    of ssh's starts with its own)."""
    if plan.launcher == "ssh":
        return
    engine_set = plan.config[ENGINE_SET_CLASS[plan.launcher]]
    engine_set.environment = {USER_UMASK_ENV: f"{user_umask:03o}",
                              **engine_set.get("environment", {})}


def _engine_log(launcher: Any) -> str:
    """What an engine wrote to its log; a stopped one's text from ipyparallel (the file went)."""
    try:
        if launcher.state == "after":
            return launcher.get_output()
        with open(launcher.output_file, errors="replace") as f:
            return f.read()
    except (OSError, AttributeError):
        return ""


def _log_tails(launchers: list[Any], lines: int = 15) -> str:
    return "\n".join(f"--- engine pid {la.pid} log (last {lines} lines) ---\n"
                     f"{tail(_engine_log(la), lines)}" for la in launchers)


def _quiet_logger() -> logging.Logger:
    log = logging.getLogger("nbdist.ipyparallel")
    log.setLevel(logging.CRITICAL + 1)  # ipyparallel's log: nbdist says what matters itself
    return log
