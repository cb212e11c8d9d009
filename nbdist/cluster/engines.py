"""ipyparallel's part of a cluster: the controller and engines it starts through a launcher plan,
the engines' connection file, their exit statuses and logs, and waiting for them to register.

PIDs only ever come from launchers whose processes run on this machine (`has_local_pid`).
"""

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
from nbdist.cluster import our_engines, slurm, watchdog
from nbdist.cluster.fork_launcher import SET_LAUNCHER, ForkServerProcess, start_fork_server
from nbdist.cluster.launchers import (
    ENGINE_LOG_NOISE,
    ENGINE_SET_CLASS,
    LauncherPlan,
    engine_set_launchers,
    has_local_pid,
)
from nbdist.cluster.processes import OwnedProcesses, Pid, private_files, process_trees
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterStartError, NbdistError
from nbdist.text import tail
from nbdist.worker.engine import USER_UMASK_ENV

ExitHandler = Callable[[dict[str, Any]], None]
"""Called with ipyparallel's stop data ({"pid": ..., "exit_code": ...}) when an engine exits."""


class Engines:
    """One ipyparallel.Cluster: controller and engine sets, and what nbdist keeps of them."""

    def __init__(self, processes: OwnedProcesses, on_exit: ExitHandler) -> None:
        self.processes = processes
        self.on_exit = on_exit
        self.ipp: Any = None
        # ipyparallel drops a stopped engine's launcher from its set and removes its log file
        # (keeping the text): nbdist holds on to each launcher, by PID, for log_tail
        self._launchers_by_pid: dict[int, Any] = {}
        self.job: slurm.SlurmJob | None = None
        """The engines' Slurm job, when ipyparallel's Slurm launcher submitted them."""
        self.progress: Callable[[str], None] = lambda _msg: None
        self.fork_server: ForkServerProcess | None = None  # local engines fork from it

    @property
    def config(self) -> NbdistConfig:
        return self.processes.config

    def start(self, plan: LauncherPlan, n: int, early_engines: bool) -> Any:
        """Controller, orphan watchdog and n engines; returns the connected client once the
        engines registered."""
        engine_file = self.start_controller(plan, n, early_engines)
        self.processes.write_pidfile(self.owned_pids())
        self.processes.start_watchdog()
        self.start_engines(n)
        self.processes.write_pidfile(self.owned_pids())
        if engine_file is not None:
            self.publish_engine_file(engine_file)
        client = self.ipp.connect_client_sync()
        self.wait_for_registration(client, n)
        return client

    def start_controller(self, plan: LauncherPlan, n: int, early_engines: bool) -> str | None:
        """Start the controller (engines come later); with `early_engines`, returns where the
        engines will find the controller's connection file (see publish_engine_file)."""
        import ipyparallel as ipp

        profile_dir = os.path.join(self.processes.workdir, "profile")
        engine_file = None
        cluster_kwargs = dict(plan.cluster_kwargs)
        if early_engines:
            engine_file = os.path.join(profile_dir, "security", "nbdist-engine.json")
            _start_engines_early(plan, engine_file, self.config.start.engine_start_timeout)
            if self.config.start.fork_server:  # it imports torch while the controller starts
                with _starting("fork server"):  # e.g. an engine_python that does not exist
                    self.fork_server = start_fork_server(
                        plan.config, self.processes.workdir, self.config.start.engine_start_timeout)
                cluster_kwargs["engine_launcher_class"] = SET_LAUNCHER
        with private_files() as user_umask, _starting("ipyparallel controller"):
            _engines_restore_umask(plan, user_umask)
            _create_profile_dir(profile_dir)
            slurm.prepare_submission(plan.config, profile_dir)
            self.ipp = ipp.Cluster(
                n=n,
                profile_dir=profile_dir,
                delay=0,
                config=plan.config,
                log=_quiet_logger(),
                shutdown_atexit=False,
                engine_timeout=int(self.config.start.engine_start_timeout),
                **cluster_kwargs,
            )
            if early_engines:
                self.ipp.send_engines_connection_env = False
            self.ipp.start_controller_sync()
        self.processes.record_controller(self.ipp.controller.pid)
        return engine_file

    def start_engines(self, n: int) -> None:
        if self.fork_server is not None and not self.fork_server.alive():
            self.progress(f"{self.fork_server.why_gone()}\nstarting the engines cold instead")
            self.ipp.engine_launcher_class = "ipyparallel.cluster.launcher.LocalEngineSetLauncher"
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
        self.processes.cancel_commands = [self.job.cancel_command] if self.job is not None else []
        for launcher in self.launchers():
            if has_local_pid(launcher):  # a remote PID must never be mistaken for a local one
                launcher.on_stop(self.on_exit)
                self._launchers_by_pid[launcher.pid] = launcher
                ipp_compat.run_wait_callbacks_at_once(launcher)
        if cold := {getattr(la, "fallback_reason", "") for la in self.launchers()} - {""}:
            self.progress(f"engines started cold, not forked: {'; '.join(sorted(cold))}")

    def publish_engine_file(self, target: str) -> None:
        """Copy the controller's engine connection file, once complete, to where the early
        engines look for it; written atomically, so no engine ever reads half a file."""
        source = self.ipp.controller.connection_files["engine"]
        deadline = time.monotonic() + self.config.start.engine_start_timeout
        while True:
            try:
                with open(source) as f:
                    text = f.read()
                json.loads(text)
                break
            except (OSError, ValueError):  # not there yet, or being written
                if not self.processes.controller_alive():
                    raise ClusterStartError(
                        "the ipyparallel controller exited while starting.\n" + self.controller_output()
                    ) from None
                if time.monotonic() > deadline:
                    raise ClusterStartError(
                        f"the controller wrote no connection file within "
                        f"{self.config.start.engine_start_timeout:.0f} s "
                        "(NbdistConfig.engine_start_timeout)"
                    ) from None
                time.sleep(self.config.internal.startup_poll_interval)
        tmp = f"{target}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
        os.replace(tmp, target)

    def wait_for_registration(self, client: Any, n: int, known: Iterable[int] = ()) -> list[int]:
        """Wait for n new engines to register; fail fast if engine processes exit meanwhile."""
        known_ids = set(known)
        deadline = time.monotonic() + self.config.start.engine_start_timeout
        queued_since = time.monotonic()
        while True:
            new_ids = sorted(set(client.ids) - known_ids)
            if len(new_ids) >= n:
                foreign = self._strangers(client, new_ids[:n])
                if not foreign:
                    return new_ids[:n]
                known_ids.update(foreign)  # dead, or left by an interrupted start: not a rank
                ask_remote_engines_to_exit(client, foreign)
                continue
            if self.job is not None and self.job.while_starting(self.progress):
                # the start-up deadline runs from when the job runs; the queue has its own
                deadline = time.monotonic() + self.config.start.engine_start_timeout
                queue_limit = self.config.batch.batch_queue_timeout
                slurm.check_queue_wait(self.job, queued_since, queue_limit)
            exited = [la for la in self.launchers() if la.state == "after"]
            if exited:
                raise ClusterStartError(
                    f"{len(exited)} engine process(es) exited while starting.\n" + _log_tails(exited)
                )
            if not self.processes.controller_alive():
                raise ClusterStartError(
                    "the ipyparallel controller exited while engines were starting.\n"
                    + self.controller_output()
                )
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"only {len(new_ids)} of {n} engines registered within "
                    f"{self.config.start.engine_start_timeout:.0f} s "
                    f"(NbdistConfig.engine_start_timeout).\n" + _log_tails(self.launchers())
                )
            time.sleep(self.config.internal.startup_poll_interval)

    def _strangers(self, client: Any, engine_ids: list[int]) -> list[int]:
        launchers = self.launchers()
        if not launchers or not all(has_local_pid(la) for la in launchers):
            return []  # remote PIDs say nothing here
        return our_engines.strangers(client, engine_ids, {pid for pid, _ct in self.local_pids()})

    def controller_output(self, lines: int = 30) -> str:
        return tail(self.ipp.controller.get_output(), lines)

    def launchers(self) -> list[Any]:
        if self.ipp is None:
            return []
        return [la for es in self.ipp.engines.values() for la in engine_set_launchers(es)]

    def local_pids(self) -> list[Pid]:
        """Local engine processes with their children (nannies)."""
        # a remote PID number must never select a local process
        return process_trees(la.pid for la in self.launchers() if has_local_pid(la))

    def owned_pids(self, helpers: list[Pid] | None = None) -> list[Pid]:
        """The controller's family, the fork server, the local engines and these helpers of the ranks."""
        own = self.fork_server.owned() if self.fork_server is not None else []
        return sorted(set(self.processes.controller_family() + own + self.local_pids() + (helpers or [])))

    def log_tail(self, pid: int, lines: int) -> str:
        """The last lines the engine with this PID wrote to its own log (crash messages land there)."""
        launcher = self._launchers_by_pid.get(pid)
        if launcher is None:
            launcher = next((la for la in self.launchers() if getattr(la, "pid", None) == pid), None)
        if launcher is None:
            return self.job.log_tail(lines) if self.job is not None else ""
        try:
            if launcher.state == "after":  # stopped: ipyparallel keeps the text, not the file
                text = launcher.get_output()
            else:
                with open(launcher.output_file, errors="replace") as f:
                    text = f.read()
        except (OSError, AttributeError):
            return ""
        return tail(text, lines, skip=ENGINE_LOG_NOISE)

    def stop_engines(self, helpers: list[Pid]) -> bool:
        """Stop every engine (local ones and these helpers by PID first) and forget them, for
        new ones; False if ipyparallel could not stop the others (ask those to exit)."""
        watchdog.terminate_all(self.local_pids() + helpers, grace=self.config.start.stop_timeout)
        stopped = self.stop_through_ipyparallel()
        self.ipp.engines.clear()
        return stopped

    def stop_through_ipyparallel(self) -> bool:
        """Stop the engines through ipyparallel (ssh kill, scancel...); False if that failed."""
        job, self.job = self.job, None
        self.processes.cancel_commands = []
        try:
            self.ipp.stop_engines_sync()
            stopped = True
        except Exception:
            stopped = False
        if job is not None:  # scancel returns at once: wait until no step or engine is left
            config = self.config
            return job.cancel(config.start.stop_timeout + config.batch.batch_command_timeout)
        return stopped

    def job_ended(self, fresh: bool = False) -> str | None:
        """How the engines' Slurm job ended (cancelled, time limit...), or None while it runs."""
        return self.job.ended_detail(fresh) if self.job is not None else None

    def forget(self) -> None:
        """Drop ipyparallel's Cluster (its processes are already stopped), ending its wait threads."""
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


def _start_engines_early(plan: LauncherPlan, engine_file: str, wait_seconds: float) -> None:
    # Local engines start together with the controller instead of after it (ipyparallel
    # would wait for the controller's connection file first: 1-2 s of engine start-up,
    # torch import included, lost). They wait for a complete copy of that file.
    engine_set = plan.config.LocalEngineSetLauncher
    args = list(engine_set.engine_args) if "engine_args" in engine_set else []
    engine_set.engine_args = [*args, f"--IPEngine.url_file={engine_file}",
                              f"--IPEngine.wait_for_url_file={wait_seconds}"]
    # no kernel nanny: nbdist signals local engines by PID and learns of their exit from
    # the launcher, so the nanny would only add one more Python process per engine
    # (measured: about 0.7 s of the start on 2 cores)
    engine_set.engine_args.append("--IPEngine.enable_nanny=False")


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
    # engines inherit the private umask they are started under (local ones, mpiexec's, and a
    # Slurm job's, which takes sbatch's): each puts the user's own back first thing, so what the
    # user's code writes on a rank (checkpoints...) is as open as under torchrun. ssh engines
    # never had it: a remote shell starts with its own.
    if plan.launcher == "ssh":
        return
    engine_set = plan.config[ENGINE_SET_CLASS[plan.launcher]]
    environment = dict(engine_set.environment) if "environment" in engine_set else {}
    environment.setdefault(USER_UMASK_ENV, f"{user_umask:03o}")
    engine_set.environment = environment


def _log_tails(launchers: list[Any], lines: int = 15) -> str:
    parts = []
    for la in launchers:
        try:
            with open(la.output_file, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        parts.append(f"--- engine pid {la.pid} log (last {lines} lines) ---\n{tail(text, lines)}")
    return "\n".join(parts)


def _quiet_logger() -> logging.Logger:
    log = logging.getLogger("nbdist.ipyparallel")
    log.setLevel(logging.WARNING)
    log.propagate = False
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    return log
