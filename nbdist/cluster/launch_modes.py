"""How a cluster's engines come and go, one object per launch mode: `LocalMode` (engines forked
on this machine), `LaunchedMode` (an ipyparallel launcher: MPI, Slurm, SSH) and `AttachedMode`
(engines someone else started). Each starts, stops, signals and replaces ranks and says which
processes the cluster owns; no other module tests which mode it has.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

from nbdist.cluster import rank_setup
from nbdist.cluster.engines import Engines, ExitHandler, ask_remote_engines_to_exit
from nbdist.cluster.gather import gather
from nbdist.cluster.launchers import (
    LauncherPlan,
    build_launcher_plan,
    warn_unauthenticated_rendezvous,
)
from nbdist.cluster.processes import OwnedProcesses, Pid
from nbdist.cluster.ranks import RankProcess
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterStartError, NbdistError
from nbdist.worker import bootstrap
from nbdist.worker.process_tree import same_process, terminate_all

Progress = Callable[[str], None]


class LaunchMode:
    """What every mode answers. The defaults fit engines nbdist may signal but did not start."""

    name = ""
    spans_hosts = False  # engines may run elsewhere: controller and rendezvous off loopback
    plan: LauncherPlan | None = None  # how ipyparallel starts the engines, if this mode does
    curve = False  # CurveZMQ on ipyparallel's traffic and the cell channel (`--curve`)
    owns_engines = False  # nbdist started them: they end themselves when the kernel is gone

    def __init__(self, processes: OwnedProcesses, on_exit: ExitHandler) -> None:
        self.processes = processes
        self.client: Any = None  # the engines' ipyparallel client while the cluster runs
        self.engines = Engines(processes, on_exit)  # controller, engines, logs, exits, batch job

    @property
    def config(self) -> NbdistConfig:
        return self.processes.config

    def start(self, requested_n: int | None, say: Progress) -> list[int]:
        """Connect (and start what this mode starts); the engine ids to make ranks of."""
        raise NotImplementedError

    def rank_count(self, requested_n: int | None) -> int:
        """How many ranks a start makes when -n was not given."""
        return rank_setup.rank_count(requested_n, self.plan)

    def can_restart_in_place(self, controller_lost: bool) -> bool:
        """Whether restart keeps the controller and only replaces the engines."""
        return not controller_lost and self.client is not None and self.processes.controller_alive()

    def restart_engines(self, n: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        """New engines for every rank (the controller stays); their ids."""
        raise NotImplementedError

    def check_replaceable(self, controller_lost: bool) -> None:
        """Raise unless this mode can replace single dead ranks."""
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
        """Deliver `sig` to a rank's engine: by PID here (if it is still that process), through
        the controller for an engine on another machine (its nanny delivers it)."""
        if not self.pid_is_here(rank):
            with contextlib.suppress(Exception):
                self.client.send_signal(int(sig), targets=[rank.spec.engine_id], block=False)
        elif same_process(rank.pid, rank.create_time) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, sig)

    def owned_pids(self, ranks: list[RankProcess]) -> list[Pid]:
        """Every process this cluster started and stops: none of an attached cluster's."""
        return []

    def _ask_remote_engines_to_exit(self, ranks: list[RankProcess]) -> None:
        ask_remote_engines_to_exit(self.client, [
            p.spec.engine_id for p in ranks if not self.pid_is_here(p) and p.state == "alive"])


class _OwnedEngines(LaunchMode):
    """Engines nbdist starts through ipyparallel (controller, engines, their logs and exits)."""

    early_engines = False  # start them with the controller (they wait for its connection file)
    owns_engines = True
    plan: LauncherPlan

    def __init__(self, processes: OwnedProcesses, on_exit: ExitHandler, launcher: str,
                 options: dict[str, Any], interface: str | None) -> None:
        super().__init__(processes, on_exit)
        self.name, self.options, self.interface = launcher, options, interface
        self.plan = build_launcher_plan(launcher, options, interface=interface)  # checks them
        self.spans_hosts, self.curve = self.plan.spans_hosts, self.plan.curve

    def start(self, requested_n: int | None, say: Progress) -> list[int]:
        n = self.rank_count(requested_n)
        self.engines.progress = say
        say(f"starting controller and {n} engine(s) ({self.name}) in {self.processes.workdir}")
        self.plan = build_launcher_plan(self.name, self.options, n=n, interface=self.interface)
        if self.spans_hosts:
            warn_unauthenticated_rendezvous()
        self.client = self.engines.start(self.plan, n, early_engines=self.early_engines)
        return sorted(self.client.ids)

    def restart_engines(self, n: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        old_ids = set(self.client.ids)
        self.stop_engines(ranks)
        old_ids.update(self.client.ids)  # any that registered while being stopped
        say(f"starting {n} new engine(s)")
        return self._more_engines(n, old_ids, say)

    def _more_engines(self, n: int, known: set[int], say: Progress) -> list[int]:
        self.engines.progress = say
        self.engines.start_engines(n)
        return self.engines.wait_for_registration(self.client, n, known=known)

    def stop_engines(self, ranks: list[RankProcess]) -> None:
        """Those here and their helpers by PID, the others through ipyparallel, else asked."""
        if not self.engines.stop_engines(self._helper_pids(ranks)):
            self._ask_remote_engines_to_exit(ranks)

    def stop(self, ranks: list[RankProcess]) -> None:
        owned = self.owned_pids(ranks)
        super().stop(ranks)
        terminate_all(owned, grace=self.config.start.stop_timeout)
        self.engines.forget()

    def owned_pids(self, ranks: list[RankProcess]) -> list[Pid]:
        """The controller's family, the fork server, the engines here and their helpers."""
        return self.engines.owned_pids(self._helper_pids(ranks))

    def _helper_pids(self, ranks: list[RankProcess]) -> list[Pid]:
        """Processes the ranks here started (DataLoader workers...), as probed at bootstrap."""
        return [pid for rank in ranks if self.pid_is_here(rank) for pid in rank.helper_pids]


class LocalMode(_OwnedEngines):
    """Engines on this machine, forked from the cluster's fork server (or started cold): each is
    owned, signalled and stopped by PID, and a dead one can be replaced alone."""

    early_engines = True

    def pid_is_here(self, rank: RankProcess) -> bool:
        return True

    def check_replaceable(self, controller_lost: bool) -> None:
        if controller_lost or not self.processes.controller_alive():
            raise NbdistError("the controller is gone: only a full restart can bring the ranks "
                              "back (%dist_restart, Cluster.restart())")

    def start_replacements(self, count: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        known = set(self.client.ids) | {p.spec.engine_id for p in ranks if p.state == "dead"}
        return self._more_engines(count, known, say)


class LaunchedMode(_OwnedEngines):
    """Engines an ipyparallel launcher starts (mpiexec, a Slurm job, ssh): owned, but stopped
    through the launcher where their PIDs are not here (ssh kill, scancel), and replaced only all
    together by a restart."""

    def stop(self, ranks: list[RankProcess]) -> None:
        if self.engines.ipp is not None and not self.plan.engine_pids_local:
            if not self.engines.stop_through_ipyparallel():
                self._ask_remote_engines_to_exit(ranks)
        super().stop(ranks)


class AttachedMode(LaunchMode):
    """The engines of an ipyparallel cluster someone else started (`ipcluster start`, a Slurm
    job): nbdist connects, makes ranks of them and leaves them as it found them, starting and
    killing none of its processes."""

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
            ids = self.engines.wait_for_registration(self.client, requested_n or started)
        except ClusterStartError:
            if started is None:
                raise
            ids = self.engines.wait_for_registration(self.client, None)
            say(f"only {len(ids)} of the {started} engine(s) the cluster file lists registered "
                f"within {self.config.start.engine_start_timeout:.0f} s; using those")
        say(f"attached to {len(ids)} engine(s) of an existing cluster ({self.target})")
        return ids

    def can_restart_in_place(self, controller_lost: bool) -> bool:
        return self.client is not None  # else attach again: nbdist cannot start its controller

    def restart_engines(self, n: int, ranks: list[RankProcess], say: Progress) -> list[int]:
        """The living engines leave their group, and it waits for n of them (the living ones and
        any the user started): nbdist does not own these."""
        alive = [p for p in ranks if p.state == "alive" and p.spec.engine_id in self.client.ids]
        self._call_each(alive, bootstrap.teardown_process_group, self.config.start.rebuild_timeout)
        say(f"waiting for {n} engine(s) of the attached cluster (nbdist does not restart them)")
        dead = [p.spec.engine_id for p in ranks if p not in alive]
        return self.engines.wait_for_registration(self.client, n, known=dead)

    def stop(self, ranks: list[RankProcess]) -> None:
        """Each living engine stops its telemetry and leaves the process group (best effort)."""
        if self.client is not None:
            alive = [p for p in ranks if p.state == "alive" and p.spec.engine_id in self.client.ids]
            self._call_each(alive, bootstrap.shutdown_rank, self.config.start.stop_timeout)
        super().stop(ranks)

    def _call_each(self, ranks: list[RankProcess], function: Callable[[], Any],
                   timeout: float) -> None:
        gather({p.spec.rank: self.client[p.spec.engine_id].apply_async(function) for p in ranks},
               timeout)


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
