"""One object per launch mode: `LocalMode` (engines forked here), `LaunchedMode` (an ipyparallel
launcher: MPI, Slurm, SSH) and `AttachedMode` (engines someone else started). Each starts, stops,
signals and replaces ranks; no other module tests which mode it has."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbdist.cluster.engines import ExitHandler, LaunchedMode, LaunchMode, Progress, starting
from nbdist.cluster.fork_launcher import SET_LAUNCHER, ForkServerProcess
from nbdist.cluster.gather import gather
from nbdist.cluster.launchers import LauncherPlan
from nbdist.cluster.processes import OwnedProcesses, private_files
from nbdist.cluster.ranks import RankProcess
from nbdist.errors import ClusterStartError, NbdistError
from nbdist.worker import bootstrap


class LocalMode(LaunchedMode):
    """Engines on this machine, forked from the cluster's fork server (or started cold): each is
    owned, signalled and stopped by PID, and a dead one can be replaced alone."""

    def _cluster_kwargs(self, plan: LauncherPlan) -> dict[str, Any]:
        """Engines start with the controller, not after it (ipyparallel would wait for its
        connection file first), and without a kernel nanny: nbdist signals them by PID and learns
        of their exit from the launcher. They fork from the fork server, if there is one."""
        wait = self.config.start.engine_start_timeout
        engine_set = plan.config.LocalEngineSetLauncher
        engine_set.engine_args = [*engine_set.get("engine_args", []),
                                  f"--IPEngine.url_file={self._engine_file}",
                                  f"--IPEngine.wait_for_url_file={wait}",
                                  "--IPEngine.enable_nanny=False"]
        # the engines read a copy of the connection file (_engines_starting), not the env
        kwargs = {**plan.cluster_kwargs, "send_engines_connection_env": False}
        if self.config.start.fork_server:  # it imports torch while the controller starts
            # its log and socket owner-only; it fails on an engine_python that does not exist
            with private_files(), starting("fork server"):
                self.fork_server = ForkServerProcess(self.processes.workdir,
                                                     engine_set.engine_cmd[0])
            plan.config.ForkEngineLauncher.fork_socket = self.fork_server.socket_path
            plan.config.ForkEngineLauncher.fork_timeout = wait
            kwargs["engine_launcher_class"] = SET_LAUNCHER
        return kwargs

    @property
    def _engine_file(self) -> str:
        return os.path.join(self.processes.workdir, "profile", "security", "nbdist-engine.json")

    def _engines_starting(self) -> None:
        """Copy the controller's engine connection file, once complete, to where the engines
        look for it, atomically and owner-only (the controller writes its own in place)."""
        source = self.ipp.controller.connection_files["engine"]
        deadline = time.monotonic() + self.config.start.engine_start_timeout
        while True:
            try:
                text = Path(source).read_text()
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
        temporary = f"{self._engine_file}.tmp"
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
        os.replace(temporary, self._engine_file)

    def pid_is_here(self, rank: RankProcess) -> bool:
        return True

    def check_replaceable(self, controller_lost: bool) -> None:
        if controller_lost or not self.processes.controller_alive():
            raise NbdistError("the controller is gone: only a full restart can bring the ranks "
                              "back (%dist_restart, Cluster.restart())")

    def start_replacements(self, count: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        known = set(self.client.ids) | {p.spec.engine_id for p in ranks if p.state == "dead"}
        return self._more_engines(count, known, say)


class AttachedMode(LaunchMode):
    """The engines of an ipyparallel cluster someone else started (`ipcluster start`, a Slurm
    job): nbdist makes ranks of them and leaves them as it found them, killing none."""

    name = "attached"

    def __init__(self, processes: OwnedProcesses, on_exit: ExitHandler,
                 target: dict[str, Any]) -> None:
        super().__init__(processes, on_exit)
        self.target = target  # ipyparallel.Client's arguments

    def start(self, requested_n: int | None, say: Progress) -> list[int]:
        import ipyparallel as ipp

        options = dict(self.target)
        try:  # url_file positionally: ipyparallel 9 ignores the keyword (and finds another)
            self.client = ipp.Client(options.pop("url_file", None), **options)
        except (OSError, ValueError) as exc:
            raise ClusterStartError(
                f"no running ipyparallel cluster found for {self.target}: {exc}. "
                "Start one first (ipcluster start --profile P), or check profile/cluster_id."
            ) from None
        started = engines_started(self.target) if requested_n is None else None
        try:
            ids = self.wait_for_registration(requested_n or started, say)
        except ClusterStartError:
            if started is None:
                raise
            ids = self.wait_for_registration(None, say)
            say(f"only {len(ids)} of the {started} engine(s) the cluster file lists registered "
                f"within {self.config.start.engine_start_timeout:.0f} s; using those")
        say(f"attached to {len(ids)} engine(s) of an existing cluster ({self.target})")
        return ids

    def can_restart_in_place(self, controller_lost: bool) -> bool:
        return self.client is not None  # else attach again: nbdist cannot start its controller

    def restart_engines(self, n: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        """The living engines leave their group, and it waits for n of them (the living ones and
        any the user started): nbdist does not own these."""
        alive = self._call_living(ranks, bootstrap.teardown_process_group,
                                  self.config.start.rebuild_timeout)
        say(f"waiting for {n} engine(s) of the attached cluster (nbdist does not restart them)")
        return self.wait_for_registration(n, say, [p.spec.engine_id for p in ranks
                                                   if p not in alive])

    def stop(self, ranks: list[RankProcess]) -> None:
        """Each living engine stops its telemetry and leaves the process group (best effort)."""
        if self.client is not None:
            self._call_living(ranks, bootstrap.shutdown_rank, self.config.start.stop_timeout)
        super().stop(ranks)

    def _call_living(self, ranks: list[RankProcess], function: Callable[[], Any],
                     timeout: float) -> list[RankProcess]:
        alive = [p for p in ranks if p.state == "alive" and p.spec.engine_id in self.client.ids]
        gather({p.spec.rank: self.client[p.spec.engine_id].apply_async(function) for p in alive},
               timeout)
        return alive


def attach_target(profile: str | None, cluster_id: str, profile_dir: str | None,
                  url_file: str | None) -> dict[str, Any]:
    """ipyparallel.Client's arguments for the cluster `Cluster.attach` was pointed at."""
    if url_file:
        return {"url_file": url_file}
    if profile_dir:
        return {"cluster_id": cluster_id, "profile_dir": profile_dir}
    return {"cluster_id": cluster_id, "profile": profile or "default"}


def engines_started(target: dict[str, Any]) -> int | None:
    """How many engines the cluster's file (`ipcluster start` writes one) says were started, so
    attaching right after a start waits for all of them; None without a readable file."""
    if "url_file" in target:
        return None
    import ipyparallel as ipp

    try:
        with open(ipp.Cluster(shutdown_atexit=False, **target).cluster_file) as file:
            sets = json.load(file)["engines"]["sets"].values()
        return sum(int(engine_set["n"]) for engine_set in sets) or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def launch_mode(processes: OwnedProcesses, on_exit: ExitHandler, *, launcher: str,
                options: dict[str, Any], interface: str | None, profile: str | None) -> LaunchMode:
    """The mode `Cluster(launcher=..., launcher_options=..., profile=...)` asks for (checked:
    the launcher plan is built once here, starting nothing)."""
    if profile is not None:
        if launcher != "local" or options:
            raise NbdistError(
                f"profile={profile!r} attaches to engines already running in that profile; "
                "it does not combine with launcher= or launcher_options= (start the engines "
                "with ipcluster, then attach)")
        return AttachedMode(processes, on_exit, {"profile": profile})
    mode = LocalMode if launcher == "local" else LaunchedMode
    return mode(processes, on_exit, launcher, options, interface)
