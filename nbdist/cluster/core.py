"""`Cluster`: start, bootstrap, restart and stop a set of ipyparallel engines as torch ranks.

How processes start is ipyparallel's job (its local or batch launchers); who is which rank is
`nbdist.cluster.ranks`; running cells is `nbdist.cells.runner`. This module owns the processes and the
process-group generation, and guarantees that everything it started is stopped by PID.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from nbdist.cluster import watchdog
from nbdist.config import DEFAULT, NbdistConfig
from nbdist.errors import ClusterNotRunningError, ClusterStartError, NbdistError
from nbdist.cluster.launchers import (
    build_launcher_plan,
    engine_set_launchers,
    has_local_pid,
    is_loopback,
    warn_unauthenticated_rendezvous,
)
from nbdist.cluster.ranks import EngineInfo, RankSpec, build_rank_map, choose_backend, default_threads
from nbdist.cluster.telemetry import TelemetryHub
from nbdist.worker import bootstrap

Progress = Callable[[str], None]

_LIVE_CLUSTERS: weakref.WeakSet[ClusterCore] = weakref.WeakSet()


@dataclass
class RankProcess:
    """A rank as the notebook knows it: its engine, process and state."""

    spec: RankSpec
    pid: int
    create_time: float
    device: str
    threads: int
    helper_pids: list[tuple[int, float]]
    state: str = "alive"  # alive | dead
    exit_detail: str = ""
    local: bool = True  # a process on this machine (signalled by PID); else through the controller
    release_signal: int | None = None  # the engine's "fail your blocked collective" signal, if any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _quiet_logger() -> logging.Logger:
    log = logging.getLogger("nbdist.ipyparallel")
    log.setLevel(logging.WARNING)
    log.propagate = False
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    return log


class ClusterCore:
    """A local (or launcher-provided) set of ranks forming one torch.distributed process group.

    >>> cluster = Cluster(n=2).start()          # doctest: +SKIP
    >>> cluster.run("dist.all_reduce(t := torch.ones(1)); t").raise_for_errors()  # doctest: +SKIP
    >>> cluster.stop()                           # doctest: +SKIP
    """

    def __init__(
        self,
        n: int | None = None,
        backend: str = "auto",
        gpus_per_rank: int = 1,
        threads: int | None = None,
        config: NbdistConfig | None = None,
        master_addr: str | None = None,
        launcher: str = "local",
        launcher_options: dict[str, Any] | None = None,
        profile: str | None = None,
        interface: str | None = None,
    ) -> None:
        """`launcher`: how ipyparallel starts the engines (local, mpi, slurm, ssh; see
        nbdist.cluster.launchers for `launcher_options`). `profile`: use the engines of a cluster already
        running in that ipyparallel profile instead (see `Cluster.attach`). `master_addr`: the
        rendezvous address (default: 127.0.0.1 on one host, rank 0's address across hosts).
        `interface`: the network interface ranks talk over (GLOO/NCCL_SOCKET_IFNAME)."""
        if n is not None and (not isinstance(n, int) or n < 1):
            raise NbdistError(f"-n {n!r}: the number of ranks must be a positive whole number")
        if gpus_per_rank < 0:
            raise NbdistError(f"--gpus-per-rank {gpus_per_rank}: must be 0 or more")
        if threads is not None and threads < 1:
            raise NbdistError(f"--threads {threads}: must be 1 or more")
        if backend not in ("auto", "nccl", "gloo"):
            raise NbdistError(f"--backend {backend!r}: choose auto, nccl or gloo")
        self.requested_n = n
        self.requested_backend = backend
        self.gpus_per_rank = gpus_per_rank
        self.requested_threads = threads
        self.config = config or DEFAULT
        self.requested_master_addr = master_addr
        self.master_addr = master_addr or "127.0.0.1"
        self.interface = interface
        self.launcher = launcher
        self.launcher_options = dict(launcher_options or {})
        self._attach_target: dict[str, Any] | None = None
        self._spans_hosts = False
        self._lost_ranks: list[int] = []
        self._engine_logs: dict[int, Any] = {}
        if profile is not None:
            if launcher != "local" or launcher_options:
                raise NbdistError(
                    f"profile={profile!r} attaches to engines already running in that profile; "
                    "it does not combine with launcher= or launcher_options= (start the engines "
                    "with ipcluster, then attach)"
                )
            self._attach_target = {"profile": profile}
        # validate launcher and options now (pure: starts nothing)
        self._plan = build_launcher_plan(launcher, self.launcher_options, n=n, interface=interface)
        self._attached = False
        self.telemetry = TelemetryHub()
        self.backend = ""
        self.generation = -1
        self.ranks: list[RankProcess] = []
        self.start_seconds = 0.0
        self.controller_lost = False
        self._ipp: Any = None
        self._client: Any = None
        self._workdir = ""
        self._pidfile = ""
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._controller_pid: tuple[int, float] | None = None
        self._controller_children: set[tuple[int, float]] = set()
        self._engine_exits: dict[int, Any] = {}
        self._exit_lock = threading.Lock()

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def client(self) -> Any:
        self._require_running()
        return self._client

    @property
    def workdir(self) -> str:
        return self._workdir

    def engine_id(self, rank: int) -> int:
        return self.ranks[rank].spec.engine_id

    def view(self, rank: int) -> Any:
        """The ipyparallel view of one rank; a rank whose engine is gone is marked dead."""
        engine_id = self.engine_id(rank)
        if engine_id not in self._client.ids:
            self.poll_dead()
            if self.ranks[rank].state == "alive":
                self.ranks[rank].state = "dead"
                self.ranks[rank].exit_detail = "engine unregistered from the controller"
            raise NbdistError(f"rank {rank} is dead ({self.ranks[rank].exit_detail})")
        return self._client[engine_id]

    def rank_of_engine(self, engine_id: int) -> int | None:
        for proc in self.ranks:
            if proc.spec.engine_id == engine_id:
                return proc.spec.rank
        return None

    def mark_dead(self, rank: int, detail: str) -> None:
        """The one place a rank becomes dead: its state, the reason, and the dashboard's view."""
        proc = self.ranks[rank]
        proc.state = "dead"
        proc.exit_detail = detail
        self.telemetry.rank_state(rank, "dead", detail)

    def _require_running(self) -> None:
        if self._client is None:
            raise ClusterNotRunningError(
                "no cluster is running: start one with %dist_start (or nbdist.Cluster(...).start())"
            )

    # ------------------------------------------------------------------ start
    def start(self, progress: Progress | None = None) -> ClusterCore:
        """Start controller and engines, give them ranks and a process group; return when a real
        all_reduce has succeeded on every rank. On failure nothing is left running."""
        if self.running:
            return self
        say = progress or (lambda _msg: None)
        started = time.perf_counter()
        self._workdir = tempfile.mkdtemp(prefix="nbdist-")  # 0700 by construction
        self._pidfile = os.path.join(self._workdir, "pids.json")
        try:
            if self._attach_target is not None:
                self._bootstrap(say, engine_ids=self._attach_engines(say))
            else:
                n = self._rank_count()
                say(f"starting controller and {n} engine(s) ({self.launcher}) in {self._workdir}")
                self._start_processes(n)
                self._bootstrap(say)
        except BaseException:
            self._teardown_processes()
            raise
        self.start_seconds = time.perf_counter() - started
        _LIVE_CLUSTERS.add(self)
        atexit.register(_stop_at_exit, weakref.ref(self))
        return self

    def _rank_count(self) -> int:
        if self.requested_n:
            return self.requested_n
        ssh_hosts = self._plan.config.get("SSHEngineSetLauncher", {}).get("engines")
        if ssh_hosts:
            return int(sum(ssh_hosts.values()))
        return _default_rank_count()

    def _start_processes(self, n: int) -> None:
        import ipyparallel as ipp

        # the launcher plan (nbdist.cluster.launchers) says how ipyparallel starts engines and where the
        # controller listens: 127.0.0.1 for a local cluster, off loopback only across hosts
        plan = build_launcher_plan(self.launcher, self.launcher_options, n=n,
                                   interface=self.interface)
        self._plan = plan
        if plan.spans_hosts:
            warn_unauthenticated_rendezvous()
        profile_dir = os.path.join(self._workdir, "profile")
        early = self.launcher == "local"
        if early:
            # Local engines start together with the controller instead of after it (ipyparallel
            # would wait for the controller's connection file first: 1-2 s of engine start-up,
            # torch import included, lost). They wait for a complete copy of that file.
            engine_file = os.path.join(profile_dir, "security", "nbdist-engine.json")
            engine_set = plan.config.LocalEngineSetLauncher
            args = list(engine_set.engine_args) if "engine_args" in engine_set else []
            engine_set.engine_args = [*args, f"--IPEngine.url_file={engine_file}",
                                      f"--IPEngine.wait_for_url_file={self.config.engine_start_timeout}"]
            # no kernel nanny: nbdist signals local engines by PID and learns of their exit from
            # the launcher, so the nanny would only add one more Python process per engine
            # (measured: about 0.7 s of the start on 2 cores)
            engine_set.engine_args.append("--IPEngine.enable_nanny=False")
        self._ipp = ipp.Cluster(
            n=n,
            profile_dir=profile_dir,
            delay=0,
            config=plan.config,
            log=_quiet_logger(),
            shutdown_atexit=False,
            engine_timeout=int(self.config.engine_start_timeout),
            **plan.cluster_kwargs,
        )
        if early:
            self._ipp.send_engines_connection_env = False
        self._ipp.start_controller_sync()
        controller = self._ipp.controller
        self._controller_pid = (controller.pid, psutil.Process(controller.pid).create_time())
        self._controller_children = set()
        self._write_pidfile()
        self._start_watchdog()
        self._start_engines(n)
        if early:
            self._publish_engine_file(controller.connection_files["engine"], engine_file)
        self._client = self._ipp.connect_client_sync()
        self._watch_unregistrations()
        self._wait_for_engines(n)
        self._harden_permissions()

    def _publish_engine_file(self, source: str, target: str) -> None:
        """Copy the controller's engine connection file, once complete, to where the early
        engines look for it; written atomically, so no engine ever reads half a file."""
        deadline = time.monotonic() + self.config.engine_start_timeout
        while True:
            try:
                with open(source) as f:
                    text = f.read()
                json.loads(text)
                break
            except (OSError, ValueError):  # not there yet, or being written
                if not self._controller_alive():
                    raise ClusterStartError(
                        "the ipyparallel controller exited while starting.\n"
                        + _tail(self._ipp.controller.get_output(), 30)
                    ) from None
                if time.monotonic() > deadline:
                    raise ClusterStartError(
                        f"the controller wrote no connection file within "
                        f"{self.config.engine_start_timeout:.0f} s (NbdistConfig.engine_start_timeout)"
                    ) from None
                time.sleep(0.02)
        tmp = f"{target}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
        os.replace(tmp, target)

    def _harden_permissions(self) -> None:
        """ipyparallel writes some files 0644; keep everything owner-only (keys live here)."""
        for root, dirs, files in os.walk(self._workdir):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o700)
            for name in files:
                try:
                    os.chmod(os.path.join(root, name), 0o600)
                except OSError:
                    pass

    def _start_engines(self, n: int) -> None:
        self._ipp.start_engines_sync(n)
        for engine_set in self._ipp.engines.values():
            for launcher in engine_set_launchers(engine_set):
                if has_local_pid(launcher):  # a remote PID must never be mistaken for a local one
                    launcher.on_stop(self._engine_stopped)
                    # ipyparallel drops a stopped engine's launcher from its set and removes its
                    # log file (keeping the text): hold on to the launcher for engine_log_tail
                    self._engine_logs[launcher.pid] = launcher
                    self._record_exit_status(launcher)
        self._write_pidfile()

    def _record_exit_status(self, launcher: Any) -> None:
        """ipyparallel's wait thread reaps the engine (getting -9, -11...) but hands the status
        to an event loop that a notebook kernel does not run, so on_stop never fires. Run those
        hand-offs at once when they come from a launcher's wait thread."""
        loop = launcher.loop
        if getattr(loop, "_nbdist_wait_passthrough", False):
            return
        original = loop.add_callback

        def add_callback(callback: Any, *args: Any, **kwargs: Any) -> None:
            if threading.current_thread().name.startswith("wait(pid="):
                try:
                    callback(*args, **kwargs)
                    return
                except Exception:
                    pass
            original(callback, *args, **kwargs)

        loop.add_callback = add_callback
        loop._nbdist_wait_passthrough = True

    def _engine_stopped(self, stop_data: dict[str, Any]) -> None:
        with self._exit_lock:
            self._engine_exits[int(stop_data.get("pid", -1))] = stop_data.get("exit_code")

    def _launchers(self) -> list[Any]:
        if self._ipp is None:
            return []
        return [la for es in self._ipp.engines.values() for la in engine_set_launchers(es)]

    def _wait_for_engines(self, n: int, known: Iterable[int] = ()) -> list[int]:
        """Wait for n new engines to register; fail fast if engine processes exit meanwhile."""
        known_ids = set(known)
        deadline = time.monotonic() + self.config.engine_start_timeout
        while True:
            new_ids = sorted(set(self._client.ids) - known_ids)
            if len(new_ids) >= n:
                return new_ids[:n]
            exited = [la for la in self._launchers() if la.state == "after"]
            if exited:
                raise ClusterStartError(
                    f"{len(exited)} engine process(es) exited while starting.\n"
                    + self._log_tails(exited)
                )
            if not self._controller_alive():
                raise ClusterStartError(
                    "the ipyparallel controller exited while engines were starting.\n"
                    + _tail(self._ipp.controller.get_output(), 30)
                )
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"only {len(new_ids)} of {n} engines registered within "
                    f"{self.config.engine_start_timeout:.0f} s "
                    f"(NbdistConfig.engine_start_timeout).\n" + self._log_tails(self._launchers())
                )
            time.sleep(0.02)

    def _log_tails(self, launchers: list[Any], lines: int = 15) -> str:
        parts = []
        for la in launchers:
            try:
                with open(la.output_file, errors="replace") as f:
                    text = f.read()
            except OSError:
                text = ""
            parts.append(f"--- engine pid {la.pid} log (last {lines} lines) ---\n{_tail(text, lines)}")
        return "\n".join(parts)

    def _controller_alive(self) -> bool:
        if self._controller_pid is None:
            return False
        return watchdog.same_process(*self._controller_pid) is not None

    def _bootstrap(self, say: Progress, engine_ids: list[int] | None = None) -> None:
        client = self._client
        ids = engine_ids if engine_ids is not None else sorted(client.ids)
        say(f"{len(ids)} engine(s) registered; setting up ranks")
        probes = self._apply_each(ids, bootstrap.probe, self._controller_host(),
                                  timeout=self.config.bootstrap_timeout,
                                  what="probing engines (torch import)")
        infos = [
            EngineInfo(engine_id=eid, host=probes[eid]["host"], pid=probes[eid]["pid"],
                       gpu_count=probes[eid]["gpu_count"])
            for eid in ids
        ]
        backend = choose_backend(
            self.requested_backend, [i.gpu_count for i in infos], self.gpus_per_rank
        )
        host_order = [p.spec.host for p in self.ranks] if self.ranks else None
        specs = build_rank_map(infos, backend, self.gpus_per_rank, host_order=host_order)
        self.backend = backend
        self.generation += 1
        self._choose_master_addr(specs, probes)
        port = self._rendezvous_port(specs[0].engine_id)
        self._pg_port = port
        results: dict[int, Any] = {}
        asyncs = {}
        for spec in specs:
            cpu_count = probes[spec.engine_id]["cpu_count"] or 1
            threads = self.requested_threads or default_threads(cpu_count, spec.local_world_size)
            options = {
                "env": {**spec.env(self.master_addr, port), "NBDIST_PG_TIMEOUT": str(self.config.process_group_timeout)},
                "threads": threads,
                "cwd": os.getcwd(),
                "master_addr": self.master_addr,
                "port": port,
                "pg_timeout": self.config.process_group_timeout,
                "generation": self.generation,
                "telemetry_interval": self.config.telemetry_interval,
                "socket_ifname": "lo" if self.master_addr.startswith("127.") else None,
                "interface_env": self._interface_env(probes[spec.engine_id]),
                "store_path": self._store_path(),
            }
            asyncs[spec.engine_id] = client[spec.engine_id].apply_async(
                bootstrap.setup_rank, _spec_dict(spec), options
            )
        results = self._collect(asyncs, self.config.bootstrap_timeout,
                                "setting up ranks and the process group")
        self.ranks = [
            RankProcess(
                spec=spec,
                pid=probes[spec.engine_id]["pid"],
                create_time=probes[spec.engine_id]["create_time"],
                device=results[spec.engine_id]["device"],
                threads=results[spec.engine_id]["threads"],
                helper_pids=[tuple(c) for c in probes[spec.engine_id]["children"]],
                local=self._is_local_engine(probes[spec.engine_id]),
                release_signal=probes[spec.engine_id].get("release_signal"),
            )
            for spec in specs
        ]
        self._write_pidfile()
        # Move everything alive now (torch, IPython: millions of objects) out of the collector's
        # reach: the engine's exit then skips a multi-second final gc.collect (%dist_stop), and
        # full collections during training stop rescanning torch's own objects.
        freezes = [client[eid].apply_async(gc.freeze) for eid in ids]
        for ar in freezes:
            try:
                ar.get(timeout=self.config.bootstrap_timeout)
            except Exception:
                pass

    def _apply_each(self, ids: list[int], fn: Callable[..., Any], *args: Any, timeout: float,
                    what: str) -> dict[int, Any]:
        asyncs = {eid: self._client[eid].apply_async(fn, *args) for eid in ids}
        return self._collect(asyncs, timeout, what)

    def _collect(self, asyncs: dict[int, Any], timeout: float, what: str) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        for ar in asyncs.values():
            remaining = max(0.0, deadline - time.monotonic())
            try:
                ar.get(timeout=remaining)
            except Exception:
                pass
        failures = []
        results = {}
        for eid, ar in asyncs.items():
            if not ar.ready():
                failures.append(f"engine {eid}: no answer within {timeout:.0f} s")
                continue
            try:
                results[eid] = ar.get(timeout=0)
            except Exception as exc:  # a RemoteError carries the engine-side traceback
                failures.append(f"engine {eid}: {_short_error(exc)}")
        if failures:
            raise ClusterStartError(f"{what} failed:\n" + "\n".join(failures))
        return results

    def _start_watchdog(self) -> None:
        me = psutil.Process()
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "nbdist.cluster.watchdog", "--parent", str(me.pid),
             "--parent-create-time", repr(me.create_time()), "--pidfile", self._pidfile,
             "--workdir", self._workdir, "--interval", str(self.config.watchdog_interval)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _owned_pids(self) -> list[tuple[int, float]]:
        pids: list[tuple[int, float]] = []
        if self._attached:
            return pids  # attached engines belong to the user: nbdist never kills them
        pids += self._controller_pids()
        return sorted(set(pids + self._engine_pids()))

    def _controller_pids(self) -> list[tuple[int, float]]:
        """The controller and its children (its schedulers and heart monitor are forked
        processes). The children are remembered: when the controller is killed they are
        orphaned, and only the record still names them (measured: 8 left per kill)."""
        if not self._controller_pid:
            return []
        proc = watchdog.same_process(*self._controller_pid)
        if proc is not None:
            try:
                self._controller_children |= {(c.pid, c.create_time()) for c in proc.children(recursive=True)}
            except psutil.Error:
                pass
        return [self._controller_pid, *sorted(self._controller_children)]

    def _engine_pids(self) -> list[tuple[int, float]]:
        """Local engine processes with their children (nannies), and the ranks' helpers."""
        pids: list[tuple[int, float]] = []
        for la in self._launchers():
            if not has_local_pid(la):  # a remote PID number must never select a local process
                continue
            try:
                proc = psutil.Process(la.pid)
                pids.append((la.pid, proc.create_time()))
                pids.extend((c.pid, c.create_time()) for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        for rank in self.ranks:
            if rank.local:
                pids.extend(rank.helper_pids)
        return pids

    def _write_pidfile(self) -> None:
        if self._pidfile and os.path.isdir(self._workdir):
            watchdog.write_pidfile(self._pidfile, self._owned_pids())

    def all_pids(self) -> list[int]:
        """Every process this cluster started (controller, engines, nannies, watchdog)."""
        pids = [pid for pid, _ct in self._owned_pids()]
        if self._watchdog is not None:
            pids.append(self._watchdog.pid)
        return pids

    # ------------------------------------------------------------------ liveness
    def poll_dead(self) -> dict[int, str]:
        """Ranks whose engine process has exited since the last check: rank -> 'signal 9' etc."""
        newly_dead: dict[int, str] = {}
        with self._exit_lock:
            lost, self._lost_ranks = self._lost_ranks, []
        for rank in lost:
            newly_dead[rank] = self.ranks[rank].exit_detail
            self.telemetry.rank_state(rank, "dead", self.ranks[rank].exit_detail)
        for proc in self.ranks:
            if proc.state == "dead":
                continue
            if not proc.local:
                if self._client is None or proc.spec.engine_id in self._client.ids:
                    continue
                proc.state = "dead"
                proc.exit_detail = (f"engine on {proc.spec.host} lost: the controller stopped "
                                    "hearing its heartbeat (process or host gone)")
                newly_dead[proc.spec.rank] = proc.exit_detail
                self.telemetry.rank_state(proc.spec.rank, "dead", proc.exit_detail)
                continue
            with self._exit_lock:
                code = self._engine_exits.get(proc.pid, "missing")
            if code == "missing":
                alive = watchdog.same_process(proc.pid, proc.create_time) is not None
                registered = self._client is None or proc.spec.engine_id in self._client.ids
                if alive and registered:
                    continue
                if alive:  # running but the controller dropped it: unusable, end it
                    self.signal_rank(proc.spec.rank, signal.SIGKILL)
                    code = "unregistered from the controller"
                else:
                    code = self._wait_exit_code(proc.pid)
            proc.state = "dead"
            proc.exit_detail = _describe_exit(code)
            newly_dead[proc.spec.rank] = proc.exit_detail
            self.telemetry.rank_state(proc.spec.rank, "dead", proc.exit_detail)
        if self._controller_pid and not self.controller_lost and not self._controller_alive():
            self.controller_lost = True
        return newly_dead

    def _wait_exit_code(self, pid: int, within: float = 1.0) -> Any:
        """The launcher's wait thread reaps the engine and records its status a moment later."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with self._exit_lock:
                if pid in self._engine_exits:
                    return self._engine_exits[pid]
            time.sleep(0.01)
        return "unknown"

    def engine_log_tail(self, rank: int, lines: int) -> str:
        """The last lines an engine wrote to its own log (crash messages land there)."""
        pid = self.ranks[rank].pid
        launcher = self._engine_logs.get(pid)
        if launcher is None:
            launcher = next((la for la in self._launchers() if la.pid == pid), None)
        if launcher is None:
            return ""
        try:
            if launcher.state == "after":  # stopped: ipyparallel keeps the text, not the file
                text = launcher.get_output()
            else:
                with open(launcher.output_file, errors="replace") as f:
                    text = f.read()
        except (OSError, AttributeError):
            return ""
        keep = [ln for ln in text.splitlines() if ln.strip() and "[IPEngine]" not in ln]
        return "\n".join(keep[-lines:])

    def release_rank(self, rank: int) -> bool:
        """Ask a rank blocked inside a collective to make it fail (nbdist.worker.release);
        False if its engine was not started by nbdist and has no such signal."""
        sig = self.ranks[rank].release_signal
        if sig is None or self.ranks[rank].state != "alive":
            return False
        self.signal_rank(rank, sig)
        return True

    def signal_rank(self, rank: int, sig: int) -> None:
        proc = self.ranks[rank]
        if not proc.local:  # another machine: the engine's nanny delivers it
            try:
                self._client.send_signal(int(sig), targets=[proc.spec.engine_id], block=False)
            except Exception:
                pass
            return
        if watchdog.same_process(proc.pid, proc.create_time) is None:
            return
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------------ process group
    def teardown_process_group(self, ranks: Iterable[int], timeout: float) -> list[int]:
        """Destroy the group on these (idle) ranks so peers blocked on them fail at once."""
        asyncs = {}
        for r in ranks:
            if self.ranks[r].state == "alive":
                try:
                    asyncs[r] = self.view(r).apply_async(bootstrap.teardown_process_group)
                except NbdistError:
                    continue
        done = []
        deadline = time.monotonic() + timeout
        for r, ar in asyncs.items():
            try:
                ar.get(timeout=max(0.0, deadline - time.monotonic()))
                done.append(r)
            except Exception:
                pass
        return done

    def rebuild_process_group(self) -> float:
        """New generation on a fresh port on every rank; returns seconds taken."""
        self._require_running()
        dead = [p.spec.rank for p in self.ranks if p.state == "dead"]
        if dead:
            raise NbdistError(
                f"rank(s) {dead} are dead: the process group cannot be rebuilt without them. "
                "Run %dist_restart (Cluster.restart()) for a full cluster."
            )
        started = time.perf_counter()
        self.generation += 1
        port = self._rendezvous_port(self.ranks[0].spec.engine_id)
        asyncs = {
            p.spec.engine_id: self._client[p.spec.engine_id].apply_async(
                bootstrap.rebuild_process_group, port, self.generation, self.master_addr,
                self._store_path(),
            )
            for p in self.ranks
        }
        self._collect(asyncs, self.config.rebuild_timeout, "rebuilding the process group")
        return time.perf_counter() - started

    # ------------------------------------------------------------------ data
    def push(self, values: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Bind names on the ranks; tensors go to CPU for the trip and to each rank's device."""
        targets = self._targets(ranks)
        asyncs = {r: self.view(r).apply_async(bootstrap.receive_values, values)
                  for r in targets}
        self._collect(asyncs, self.config.bootstrap_timeout, "push")

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """Fetch one name from the ranks: {rank: value} (tensors arrive on CPU)."""
        targets = self._targets(ranks)
        asyncs = {r: self.view(r).apply_async(bootstrap.send_values, [name])
                  for r in targets}
        deadline = time.monotonic() + self.config.bootstrap_timeout
        out: dict[int, Any] = {}
        for r, ar in asyncs.items():
            try:
                out[r] = ar.get(timeout=max(0.0, deadline - time.monotonic()))[name]
            except Exception as exc:
                raise NbdistError(f"pull {name!r} from rank {r}: {_short_error(exc)}") from None
        return out

    def _targets(self, ranks: Iterable[int] | None) -> list[int]:
        self._require_running()
        targets = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        bad = [r for r in targets if r < 0 or r >= self.world_size]
        if bad:
            raise NbdistError(f"rank(s) {bad} do not exist (ranks 0-{self.world_size - 1})")
        dead = [r for r in targets if self.ranks[r].state == "dead"]
        if dead:
            raise NbdistError(f"rank(s) {dead} are dead; run %dist_restart (Cluster.restart())")
        return targets

    # ------------------------------------------------------------------ restart / stop
    def restart(self, progress: Progress | None = None) -> ClusterCore:
        """Same ranks, new engine processes, new process group. Works after a dead rank or a
        lost controller."""
        say = progress or (lambda _msg: None)
        n = self.world_size or self._rank_count()
        started = time.perf_counter()
        if self._attached:
            self._restart_attached(n, say)
        elif self.controller_lost or self._client is None or not self._controller_alive():
            self._teardown_processes(keep_workdir=False)
            self.ranks = []
            self.controller_lost = False
            self.start(progress)
        else:
            old_ids = set(self._client.ids)
            self._stop_engines()
            say(f"starting {n} new engine(s)")
            self._start_engines(n)
            new_ids = self._wait_for_engines(n, known=old_ids)
            self._bootstrap(say, engine_ids=new_ids)
        for proc in self.ranks:
            self.telemetry.rank_state(proc.spec.rank, "restarted", f"pid {proc.pid}")
        self.start_seconds = time.perf_counter() - started
        return self

    def _stop_engines(self) -> None:
        watchdog.terminate_all(self._engine_pids(), grace=self.config.stop_timeout)
        try:
            self._ipp.stop_engines_sync()
        except Exception:
            self._ask_remote_engines_to_exit()
        self._ipp.engines.clear()

    def stop(self) -> list[int]:
        """Stop every process this cluster started, by PID; returns the PIDs that were stopped."""
        pids = self.all_pids()
        self._teardown_processes()
        _LIVE_CLUSTERS.discard(self)
        return pids

    def _teardown_processes(self, keep_workdir: bool = False) -> None:
        owned = self._owned_pids()
        if self._attached:
            self._leave_attached_engines()
        elif self._ipp is not None and not self._plan.engine_pids_local:
            try:
                self._ipp.stop_engines_sync()  # ssh kill / scancel, through ipyparallel
            except Exception:
                self._ask_remote_engines_to_exit()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
        self._client = None
        watchdog.terminate_all(owned, grace=self.config.stop_timeout)
        if self._ipp is not None:
            for la in self._launchers():
                la._stop_waiting.set() if hasattr(la, "_stop_waiting") else None
            self._ipp = None
        if self._pidfile and os.path.exists(self._pidfile):
            os.remove(self._pidfile)  # tells the watchdog to exit quietly
        if self._watchdog is not None:
            # it only sleeps between checks (up to watchdog_interval): end it now, not at its
            # next check; its work is done, the processes it guards are already stopped
            try:
                self._watchdog.terminate()
            except OSError:
                pass
            try:
                self._watchdog.wait(timeout=2 * self.config.watchdog_interval + 1)
            except subprocess.TimeoutExpired:
                self._watchdog.send_signal(signal.SIGKILL)
                self._watchdog.wait(timeout=2)
            self._watchdog = None
        if not keep_workdir and self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
        for proc in self.ranks:
            proc.state = "dead"
            proc.exit_detail = "stopped"

    # ------------------------------------------------------------------ multi-host, attach
    @classmethod
    def attach(
        cls,
        profile: str | None = None,
        cluster_id: str = "",
        *,
        profile_dir: str | None = None,
        url_file: str | None = None,
        n: int | None = None,
        progress: Progress | None = None,
        **kwargs: Any,
    ) -> ClusterCore:
        """Use the engines of a cluster the user already started (`ipcluster start`, a Slurm
        job) as ranks. nbdist starts and kills nothing there: stop() only leaves the process
        group; restart() waits for the engines to be back (restart them yourself)."""
        cluster = cls(n=n, **kwargs)
        target: dict[str, Any] = {"cluster_id": cluster_id}
        if url_file:
            target = {"url_file": url_file}
        elif profile_dir:
            target["profile_dir"] = profile_dir
        else:
            target["profile"] = profile or "default"
        cluster._attach_target = target
        return cluster.start(progress)

    def _attach_engines(self, say: Progress) -> list[int]:
        import ipyparallel as ipp

        assert self._attach_target is not None
        self._attached = True
        try:
            self._client = ipp.Client(**self._attach_target)
        except (OSError, ValueError) as exc:
            raise ClusterStartError(
                f"no running ipyparallel cluster found for {self._attach_target}: {exc}. "
                "Start one first (ipcluster start --profile P), or check profile/cluster_id."
            ) from None
        self._watch_unregistrations()
        ids = self._wait_for_registered(self.requested_n)
        say(f"attached to {len(ids)} engine(s) of an existing cluster ({self._attach_target})")
        return ids

    def _wait_for_registered(self, n: int | None, exclude: Iterable[int] = ()) -> list[int]:
        """Engines of an attached cluster: n of them (all there are when n is None)."""
        skip = set(exclude)
        deadline = time.monotonic() + self.config.engine_start_timeout
        while True:
            ids = sorted(set(self._client.ids) - skip)
            if ids and (n is None or len(ids) >= n):
                return ids if n is None else ids[:n]
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"{len(ids)} engine(s) registered with the attached cluster within "
                    f"{self.config.engine_start_timeout:.0f} s; {n or 'at least one'} needed"
                )
            time.sleep(0.1)

    def _restart_attached(self, n: int, say: Progress) -> None:
        alive = [p for p in self.ranks if p.state == "alive" and p.spec.engine_id in self._client.ids]
        self.teardown_process_group([p.spec.rank for p in alive], timeout=self.config.rebuild_timeout)
        dead_ids = [p.spec.engine_id for p in self.ranks if p not in alive]
        say(f"waiting for {n} engine(s) of the attached cluster (nbdist does not restart them)")
        ids = self._wait_for_registered(n, exclude=dead_ids)
        self._bootstrap(say, engine_ids=ids)

    def _leave_attached_engines(self) -> None:
        if self._client is None:
            return
        alive = [p.spec.engine_id for p in self.ranks
                 if p.state == "alive" and p.spec.engine_id in self._client.ids]
        asyncs = {eid: self._client[eid].apply_async(bootstrap.shutdown_rank) for eid in alive}
        deadline = time.monotonic() + self.config.stop_timeout
        for ar in asyncs.values():
            try:
                ar.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass

    def _ask_remote_engines_to_exit(self) -> None:
        """Engines on other machines cannot be killed by PID: ask them to exit (best effort)."""
        remote = [p.spec.engine_id for p in self.ranks if not p.local and p.state == "alive"]
        if self._client is None or not remote:
            return
        try:
            self._client.shutdown(targets=[e for e in remote if e in self._client.ids], block=False)
        except Exception:
            pass

    def _watch_unregistrations(self) -> None:
        """Mark a remote rank dead the moment the controller drops its engine, before
        ipyparallel turns its running task into an EngineError, so a cell reports "died" (with
        the host) rather than "raised". Remote PIDs cannot be polled; this is how we learn."""
        handlers = getattr(self._client, "_notification_handlers", None)
        if not isinstance(handlers, dict) or "unregistration_notification" not in handlers:
            return  # poll_dead still notices through client.ids, only later
        original = handlers["unregistration_notification"]

        def on_unregister(msg: Any) -> None:
            try:
                self._engine_lost(int(msg["content"]["id"]))
            except Exception:
                pass
            original(msg)

        handlers["unregistration_notification"] = on_unregister

    def _engine_lost(self, engine_id: int) -> None:
        with self._exit_lock:
            for proc in self.ranks:
                if proc.spec.engine_id == engine_id and proc.state == "alive" and not proc.local:
                    proc.state = "dead"
                    proc.exit_detail = (f"engine on {proc.spec.host} lost: the controller "
                                        "stopped hearing its heartbeat (process or host gone)")
                    self._lost_ranks.append(proc.spec.rank)

    def _controller_host(self) -> str | None:
        """The controller's address as engines see it (the peer ranks route towards)."""
        if self._client is None:
            return None
        cfg = getattr(self._client, "_config", {}) or {}
        interface = str(cfg.get("interface", ""))
        host = interface.split("://", 1)[-1]
        if host in ("", "*", "0.0.0.0"):
            host = str(cfg.get("location") or "") or None
        return host

    def _is_local_engine(self, probe: dict[str, Any]) -> bool:
        """Same machine (hostname and boot id) and the PID really is that engine here."""
        if probe.get("host") != socket.gethostname():
            return False
        if probe.get("boot_id") != bootstrap._boot_id():
            return False
        return watchdog.same_process(int(probe["pid"]), float(probe["create_time"])) is not None

    def _choose_master_addr(self, specs: list[RankSpec], probes: dict[int, Any]) -> None:
        """Rendezvous on rank 0: its address on --interface, else the one it reaches the
        controller by (so the others reach it too); 127.0.0.1 for a local cluster."""
        self._spans_hosts = (
            self._plan.spans_hosts
            or len({p["host"] for p in probes.values()}) > 1
            or not all(self._is_local_engine(p) for p in probes.values())
        )
        if self._spans_hosts and not self._plan.spans_hosts:
            warn_unauthenticated_rendezvous()  # found out only now (attached engines elsewhere)
        if self.requested_master_addr is not None:
            self.master_addr = self.requested_master_addr
            return
        if not self._spans_hosts:
            self.master_addr = "127.0.0.1"
            return
        rank0 = probes[specs[0].engine_id]
        if self.interface is not None:
            addrs = rank0.get("addresses", {}).get(self.interface, [])
            if not addrs:
                raise ClusterStartError(
                    f"--interface {self.interface}: rank 0 (host {specs[0].host}) has no IPv4 "
                    f"address on it (it has {sorted(rank0.get('addresses', {}))})"
                )
            self.master_addr = addrs[0]
            return
        if not rank0.get("route_address"):
            raise ClusterStartError(
                f"could not tell which address of rank 0 (host {specs[0].host}) the other ranks "
                "can reach; pass master_addr= (--master-addr) or interface= (--interface)"
            )
        self.master_addr = str(rank0["route_address"])

    def _interface_env(self, probe: dict[str, Any]) -> dict[str, str]:
        """GLOO/NCCL_SOCKET_IFNAME for one rank: --interface, else (across hosts) the interface
        that rank reaches the controller by; nothing extra for a local cluster."""
        name = self.interface
        if name is None and self._spans_hosts:
            name = probe.get("route_interface")
        if not name:
            return {}
        return {"GLOO_SOCKET_IFNAME": str(name), "NCCL_SOCKET_IFNAME": str(name)}

    def _store_path(self) -> str | None:
        """A file store per generation in the private directory when every rank is local."""
        if self._spans_hosts or not self._workdir:
            return None
        return os.path.join(self._workdir, f"store-generation-{self.generation}")

    def _rendezvous_port(self, rank0_engine: int) -> int:
        """A fresh port for the store: picked here for a local master, else on rank 0 itself."""
        if is_loopback(self.master_addr) or not self._spans_hosts:
            return free_port(self.master_addr)
        ar = self._client[rank0_engine].apply_async(bootstrap.reserve_port, self.master_addr)
        try:
            return int(ar.get(timeout=self.config.bootstrap_timeout))
        except Exception as exc:
            raise ClusterStartError(
                f"rank 0 could not open a port on {self.master_addr}: {_short_error(exc)}"
            ) from None

    def __enter__(self) -> ClusterCore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        if not self.running:
            return "<nbdist.Cluster (not running)>"
        return f"<nbdist.Cluster {self.world_size} ranks, {self.backend}, generation {self.generation}>"


def _spec_dict(spec: RankSpec) -> dict[str, Any]:
    return {
        "rank": spec.rank, "local_rank": spec.local_rank, "world_size": spec.world_size,
        "local_world_size": spec.local_world_size, "host": spec.host,
        "engine_id": spec.engine_id, "backend": spec.backend, "gpus": list(spec.gpus),
    }


def _default_rank_count() -> int:
    """The number of GPUs, else 2 CPU ranks (counted without importing CUDA in the notebook)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]) or 2
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        return count or 2
    except (OSError, subprocess.TimeoutExpired):
        return 2


def _describe_exit(code: Any) -> str:
    if isinstance(code, str) and code.startswith("unregistered"):
        return code
    if isinstance(code, int):
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name} (signal {-code})"
        return f"exited with code {code}"
    return "exited (exit status unknown)"


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _short_error(exc: BaseException) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    tb = getattr(exc, "traceback", None)
    text = f"{ename}: {evalue}"
    if tb:
        text += "\n" + _tail(str(tb), 12)
    return text


def _stop_at_exit(ref: weakref.ReferenceType[ClusterCore]) -> None:
    cluster = ref()
    if cluster is not None and cluster.running:
        cluster.stop()
