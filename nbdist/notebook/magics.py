"""The IPython magics: parse arguments (IPython's magic_arguments), call the public Cluster and
nbdist.export, display. Everything else is plain Python in nbdist.notebook.options and below."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from nbdist.api import Cluster
from nbdist.cells.lint import lint, summary
from nbdist.cells.result import CellResult
from nbdist.cluster.launchers import LAUNCHERS
from nbdist.cluster.ranks import BACKENDS, parse_ranks
from nbdist.config import OUTPUT_MODES
from nbdist.errors import NbdistError
from nbdist.export import SessionLog, export_session
from nbdist.notebook import transforms
from nbdist.notebook.options import (
    launcher_kwargs,
    memory_size,
    positive_int,
    positive_seconds,
    push_values,
    replaced_message,
    scripted_answers,
    start_config,
    started_message,
)
from nbdist.notebook.sink import NotebookSink

_CURRENT: Cluster | None = None
_SESSION_LOG = SessionLog()
"""Pushed values and failed cells, by In[n], for %dist_export (the history has only the sources)."""


def current_cluster() -> Cluster | None:
    return _CURRENT


def session_log() -> SessionLog:
    return _SESSION_LOG


def _parse(magic: Callable[..., Any], line: str, posix: bool = True) -> argparse.Namespace:
    """IPython's parse_argstring, but the line is split the POSIX way: quotes group words and are
    removed (-o "ssh_args=-p 2222"), where parse_argstring would keep them inside the value.
    `posix=False` keeps them, for a Python expression."""
    parser = magic.parser  # type: ignore[attr-defined]  # set by @magic_arguments
    name = f"%{parser.prog}"
    try:
        return parser.parse_args(arg_split(line, posix=posix))
    except UsageError as exc:
        # magic_arguments' usage starts "::" (reST) and its wrapped lines are one space short
        usage = parser.format_usage().replace("::\n\n  ", "usage: ", 1).replace("\n ", "\n  ")
        raise UsageError(f"{name}: {exc}\n{usage.strip()}") from None
    except ValueError as exc:  # an unclosed quote
        raise UsageError(f"{name}: {exc}") from None


@contextmanager
def _as_usage_error(prefix: str = "", *also: type[Exception]) -> Iterator[None]:
    """nbdist's own errors (and ``also``) shown as a UsageError: the message, no traceback."""
    try:
        yield
    except (NbdistError, *also) as exc:
        raise UsageError(f"{prefix}{exc}") from None


_progress = functools.partial(print, "nbdist:", flush=True)  # start-up progress lines


def shared_options(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options several magics take, each defined once (`--ranks`, `--timeout`, `--rank0`,
    `--output`), applied as IPython's own ``@argument`` decorators are (as ipyparallel's
    ``exec_args``)."""
    return lambda magic: functools.reduce(lambda m, name: _SHARED[name](m), reversed(names), magic)


_SHARED = {
    "ranks": argument("--ranks", default=None, metavar="R", help="only these ranks, e.g. 0,2-3"),
    "timeout": argument("--timeout", type=positive_seconds, default=None, metavar="S",
                        help="deadline in seconds"),
    "rank0": argument("--rank0", action="store_true", help="show only rank 0's output"),
    "output": argument("--output", choices=OUTPUT_MODES, default=None,
                       help="merged (lines alike on several ranks once), ranks (a block per "
                            "rank) or raw (every line as it comes); docs/OUTPUT.md"),
}


@magics_class
class DistMagics(Magics):
    def _cluster(self) -> Cluster:
        if _CURRENT is None or not _CURRENT.running:
            raise UsageError("no cluster is running: run %dist_start first (e.g. %dist_start -n 2)")
        return _CURRENT

    def _cluster_and_ranks(self, ranks: str | None) -> tuple[Cluster, list[int] | None]:
        """The running cluster and --ranks as a rank list (None: every rank)."""
        cluster = self._cluster()
        with _as_usage_error():
            return cluster, None if ranks is None else parse_ranks(ranks, cluster.world_size)

    @magic_arguments()
    @argument("-n", type=positive_int, default=None, metavar="N", help="number of ranks")
    @argument("--backend", choices=list(BACKENDS), default="auto")
    @argument("--gpus-per-rank", type=int, default=1, metavar="K", help="GPUs each rank owns")
    @argument("--threads", type=positive_int, default=None, metavar="T",
              help="CPU threads per rank")
    @argument("--timeout", type=positive_seconds, default=None, metavar="S",
              help="default deadline for every %%%%distributed cell")
    @argument("--memory-limit", type=memory_size, default=None, metavar="SIZE",
              help="what each rank may allocate after start-up, e.g. 512MiB, 1GiB")
    @argument("--share-gpu", action="store_true", help="ranks beyond the GPUs share them (NCCL)")
    @argument("--check-collectives", action="store_true",
              help="torch compares every collective's sizes across ranks first (slower)")
    @argument("--launcher", choices=list(LAUNCHERS), default="local",
              help="how ipyparallel starts the engines")
    @argument("--profile", default=None, metavar="P",
              help="use the engines of a cluster already running in this ipyparallel profile")
    @argument("--master-addr", default=None, metavar="ADDR",
              help="rendezvous address (default: rank 0's)")
    @argument("--interface", default=None, metavar="IFACE",
              help="network interface the ranks talk over (GLOO/NCCL_SOCKET_IFNAME)")
    @argument("--hosts", default=None, metavar="H", help="ssh/mpi: host1,host2 or host1*4,host2*4")
    @argument("--mpi-args", default=None, metavar="A",
              help="extra mpiexec arguments (one quoted string)")
    @argument("--curve", action="store_true", help="encrypt ipyparallel traffic (CurveZMQ)")
    @argument("-o", "--launcher-option", action="append", default=[], metavar="KEY=VALUE",
              help="any launcher option, e.g. -o partition=gpu -o timelimit=2:00:00")
    @argument("--tensorboard", default=None, metavar="DIR",
              help="also write every rank's nbdist.log values as TensorBoard scalars under DIR")
    @line_magic
    def dist_start(self, line: str) -> None:
        """Start the ranks: engines, rank table, devices and one process group, checked by a
        first all_reduce."""
        global _CURRENT
        args = _parse(self.dist_start, line)
        if _CURRENT is not None and _CURRENT.running:
            print("nbdist: a cluster is already running; not starting a second one "
                  "(use %dist_stop first, or %dist_restart)")
            print(_CURRENT.status())
            return
        config = start_config(args.timeout, args.check_collectives, args.share_gpu)
        with _as_usage_error():
            launch = launcher_kwargs(
                launcher=args.launcher, profile=args.profile, master_addr=args.master_addr,
                interface=args.interface, hosts=args.hosts, mpi_args=args.mpi_args,
                curve=args.curve, launcher_options=args.launcher_option)
        try:
            cluster = Cluster(n=args.n, backend=args.backend, gpus_per_rank=args.gpus_per_rank,
                              threads=args.threads, config=config,
                              memory_limit=args.memory_limit, tensorboard=args.tensorboard,
                              **launch)
            cluster.start(progress=_progress)
        except NbdistError as exc:
            raise UsageError(f"%dist_start failed: {exc}\nNothing is left running.") from None
        _CURRENT = cluster
        print(started_message(cluster, args.tensorboard))

    @magic_arguments(name="%distributed")  # shown with magic_arguments' own "%": %%distributed
    @shared_options("ranks", "timeout", "rank0", "output")
    @argument("--setup", action="store_true", help="re-run this cell after %%dist_restart")
    @argument("--no-lint", action="store_true",
              help="do not warn about collectives only some ranks reach")
    @argument("--profile", nargs="?", const=True, metavar="PATH", help="profile; trace to PATH")
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run the cell on the ranks; output streams live per rank."""
        args = _parse(self.distributed, line)
        cluster, ranks = self._cluster_and_ranks(args.ranks)
        findings = [] if args.no_lint else lint(cell)
        if findings:
            print(summary(findings), flush=True)
        if args.setup:
            cluster.mark_setup_cell(cell)
        sink = NotebookSink.for_cell(cluster, ranks, args.rank0, args.output)
        result = None
        try:
            with _as_usage_error():
                result = cluster.run(cell, ranks, args.timeout, sink, profile=args.profile)
        finally:
            # even when the cell failed or was interrupted: a live widget view left in the saved
            # output would read "model not found" once the kernel is gone
            sink.close(result)
        self._show_result(result, sink)
        return cluster.last_profile if args.profile else None  # shown under the cell's output

    def _show_result(self, result: CellResult | None, sink: NotebookSink) -> None:
        """Errors raise (root causes first); otherwise each rank's value, then what nbdist did."""
        assert result is not None  # cluster.run returned it (or raised)
        self.shell.user_ns["_dist_result"] = result
        if result.errors:
            result.raise_for_errors()
        sink.show_values(result)
        for action in result.actions:
            print(f"nbdist: {action}")

    @magic_arguments()
    @shared_options("ranks", "timeout", "rank0", "output")
    @argument("script", help="the torchrun script, run unchanged on every rank as __main__")
    @argument("args", nargs=argparse.REMAINDER, help="its own arguments (its sys.argv[1:])")
    @line_magic
    def dist_run(self, line: str) -> None:
        """Run an existing torchrun script on the ranks, unchanged: as __main__, with its own
        sys.argv and torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...); its
        init/destroy_process_group work as under torchrun; sys.exit(0) is success. Like %run -i,
        it runs in each rank's namespace, so its globals are there for the next cell."""
        args = _parse(self.dist_run, line)
        cluster, ranks = self._cluster_and_ranks(args.ranks)
        sink = NotebookSink.for_cell(cluster, ranks, args.rank0, args.output)
        result = None
        try:
            with _as_usage_error():
                result = cluster.run_script(args.script, args.args, ranks=ranks,
                                            timeout=args.timeout, sink=sink)
        finally:
            sink.close(result)
        self._show_result(result, sink)

    @magic_arguments()
    @argument("--collectives", action="store_true", help="each rank's recent collectives")
    @line_magic
    def dist_status(self, line: str) -> Any:
        """%dist_status: ranks, hosts, PIDs, devices, states; or --collectives side by side."""
        args = _parse(self.dist_status, line)
        if _CURRENT is None:
            print("nbdist: no cluster running (start one with %dist_start)")
            return None
        with _as_usage_error("%dist_status: "):
            return _CURRENT.collectives() if args.collectives else _CURRENT.status()

    @line_magic
    def dist_stop(self, line: str) -> None:
        """%dist_stop: stop every process nbdist started, by PID."""
        global _CURRENT
        _no_arguments("dist_stop", line)
        if _CURRENT is None or not _CURRENT.running:
            print("nbdist: no cluster running")
            _CURRENT = None
            return
        started = time.perf_counter()
        pids = _CURRENT.stop()
        _CURRENT = None
        print(f"nbdist: stopped {len(pids)} process(es) in {time.perf_counter() - started:.1f} s "
              f"(PIDs {', '.join(map(str, pids))})")

    @magic_arguments()
    @argument("--dead", action="store_true",
              help="replace only the dead ranks; the others keep their variables")
    @line_magic
    def dist_restart(self, line: str) -> None:
        """%dist_restart: same ranks, new engine processes, new process group."""
        args = _parse(self.dist_restart, line)
        cluster = _CURRENT
        if cluster is None:
            raise UsageError("no cluster to restart: run %dist_start first")
        old = {p.spec.rank: p.pid for p in cluster.ranks}
        if args.dead:
            with _as_usage_error("%dist_restart --dead: "):
                replaced = cluster.replace_dead(progress=_progress)
            print(replaced_message(replaced, cluster.start_seconds, cluster.generation))
            return
        with _as_usage_error("%dist_restart: "):
            cluster.restart(progress=_progress)
        print(f"nbdist: restarted {cluster.world_size} rank(s) in {cluster.start_seconds:.1f} s "
              f"(process group generation {cluster.generation}; old PIDs {sorted(old.values())})")
        print(cluster.status().table())

    @line_magic
    def dist_dashboard(self, line: str) -> Any:
        """%dist_dashboard: show the live per-rank memory and metrics dashboard."""
        _no_arguments("dist_dashboard", line)
        return self._cluster().dashboard()

    @magic_arguments()
    @argument("items", nargs="*", metavar="NAME|name=expr",
              help="a notebook variable, or a name bound to an expression's value")
    @line_magic
    def dist_push(self, line: str) -> None:
        """Send values to every rank (tensors land on each rank's device)."""
        cluster = self._cluster()
        args = _parse(self.dist_push, line, posix=False)  # an expression keeps its quotes: s='a'
        with _as_usage_error():
            values = push_values(args.items, self.shell.user_ns, self.shell.ev)
            cluster.push(values)
        _SESSION_LOG.record_push(values)
        print(f"nbdist: pushed {', '.join(values)} to {cluster.world_size} rank(s)")

    @magic_arguments()
    @argument("name", help="the variable to fetch from the ranks")
    @shared_options("ranks")
    @line_magic
    def dist_pull(self, line: str) -> dict[int, Any]:
        """{rank: value} of a variable on the ranks (tensors arrive on CPU)."""
        args = _parse(self.dist_pull, line)
        cluster, ranks = self._cluster_and_ranks(args.ranks)
        with _as_usage_error():
            return cluster.pull(args.name, ranks=ranks)

    @magic_arguments()
    @shared_options("ranks")
    @argument("--full", action="store_true",
              help="compare sharded DTensors in full (gathers them), not just their shard shapes")
    @argument("expr", nargs="+", help="evaluated on every rank, e.g. model or opt.state_dict()")
    @line_magic
    def dist_diff(self, line: str) -> None:
        """Compare a value across ranks (tensors, modules, state dicts, optimizers, containers):
        the first differing entry, which ranks differ, the largest difference."""
        args = _parse(self.dist_diff, line, posix=False)  # the expression keeps its quotes
        cluster, ranks = self._cluster_and_ranks(args.ranks)
        with _as_usage_error():
            print(cluster.diff(" ".join(args.expr), ranks=ranks, full=args.full))

    @magic_arguments()
    @argument("rank", nargs="?", type=int, default=None,
              help="the rank to debug (default: the last failed cell's first root cause)")
    @argument("-c", "--command", action="append", default=None, metavar="CMD",
              help="pdb commands to run instead of asking (repeatable; headless runs, tutorials)")
    @line_magic
    def dist_debug(self, line: str) -> None:
        """Post-mortem debugger (pdb) on a rank's failed %%distributed cell, like %debug: p, pp,
        up, down, l, w, q; the frames and tensors stay on the rank."""
        args = _parse(self.dist_debug, line)
        cluster = self._cluster()
        ask = input if args.command is None else scripted_answers(args.command)
        with _as_usage_error():
            cluster.debug(args.rank, ask=ask, show=print)

    @magic_arguments()
    @argument("file", help="the script to write")
    @argument("--notebook", default=None, metavar="NB.ipynb",
              help="export this saved notebook's cells (document order), not this session's")
    @argument("--nproc", type=positive_int, default=None, metavar="N",
              help="ranks the script is written for (default: the running cluster's, else 2)")
    @line_magic
    def dist_export(self, line: str) -> None:
        """The %%distributed cells and pushed values as a torchrun script (from this session's
        history, or from a saved notebook in document order)."""
        args = _parse(self.dist_export, line)
        running = _CURRENT if _CURRENT is not None and _CURRENT.running else None
        with _as_usage_error("%dist_export: ", OSError):
            report = export_session(
                args.file, self.shell.history_manager.input_hist_raw, _SESSION_LOG,
                notebook=args.notebook, nproc=args.nproc,
                world_size=running.world_size if running else None,
                threads=running.requested_threads if running else None)
        for message in report.summary():
            print(f"nbdist: {message}")

    @magic_arguments()
    @argument("state", nargs="?", default="", metavar="on|off")
    @line_magic
    def autodist(self, line: str) -> None:
        """Send every following cell to the ranks (on), or stop doing so (off)."""
        choice = _parse(self.autodist, line).state.lower()
        if choice not in ("on", "off"):
            raise UsageError("%autodist takes on or off")
        transforms.set_autodist(self.shell, choice == "on")
        if choice == "on":
            print("nbdist: autodist on: every cell now runs on the ranks (%autodist off to stop)")
        else:
            print("nbdist: autodist off")


def _no_arguments(magic: str, line: str) -> None:
    # refused rather than ignored: `%dist_stop now` or `%dist_restart -n 4` must not run as if
    # they had been understood
    if line.strip():
        raise UsageError(f"%{magic} takes no arguments (got {line.strip()!r})")


def register_magics(ipython: Any) -> None:
    ipython.register_magics(DistMagics)
    transforms.install(ipython)
    if _SESSION_LOG.cell_finished not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", _SESSION_LOG.cell_finished)


def unregister_magics(ipython: Any) -> None:
    if _SESSION_LOG.cell_finished in ipython.events.callbacks["post_run_cell"]:
        ipython.events.unregister("post_run_cell", _SESSION_LOG.cell_finished)
    transforms.uninstall(ipython)
