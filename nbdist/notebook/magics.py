"""The IPython magics: parse arguments, call Cluster / run_cell, display. Nothing else lives here."""

from __future__ import annotations

import argparse
import shlex
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nbdist.api import Cluster
from nbdist.config import DEFAULT
from nbdist.notebook.sink import NotebookSink
from nbdist.errors import NbdistError
from nbdist.export import SessionLog
from nbdist.cluster.ranks import parse_ranks

_CURRENT: Cluster | None = None
_SESSION_LOG = SessionLog()
"""Pushed values and failed cells, by In[n], for %dist_export (the history has only the sources)."""


def current_cluster() -> Cluster | None:
    return _CURRENT


def session_log() -> SessionLog:
    return _SESSION_LOG


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel
        raise UsageError(f"{self.prog}: {message}\nusage: {self.format_usage().strip()}")


def _parse(parser: argparse.ArgumentParser, line: str) -> argparse.Namespace:
    try:
        return parser.parse_args(shlex.split(line))
    except ValueError as exc:
        raise UsageError(f"{parser.prog}: {exc}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be 1 or more")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 seconds")
    return value


START = _Parser(prog="%dist_start", add_help=False)
START.add_argument("-n", type=_positive_int, default=None, help="number of ranks")
START.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
START.add_argument("--gpus-per-rank", type=int, default=1)
START.add_argument("--threads", type=_positive_int, default=None)
START.add_argument("--timeout", type=_positive_float, default=None,
                   help="default deadline for every %%distributed cell")
START.add_argument("--launcher", choices=["local", "mpi", "slurm", "ssh"], default="local",
                   help="how ipyparallel starts the engines")
START.add_argument("--profile", default=None,
                   help="use the engines of a cluster already running in this ipyparallel profile")
START.add_argument("--master-addr", default=None, help="rendezvous address (default: rank 0's)")
START.add_argument("--interface", default=None,
                   help="network interface the ranks talk over (GLOO/NCCL_SOCKET_IFNAME)")
START.add_argument("--hosts", default=None, help="ssh/mpi: host1,host2 or host1*4,host2*4")
START.add_argument("--mpi-args", default=None, help="extra mpiexec arguments (one quoted string)")
START.add_argument("--curve", action="store_true", help="encrypt ipyparallel traffic (CurveZMQ)")
START.add_argument("-o", "--launcher-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any launcher option, e.g. -o partition=gpu -o timelimit=2:00:00")

CELL = _Parser(prog="%%distributed", add_help=False)
CELL.add_argument("--ranks", default=None)
CELL.add_argument("--timeout", type=_positive_float, default=None)
CELL.add_argument("--rank0", action="store_true")
CELL.add_argument("--setup", action="store_true", help="re-run this cell after %dist_restart")

PULL = _Parser(prog="%dist_pull", add_help=False)
PULL.add_argument("name")
PULL.add_argument("--ranks", default=None)


@magics_class
class DistMagics(Magics):
    def _cluster(self) -> Cluster:
        if _CURRENT is None or not _CURRENT.running:
            raise UsageError(
                "no cluster is running: run %dist_start first (e.g. %dist_start -n 2)"
            )
        return _CURRENT

    @line_magic
    def dist_start(self, line: str) -> None:
        """%dist_start [-n N] [--backend auto|nccl|gloo] [--gpus-per-rank K] [--threads T] [--timeout S]
        [--launcher local|mpi|slurm|ssh] [--hosts H] [--mpi-args A] [-o KEY=VALUE ...] [--curve]
        [--profile P] [--master-addr ADDR] [--interface IFACE]"""
        global _CURRENT
        args = _parse(START, line)
        if _CURRENT is not None and _CURRENT.running:
            print("nbdist: a cluster is already running; not starting a second one "
                  "(use %dist_stop first, or %dist_restart)")
            print(_CURRENT.status())
            return
        config = DEFAULT if args.timeout is None else DEFAULT.replace(cell_timeout=args.timeout)
        try:
            cluster = Cluster(n=args.n, backend=args.backend, gpus_per_rank=args.gpus_per_rank,
                              threads=args.threads, config=config, **_launcher_kwargs(args))
            cluster.start(progress=lambda msg: print(f"nbdist: {msg}", flush=True))
        except NbdistError as exc:
            raise UsageError(f"%dist_start failed: {exc}\nNothing is left running.") from None
        _CURRENT = cluster
        status = cluster.status()
        print(f"nbdist: {cluster.world_size} rank(s) ready ({cluster.backend}) in "
              f"{cluster.start_seconds:.1f} s; first all_reduce ok on every rank")
        print(status.table())

    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """%%distributed [--ranks 0,2-3] [--timeout S] [--rank0] [--setup]"""
        args = _parse(CELL, line)
        cluster = self._cluster()
        ranks = None if args.ranks is None else _ranks(args.ranks, cluster.world_size)
        if args.setup:
            cluster.mark_setup_cell(cell)
        sink = NotebookSink(only_rank0=args.rank0, dashboard_factory=cluster.dashboard)
        try:
            result = cluster.run(cell, ranks=ranks, timeout=args.timeout, sink=sink)
        except NbdistError as exc:
            raise UsageError(str(exc)) from None
        finally:
            # even when the cell failed or was interrupted: a live widget view left in the saved
            # output would read "model not found" once the kernel is gone
            sink.flush()
            if sink.dashboard is not None and hasattr(sink.dashboard, "finalize"):
                try:
                    sink.dashboard.finalize()
                except Exception:
                    pass
        self.shell.user_ns["_dist_result"] = result
        if result.errors:
            result.raise_for_errors()
        sink.show_values(result)
        for action in result.actions:
            print(f"nbdist: {action}")

    @line_magic
    def dist_status(self, line: str) -> Any:
        """%dist_status: ranks, hosts, PIDs, devices, states."""
        if _CURRENT is None:
            print("nbdist: no cluster running (start one with %dist_start)")
            return None
        return _CURRENT.status()

    @line_magic
    def dist_stop(self, line: str) -> None:
        """%dist_stop: stop every process nbdist started, by PID."""
        global _CURRENT
        if _CURRENT is None or not _CURRENT.running:
            print("nbdist: no cluster running")
            _CURRENT = None
            return
        started = time.perf_counter()
        pids = _CURRENT.stop()
        _CURRENT = None
        print(f"nbdist: stopped {len(pids)} process(es) in {time.perf_counter() - started:.1f} s "
              f"(PIDs {', '.join(map(str, pids))})")

    @line_magic
    def dist_restart(self, line: str) -> None:
        """%dist_restart: same ranks, new engine processes, new process group."""
        cluster = _CURRENT
        if cluster is None:
            raise UsageError("no cluster to restart: run %dist_start first")
        old = {p.spec.rank: p.pid for p in cluster.ranks}
        cluster.restart(progress=lambda msg: print(f"nbdist: {msg}", flush=True))
        print(f"nbdist: restarted {cluster.world_size} rank(s) in {cluster.start_seconds:.1f} s "
              f"(process group generation {cluster.generation}; old PIDs {sorted(old.values())})")
        print(cluster.status().table())

    @line_magic
    def dist_dashboard(self, line: str) -> Any:
        """%dist_dashboard: show the live per-rank memory and metrics dashboard."""
        return self._cluster().dashboard()

    @line_magic
    def dist_push(self, line: str) -> None:
        """%dist_push NAME [NAME ...] | %dist_push name=expr: send values to every rank."""
        cluster = self._cluster()
        if not line.strip():
            raise UsageError("%dist_push needs names (x y) or name=expression")
        values: dict[str, Any] = {}
        for item in shlex.split(line):
            if "=" in item:
                name, expr = item.split("=", 1)
                values[name.strip()] = self.shell.ev(expr)
            elif item in self.shell.user_ns:
                values[item] = self.shell.user_ns[item]
            else:
                raise UsageError(f"%dist_push: {item!r} is not defined in the notebook")
        for name in values:
            if not name.isidentifier():
                raise UsageError(f"%dist_push: {name!r} is not a valid name")
        cluster.push(values)
        _SESSION_LOG.record_push(values)
        print(f"nbdist: pushed {', '.join(values)} to {cluster.world_size} rank(s)")

    @line_magic
    def dist_pull(self, line: str) -> dict[int, Any]:
        """%dist_pull NAME [--ranks R]: {rank: value} (tensors arrive on CPU)."""
        args = _parse(PULL, line)
        cluster = self._cluster()
        ranks = None if args.ranks is None else _ranks(args.ranks, cluster.world_size)
        try:
            return cluster.pull(args.name, ranks=ranks)
        except NbdistError as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def dist_export(self, line: str) -> None:
        """%dist_export FILE [--notebook NB.ipynb] [--nproc N]: the %%distributed cells and pushed
        values as a torchrun script (from this session's history, or from a saved notebook in
        document order)."""
        from nbdist import export

        parser = _Parser(prog="%dist_export", add_help=False)
        parser.add_argument("file")
        parser.add_argument("--notebook", default=None)
        parser.add_argument("--nproc", type=_positive_int, default=None)
        args = _parse(parser, line)
        running = _CURRENT is not None and _CURRENT.running
        world_size = _CURRENT.world_size if running and _CURRENT is not None else None
        threads = _CURRENT.requested_threads if running and _CURRENT is not None else None
        nproc = args.nproc or world_size or 2
        try:
            if args.notebook:
                sources = export.cells_from_notebook(args.notebook)
                log = export.notebook_log(args.notebook)
            else:
                sources = export.cells_from_history(self.shell.history_manager.input_hist_raw)
                log = _SESSION_LOG
            steps = export.script_steps(sources, world_size, log)
            path = export.write_script(args.file, steps, nproc=nproc, threads=threads)
        except (NbdistError, OSError) as exc:
            raise UsageError(f"%dist_export: {exc}") from None
        cells = [s for s in steps if isinstance(s, export.DistributedCell)]
        failed = export.failed_cells(steps)
        print(f"nbdist: wrote {len(cells) - len(failed)} cell run(s) to {path}; run it with "
              f"torchrun --nproc-per-node {nproc} {path}")
        if failed:
            print(f"nbdist: left out {len(failed)} cell(s) that failed in the notebook "
                  f"({', '.join(c.label for c in failed)}); they are in the script as comments")
        missing = export.placeholders(steps)
        if missing:
            listed = "; ".join(f"{v.name} ({v.description})" for v in missing)
            print(f"nbdist: warning: {len(missing)} pushed value(s) cannot be written into the script: "
                  f"{listed}. The script raises NotImplementedError where each was pushed: "
                  "define them there.")

    @line_magic
    def autodist(self, line: str) -> None:
        """%autodist on|off: send every following cell to the ranks."""
        choice = line.strip().lower()
        if choice not in ("on", "off"):
            raise UsageError("%autodist takes on or off")
        transformers = self.shell.input_transformers_cleanup
        if choice == "on":
            if _autodist_transform not in transformers:
                transformers.append(_autodist_transform)
            print("nbdist: autodist on: every cell now runs on the ranks (%autodist off to stop)")
        else:
            if _autodist_transform in transformers:
                transformers.remove(_autodist_transform)
            print("nbdist: autodist off")


def _launcher_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """%dist_start's multi-host flags as Cluster keyword arguments (see nbdist.cluster.launchers)."""
    options: dict[str, Any] = {}
    for item in args.launcher_option:
        if "=" not in item:
            raise UsageError(f"%dist_start -o {item!r}: write KEY=VALUE (e.g. -o partition=gpu)")
        key, value = item.split("=", 1)
        options[key.strip()] = value
    if args.hosts:
        options["hosts"] = args.hosts
    if args.mpi_args:
        options["mpi_args"] = args.mpi_args
    if args.curve:
        options["curve"] = True
    kwargs: dict[str, Any] = {"master_addr": args.master_addr, "interface": args.interface}
    if args.profile is not None:
        kwargs["profile"] = args.profile
    if args.launcher != "local" or options:
        kwargs["launcher"] = args.launcher
        kwargs["launcher_options"] = options
    return kwargs


def _ranks(text: str, world_size: int) -> list[int]:
    try:
        return parse_ranks(text, world_size)
    except NbdistError as exc:
        raise UsageError(str(exc)) from None


def _autodist_transform(lines: list[str]) -> list[str]:
    first = next((ln for ln in lines if ln.strip()), "")
    if not first or first.lstrip().startswith("%") or first.lstrip().startswith("!"):
        return lines
    return ["%%distributed\n", *lines]


def register_magics(ipython: Any) -> None:
    ipython.register_magics(DistMagics)
    if _SESSION_LOG.cell_finished not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", _SESSION_LOG.cell_finished)


def unregister_magics(ipython: Any) -> None:
    if _SESSION_LOG.cell_finished in ipython.events.callbacks["post_run_cell"]:
        ipython.events.unregister("post_run_cell", _SESSION_LOG.cell_finished)
    if _autodist_transform in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(_autodist_transform)
