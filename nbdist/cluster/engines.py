"""ipyparallel's part of a cluster: the controller and engines it starts through a launcher plan,
the engines' connection file, their exit statuses and logs, and waiting for them to register.
PIDs only ever come from launchers whose processes run on this machine (`has_local_pid`)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from subprocess import CalledProcessError
from typing import Any

from nbdist import ipp_compat
from nbdist.cluster import slurm
from nbdist.cluster.controller import controller_command
from nbdist.cluster.fork_launcher import SET_LAUNCHER, ForkServerProcess, start_fork_server
from nbdist.cluster.gather import gather
from nbdist.cluster.launchers import (
    ENGINE_LOG_NOISE,
    ENGINE_SET_CLASS,
    LauncherPlan,
    engine_set_launchers,
    has_local_pid,
)
from nbdist.cluster.processes import (
    OwnedProcesses,
    Pid,
    private_files,
    process_trees,
    write_private,
)
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterStartError, NbdistError
from nbdist.text import tail
from nbdist.worker.engine import USER_UMASK_ENV
from nbdist.worker.process_tree import terminate_all

ExitHandler = Callable[[dict[str, Any]], None]
"""Called with ipyparallel's stop data ({"pid": ..., "exit_code": ...}) when an engine exits."""

_ANSWER_SECONDS = 10.0
"""How long a registered engine gets to tell its PID (a dead one never does)."""


class Engines:
    """One ipyparallel.Cluster: controller and engine sets, and what nbdist keeps of them."""

    def __init__(self, processes: OwnedProcesses, on_exit: ExitHandler) -> None:
        self.processes = processes
        self.on_exit = on_exit
        self.ipp: Any = None
        # ipyparallel drops a stopped engine's launcher and its log file (keeping the text):
        # nbdist keeps each launcher, by PID, for log_tail
        self._launchers_by_pid: dict[int, Any] = {}
        self.job: slurm.SlurmJob | None = None
        """The engines' Slurm job, when ipyparallel's Slurm launcher submitted them."""
        self.progress: Callable[[str], None] = lambda _msg: None
        self.fork_server: ForkServerProcess | None = None  # local engines fork from it

    @property
    def config(self) -> NbdistConfig:
        return self.processes.config

    def start(self, plan: LauncherPlan, n: int, early_engines: bool) -> Any:
        """Controller and n engines; the connected client once they registered.
        `early_engines` start with the controller and wait for a copy of its connection file."""
        import ipyparallel as ipp

        start = self.config.start
        profile_dir = os.path.join(self.processes.workdir, "profile")
        engine_file = os.path.join(profile_dir, "security", "nbdist-engine.json")
        cluster_kwargs = dict(plan.cluster_kwargs)
        if early_engines:
            _start_engines_early(plan, engine_file, start.engine_start_timeout)
            if start.fork_server:  # it imports torch while the controller starts
                with _starting("fork server"):  # e.g. an engine_python that does not exist
                    self.fork_server = start_fork_server(
                        plan.config, self.processes.workdir, start.engine_start_timeout)
                cluster_kwargs["engine_launcher_class"] = SET_LAUNCHER
        _end_with_kernel(plan, self.processes.workdir)
        with private_files() as user_umask, _starting("ipyparallel controller"):
            _engines_restore_umask(plan, user_umask)
            _create_profile_dir(profile_dir)
            slurm.prepare_submission(plan.config, profile_dir)
            self.ipp = ipp.Cluster(n=n, profile_dir=profile_dir, delay=0, config=plan.config,
                                   log=_quiet_logger(), shutdown_atexit=False,
                                   engine_timeout=int(start.engine_start_timeout),
                                   **cluster_kwargs)
            if early_engines:
                self.ipp.send_engines_connection_env = False
            self.ipp.start_controller_sync()
        self.processes.record_controller(self.ipp.controller.pid)
        self.start_engines(n)
        if early_engines:
            self._publish_engine_file(engine_file)
        client = self.ipp.connect_client_sync()
        self.wait_for_registration(client, n)
        return client

    def start_engines(self, n: int) -> None:
        if self.fork_server is not None and not self.fork_server.alive():
            self.progress(f"{self.fork_server.why_gone()}\nstarting the engines cold instead")
            self.ipp.engine_launcher_class = "ipyparallel.cluster.launcher.LocalEngineSetLauncher"
            self.fork_server.reap()
            self.fork_server = None
        try:
            # private: the engines' logs (and the Slurm job's, via its umask)
            with private_files(), _starting(f"{n} engine(s)"):
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
            self.progress(f"engines started cold, not forked: {'; '.join(sorted(cold))}")

    def _publish_engine_file(self, target: str) -> None:
        """Copy the controller's engine connection file, once complete, to where the early
        engines look for it."""
        source = self.ipp.controller.connection_files["engine"]
        deadline = time.monotonic() + self.config.start.engine_start_timeout
        while True:
            try:
                with open(source) as f:
                    text = f.read()
                json.loads(text)
                break
            except (OSError, ValueError):  # not there yet, or being written
                self._check_controller("while starting")
                if time.monotonic() > deadline:
                    raise ClusterStartError(
                        "the controller wrote no connection file within "
                        f"{self.config.start.engine_start_timeout:.0f} s "
                        "(NbdistConfig.engine_start_timeout)") from None
                time.sleep(self.config.internal.startup_poll_interval)
        write_private(target, text)

    def wait_for_registration(self, client: Any, n: int | None,
                              known: Iterable[int] = ()) -> list[int]:
        """Wait for n new engines to register (n None: all there are, at least one); fail fast
        if engine processes, or a controller nbdist started, exit meanwhile."""
        known_ids = set(known)
        timeout = self.config.start.engine_start_timeout
        deadline = time.monotonic() + timeout
        while True:
            new_ids = sorted(set(client.ids) - known_ids)[:n]
            if len(new_ids) == n or (n is None and new_ids):
                strangers = self._strangers(client, new_ids)
                if not strangers:
                    return new_ids
                known_ids.update(strangers)  # dead, or left by an interrupted start: not a rank
                ask_remote_engines_to_exit(client, strangers)
                continue
            if self.job is not None and self.job.while_starting(self.progress):
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

    def _strangers(self, client: Any, engine_ids: list[int]) -> list[int]:
        """The engines among `engine_ids` that are not processes just started: one killed as it
        registers keeps its id until its heartbeats stop, and would fail the first call to it."""
        launchers = self.launchers()
        if not launchers or not all(has_local_pid(la) for la in launchers):
            return []  # remote PIDs say nothing here
        ours = {pid for pid, _ct in self.local_pids()}
        pids = gather({e: client[e].apply_async(os.getpid) for e in engine_ids}, _ANSWER_SECONDS)
        return [e for e in engine_ids if pids.results.get(e) not in ours]

    def _check_controller(self, when: str) -> None:
        if self.processes.controller and not self.processes.controller_alive():
            raise ClusterStartError(f"the ipyparallel controller exited {when}.\n"
                                    + tail(self.ipp.controller.get_output(), 30))

    def launchers(self) -> list[Any]:
        if self.ipp is None:
            return []
        return [la for es in self.ipp.engines.values() for la in engine_set_launchers(es)]

    def local_pids(self) -> list[Pid]:
        """Local engine processes with their children (a remote PID never selects one here)."""
        return process_trees(la.pid for la in self.launchers() if has_local_pid(la))

    def owned_pids(self, helpers: Iterable[Pid] = ()) -> list[Pid]:
        """The controller's family, the fork server, the local engines and these helpers."""
        own = self.fork_server.owned() if self.fork_server is not None else []
        family = self.processes.controller_family()
        return sorted(set(family + own + self.local_pids() + list(helpers)))

    def log_tail(self, pid: int, lines: int) -> str:
        """The last lines the engine with this PID wrote to its log (crash messages land there);
        the Slurm job's log for an engine that is not a process here."""
        launcher = self._launchers_by_pid.get(pid)
        if launcher is None:
            return self.job.log_tail(lines) if self.job is not None else ""
        return tail(_engine_log(launcher), lines, skip=ENGINE_LOG_NOISE)

    def stop_engines(self, helpers: list[Pid]) -> bool:
        """Stop every engine (local ones and these helpers by PID first) and forget them, for
        new ones; False if ipyparallel could not stop the others (ask those to exit)."""
        terminate_all(self.local_pids() + helpers, grace=self.config.start.stop_timeout)
        stopped = self.stop_through_ipyparallel()
        self.ipp.engines.clear()
        return stopped

    def stop_through_ipyparallel(self) -> bool:
        """Stop the engines through ipyparallel (ssh kill, scancel...); False if that failed."""
        job, self.job = self.job, None
        try:
            self.ipp.stop_engines_sync()
            stopped = True
        except Exception:
            stopped = False
        if job is not None:  # scancel returns at once: wait until no step or engine is left
            return job.cancel(self.config.start.stop_timeout
                              + self.config.batch.batch_command_timeout)
        return stopped

    def forget(self) -> None:
        """Drop ipyparallel's Cluster (its processes are stopped already) and its threads."""
        if self.ipp is None:
            return
        # an exit still being reported rewrites the cluster file: after the workdir went, it stayed
        ipp_compat.end_wait_threads(self.launchers(), list(self._launchers_by_pid.values()), 1.0)
        ipp_compat.end_loop_thread(self.ipp, self.config.start.stop_timeout)
        self.ipp = None
        if self.fork_server is not None:
            self.fork_server.reap()
            self.fork_server = None


def ask_remote_engines_to_exit(client: Any, engine_ids: list[int]) -> None:
    """Engines on other machines cannot be killed by PID: ask them to exit (best effort)."""
    if client is None or not engine_ids:
        return
    try:
        client.shutdown(targets=[e for e in engine_ids if e in client.ids], block=False)
    except Exception:
        pass


def _end_with_kernel(plan: LauncherPlan, workdir: str) -> None:
    """The controller ends when the kernel does, and the private directory goes with it (the
    engines and the fork server end themselves)."""
    launcher = plan.config.LocalControllerLauncher
    if "controller_cmd" not in launcher:  # a user's own command wins
        launcher.controller_cmd = controller_command(workdir)


def _start_engines_early(plan: LauncherPlan, engine_file: str, wait_seconds: float) -> None:
    """Local engines start with the controller, not after it (ipyparallel would wait for its
    connection file first), and without a kernel nanny: nbdist signals them by PID and learns
    of their exit from the launcher."""
    engine_set = plan.config.LocalEngineSetLauncher
    args = list(engine_set.engine_args) if "engine_args" in engine_set else []
    engine_set.engine_args = [*args, f"--IPEngine.url_file={engine_file}",
                              f"--IPEngine.wait_for_url_file={wait_seconds}",
                              "--IPEngine.enable_nanny=False"]


@contextmanager
def _starting(what: str) -> Iterator[None]:
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
    environment = dict(engine_set.environment) if "environment" in engine_set else {}
    environment.setdefault(USER_UMASK_ENV, f"{user_umask:03o}")
    engine_set.environment = environment


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
    log.setLevel(logging.WARNING)
    log.propagate = False
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    return log
