"""`Cluster`: start, bootstrap, restart and stop a set of ipyparallel engines as torch ranks.

How processes start is ipyparallel's job (its local or batch launchers); who is which rank is
`nbdist.ranks`; running cells is `nbdist.runner`. This module owns the processes and the
process-group generation, and guarantees that everything it started is stopped by PID.
"""

from __future__ import annotations

import atexit
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

from nbdist import watchdog
from nbdist.config import DEFAULT, NbdistConfig
from nbdist.errors import ClusterNotRunningError, ClusterStartError, NbdistError
from nbdist.ranks import EngineInfo, RankSpec, build_rank_map, choose_backend, default_threads
from nbdist.telemetry import TelemetryHub
from nbdist.worker import bootstrap

Progress = Callable[[str], None]

_LIVE_CLUSTERS: weakref.WeakSet[Cluster] = weakref.WeakSet()


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


class Cluster:
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
        master_addr: str = "127.0.0.1",
    ) -> None:
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
        self.master_addr = master_addr
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
        self._engine_exits: dict[int, Any] = {}
        self._exit_lock = threading.Lock()
        self._dashboard: Any = None
        self._setup_cells: list[str] = []

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

    def rank_of_engine(self, engine_id: int) -> int | None:
        for proc in self.ranks:
            if proc.spec.engine_id == engine_id:
                return proc.spec.rank
        return None

    def _require_running(self) -> None:
        if self._client is None:
            raise ClusterNotRunningError(
                "no cluster is running: start one with %dist_start (or nbdist.Cluster(...).start())"
            )

    # ------------------------------------------------------------------ start
    def start(self, progress: Progress | None = None) -> Cluster:
        """Start controller and engines, give them ranks and a process group; return when a real
        all_reduce has succeeded on every rank. On failure nothing is left running."""
        if self.running:
            return self
        say = progress or (lambda _msg: None)
        started = time.perf_counter()
        self._workdir = tempfile.mkdtemp(prefix="nbdist-")  # 0700 by construction
        self._pidfile = os.path.join(self._workdir, "pids.json")
        try:
            n = self.requested_n or _default_rank_count()
            say(f"starting controller and {n} engine(s) in {self._workdir}")
            self._start_processes(n)
            self._bootstrap(say)
        except BaseException:
            self._teardown_processes()
            raise
        self.start_seconds = time.perf_counter() - started
        _LIVE_CLUSTERS.add(self)
        atexit.register(_stop_at_exit, weakref.ref(self))
        return self

    def _start_processes(self, n: int) -> None:
        import ipyparallel as ipp
        from traitlets.config import Config

        cfg = Config()
        cfg.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-m", "nbdist.worker.engine"]
        cfg.LocalEngineLauncher.engine_cmd = [sys.executable, "-m", "nbdist.worker.engine"]
        self._ipp = ipp.Cluster(
            n=n,
            profile_dir=os.path.join(self._workdir, "profile"),
            controller_ip="127.0.0.1",
            delay=0,
            config=cfg,
            log=_quiet_logger(),
            shutdown_atexit=False,
            engine_timeout=int(self.config.engine_start_timeout),
        )
        self._ipp.start_controller_sync()
        controller = self._ipp.controller
        self._controller_pid = (controller.pid, psutil.Process(controller.pid).create_time())
        self._write_pidfile()
        self._start_watchdog()
        self._start_engines(n)
        self._client = self._ipp.connect_client_sync()
        self._wait_for_engines(n)
        self._harden_permissions()

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
            for launcher in engine_set.launchers.values():
                launcher.on_stop(self._engine_stopped)
        self._write_pidfile()

    def _engine_stopped(self, stop_data: dict[str, Any]) -> None:
        with self._exit_lock:
            self._engine_exits[int(stop_data.get("pid", -1))] = stop_data.get("exit_code")

    def _launchers(self) -> list[Any]:
        if self._ipp is None:
            return []
        return [la for es in self._ipp.engines.values() for la in es.launchers.values()]

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
        probes = self._apply_each(ids, bootstrap.probe, timeout=self.config.bootstrap_timeout,
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
        port = free_port(self.master_addr)
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
            )
            for spec in specs
        ]
        self._write_pidfile()

    def _apply_each(self, ids: list[int], fn: Callable[..., Any], *args: Any, timeout: float,
                    what: str) -> dict[int, Any]:
        asyncs = {eid: self._client[eid].apply_async(fn, *args) for eid in ids}
        return self._collect(asyncs, timeout, what)

    def _collect(self, asyncs: dict[int, Any], timeout: float, what: str) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        for eid, ar in asyncs.items():
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
            [sys.executable, "-m", "nbdist.watchdog", "--parent", str(me.pid),
             "--parent-create-time", repr(me.create_time()), "--pidfile", self._pidfile,
             "--workdir", self._workdir, "--interval", str(self.config.watchdog_interval)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _owned_pids(self) -> list[tuple[int, float]]:
        pids: list[tuple[int, float]] = []
        if self._controller_pid:
            pids.append(self._controller_pid)
        for la in self._launchers():
            try:
                proc = psutil.Process(la.pid)
                pids.append((la.pid, proc.create_time()))
                pids.extend((c.pid, c.create_time()) for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        for rank in self.ranks:
            pids.extend(rank.helper_pids)
        return sorted(set(pids))

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
        for proc in self.ranks:
            if proc.state == "dead":
                continue
            with self._exit_lock:
                code = self._engine_exits.get(proc.pid, "missing")
            if code == "missing":
                if watchdog.same_process(proc.pid, proc.create_time) is not None:
                    continue
                code = "unknown"
            proc.state = "dead"
            proc.exit_detail = _describe_exit(code)
            newly_dead[proc.spec.rank] = proc.exit_detail
            self.telemetry.rank_state(proc.spec.rank, "dead", proc.exit_detail)
        if self._controller_pid and not self.controller_lost and not self._controller_alive():
            self.controller_lost = True
        return newly_dead

    def engine_log_tail(self, rank: int, lines: int) -> str:
        """The last lines an engine wrote to its own log (crash messages land there)."""
        pid = self.ranks[rank].pid
        for la in self._launchers():
            if la.pid == pid:
                try:
                    with open(la.output_file, errors="replace") as f:
                        text = f.read()
                except OSError:
                    return ""
                keep = [ln for ln in text.splitlines() if ln.strip() and "[IPEngine]" not in ln]
                return "\n".join(keep[-lines:])
        return ""

    def signal_rank(self, rank: int, sig: int) -> None:
        proc = self.ranks[rank]
        if watchdog.same_process(proc.pid, proc.create_time) is None:
            return
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------------ process group
    def teardown_process_group(self, ranks: Iterable[int], timeout: float) -> list[int]:
        """Destroy the group on these (idle) ranks so peers blocked on them fail at once."""
        asyncs = {r: self._client[self.engine_id(r)].apply_async(bootstrap.teardown_process_group)
                  for r in ranks if self.ranks[r].state == "alive"}
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
        port = free_port(self.master_addr)
        asyncs = {
            p.spec.engine_id: self._client[p.spec.engine_id].apply_async(
                bootstrap.rebuild_process_group, port, self.generation, self.master_addr
            )
            for p in self.ranks
        }
        self._collect(asyncs, self.config.rebuild_timeout, "rebuilding the process group")
        return time.perf_counter() - started

    # ------------------------------------------------------------------ cells and data
    def run(self, code: str, ranks: Iterable[int] | None = None, timeout: float | None = None,
            sink: Any = None) -> Any:
        """Run code on the chosen ranks (all by default); returns a `CellResult`."""
        from nbdist.runner import run_cell

        self._require_running()
        return run_cell(self, code, ranks=ranks, timeout=timeout, sink=sink)

    def push(self, values: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Bind names on the ranks; tensors go to CPU for the trip and to each rank's device."""
        targets = self._targets(ranks)
        asyncs = {r: self._client[self.engine_id(r)].apply_async(bootstrap.receive_values, values)
                  for r in targets}
        self._collect(asyncs, self.config.bootstrap_timeout, "push")

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """Fetch one name from the ranks: {rank: value} (tensors arrive on CPU)."""
        targets = self._targets(ranks)
        asyncs = {r: self._client[self.engine_id(r)].apply_async(bootstrap.send_values, [name])
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

    def mark_setup_cell(self, code: str) -> None:
        """Remember a cell to re-run on every rank after a restart (e.g. imports, model setup)."""
        if code not in self._setup_cells:
            self._setup_cells.append(code)

    # ------------------------------------------------------------------ status
    def status(self) -> Any:
        from nbdist.status import ClusterStatus

        if self.running:
            self.poll_dead()
        return ClusterStatus.of(self)

    def dashboard(self) -> Any:
        """The live dashboard of this cluster (created once, kept across cells)."""
        if self._dashboard is None:
            from nbdist.dashboard import Dashboard

            self._dashboard = Dashboard(ranks=max(self.world_size, 1))
            self.telemetry.subscribe(self._dashboard)
        return self._dashboard

    # ------------------------------------------------------------------ restart / stop
    def restart(self, progress: Progress | None = None, rerun_setup: bool = True) -> Cluster:
        """Same ranks, new engine processes, new process group. Works after a dead rank or a
        lost controller."""
        say = progress or (lambda _msg: None)
        n = self.world_size or self.requested_n or _default_rank_count()
        started = time.perf_counter()
        if self.controller_lost or self._client is None or not self._controller_alive():
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
        if rerun_setup and self._setup_cells:
            for code in self._setup_cells:
                self.run(code).raise_for_errors()
        self.start_seconds = time.perf_counter() - started
        return self

    def _stop_engines(self) -> None:
        pids = []
        for la in self._launchers():
            try:
                proc = psutil.Process(la.pid)
                pids.append((la.pid, proc.create_time()))
                pids.extend((c.pid, c.create_time()) for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        for rank in self.ranks:
            pids.extend(rank.helper_pids)
        watchdog.terminate_all(pids, grace=self.config.stop_timeout)
        try:
            self._ipp.stop_engines_sync()
        except Exception:
            pass
        self._ipp.engines.clear()

    def stop(self) -> list[int]:
        """Stop every process this cluster started, by PID; returns the PIDs that were stopped."""
        pids = self.all_pids()
        self._teardown_processes()
        _LIVE_CLUSTERS.discard(self)
        return pids

    def _teardown_processes(self, keep_workdir: bool = False) -> None:
        owned = self._owned_pids()
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

    def __enter__(self) -> Cluster:
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


def _stop_at_exit(ref: weakref.ReferenceType[Cluster]) -> None:
    cluster = ref()
    if cluster is not None and cluster.running:
        cluster.stop()
