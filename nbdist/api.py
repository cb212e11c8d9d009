"""`nbdist.Cluster`: the one object a notebook user holds.

It is the cluster layer (`nbdist.cluster.ClusterCore`: processes, ranks, process group) plus what
sits above it: running cells (`nbdist.cells`), the status snapshot and the live dashboard.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from nbdist.cells import post_mortem
from nbdist.cells.collectives_view import (
    CollectivesView,
    collectives_table,
    recent_collectives,
    save_trace,
)
from nbdist.cells.diff import FETCH_LIMIT, DiffReport, diff_ranks
from nbdist.cells.execute import OutputSink, run_cell
from nbdist.cells.profiling import collect_last_profile, run_profiled
from nbdist.cells.result import CellResult
from nbdist.cluster.arguments import (
    check_code,
    check_directory,
    check_rank_selection,
    check_timeout,
)
from nbdist.cluster.core import ClusterCore, Progress
from nbdist.cluster.launch_modes import attach_target
from nbdist.cluster.status import ClusterStatus
from nbdist.config import DEFAULT, NbdistConfig
from nbdist.errors import DistributedCellError, NbdistError
from nbdist.export.run import script_cell
from nbdist.features.env import cluster_env

if TYPE_CHECKING:
    from nbdist.cluster.slurm import SlurmJob
    from nbdist.dashboard import Dashboard
    from nbdist.dashboard.tensorboard import TensorBoardWriter
    from nbdist.profiler import ProfileReport


class Cluster(ClusterCore):
    """A set of ranks forming one torch.distributed process group, driven from a notebook.

    >>> cluster = Cluster(n=2).start()          # doctest: +SKIP
    >>> cluster.run("dist.all_reduce(t := torch.ones(1)); t").raise_for_errors()  # doctest: +SKIP
    >>> cluster.stop()                           # doctest: +SKIP
    """

    def __init__(self, *args: Any, memory_limit: int | str | None = None,
                 share_gpu: bool | None = None,
                 tensorboard: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        """`memory_limit`: what each rank may allocate after start-up (bytes, "512MiB", "1GiB",
        "2GB"); past it the rank's allocation fails and the report names the rank and the limit
        (nbdist.worker.rank_memory). `share_gpu`: ranks that outnumber the GPUs share them, NCCL
        between them (for learning and testing; None: the config's, `NBDIST_SHARE_GPU`).
        `tensorboard`: a log directory; every rank's `nbdist.log` values are also written there
        as TensorBoard scalars (`loss/rank0`, ...) in one new run directory,
        `self.tensorboard.run_dir`. The rest: see `ClusterCore`."""
        config = kwargs.get("config") or DEFAULT
        changes = {name: value for name, value in (("memory_limit", memory_limit),
                                                   ("share_gpu", share_gpu)) if value is not None}
        if changes and isinstance(config, NbdistConfig):
            kwargs["config"] = config.replace(**changes)  # checked there
        self.tensorboard: TensorBoardWriter | None = None
        if tensorboard is not None:  # checked (and the package looked for) before anything starts
            from nbdist.dashboard.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(check_directory(tensorboard, "--tensorboard"))
        super().__init__(*args, **kwargs)
        if self.tensorboard is not None:
            self.telemetry.subscribe(self.tensorboard)
        self._dashboard: Dashboard | None = None
        self._setup_cells: list[str] = []
        self.last_result: CellResult | None = None
        """The last cell's outcome (what `debug` looks at)."""
        self.last_profile: ProfileReport | None = None
        """The last profiled cell's merged profile (`run(..., profile=...)`)."""

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
    ) -> Cluster:
        """Use the engines of a cluster the user already started (`ipcluster start`, a Slurm
        job) as ranks. nbdist starts and kills nothing there: stop() only leaves the process
        group; restart() waits for the engines to be back (restart them yourself)."""
        cluster = cls(n=n, **kwargs)
        cluster.attach_to(attach_target(profile, cluster_id, profile_dir, url_file))
        cluster.start(progress)
        return cluster

    def run(self, code: str, ranks: Iterable[int] | None = None, timeout: float | None = None,
            sink: OutputSink | None = None, profile: bool | str | None = None) -> CellResult:
        """Run code on the chosen ranks (all by default); returns a `CellResult`. `profile`:
        True or a trace path: torch.profiler on every rank, merged into `last_profile` (and
        written to that path as a Chrome/Perfetto trace)."""
        code, ranks, timeout = check_code(code), check_rank_selection(ranks), check_timeout(timeout)
        self._require_running()
        if profile is None or profile is False:
            self.last_result = run_cell(self, code, ranks=ranks, timeout=timeout, sink=sink)
        else:
            self.last_result, self.last_profile = run_profiled(self, code, ranks, timeout, sink,
                                                               profile)
        return self.last_result

    def output(self, rank: int) -> str:
        """Everything `rank` printed in the last cell, stdout and stderr as they came, also what
        the notebook left out of a long output ("" when it printed nothing)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise NbdistError(f"rank {rank!r} does not exist (ranks 0-{self.world_size - 1})")
        result = self.last_result
        return result.output(rank) if result is not None else ""

    def collect_profile(self, ranks: Iterable[int] | None = None,
                        path: str | None = None) -> ProfileReport:
        """Merge what `with nbdist.profile():` last captured on each rank (and write it to
        `path` as one Chrome/Perfetto trace)."""
        self._require_running()
        self.last_profile = collect_last_profile(self, check_rank_selection(ranks), path)
        return self.last_profile

    def diff(self, expr: str, ranks: Iterable[int] | None = None, full: bool = False,
             fetch_limit: int = FETCH_LIMIT) -> DiffReport:
        """Evaluate `expr` on each rank and compare (tensors, modules, state dicts, optimizers,
        containers, plain values): which entry differs first, on which ranks, by how much. Only
        fingerprints travel, then the first `fetch_limit` differing tensors. `full`: compare
        sharded DTensors in full (a collective), not just their local shapes."""
        self._require_running()
        return diff_ranks(self, expr, ranks=None if ranks is None else list(ranks), full=full,
                          fetch_limit=fetch_limit)

    def debug(self, rank: int | None = None, ask: post_mortem.Ask | None = None,
              show: post_mortem.Show = print) -> int:
        """Post-mortem pdb on a rank's failed cell (default: the last cell's first root cause),
        one command per `ask(prompt)` (default `input`, looked up now: ipykernel replaces it
        for each cell); returns the number of commands run."""
        self._require_running()
        rank = self.targets([post_mortem.pick_rank(self.last_result, rank)])[0]
        return post_mortem.debug_rank(self, rank, ask or (lambda prompt: input(prompt)), show)

    def run_script(self, path: str, args: Sequence[str] = (), ranks: Iterable[int] | None = None,
                   timeout: float | None = None, sink: OutputSink | None = None) -> CellResult:
        """Run an existing torchrun script unchanged on the chosen ranks (`%dist_run`): as
        `__main__`, with `sys.argv = [path, *args]` and torchrun's environment; `sys.exit(0)` is
        success. It runs in each rank's namespace, so its globals stay there for the next cell."""
        here = all(self.launch_mode.pid_is_here(p) for p in self.ranks)
        return self.run(script_cell(path, args, must_exist=here), ranks=ranks, timeout=timeout,
                        sink=sink)

    def mark_setup_cell(self, code: str) -> None:
        """Remember a cell to re-run on every rank after a restart (e.g. imports, model setup)."""
        if code not in self._setup_cells:
            self._setup_cells.append(code)

    def restart(self, progress: Progress | None = None, rerun_setup: bool = True) -> Cluster:
        """Same ranks, new engine processes, new process group; then the setup cells again.
        Works after a dead rank or a lost controller."""
        super().restart(progress)
        if rerun_setup:
            for number, code in enumerate(self._setup_cells, 1):
                result = self.run(code)
                if result.errors:  # raised, or the stop button pressed while it ran
                    raise DistributedCellError(
                        f"the ranks restarted, but setup cell {number} of {len(self._setup_cells)} "
                        f"did not finish: {result.failure_message()}", result)
        return self

    @property
    def batch_job(self) -> SlurmJob | None:
        """The engines' Slurm job (`job_id`, `state()`, `log_tail()`) when `launcher="slurm"`
        submitted them; None otherwise."""
        return self.launch_mode.job

    env = cluster_env  # `%dist_env`'s table from Python: `cluster.env()`, `cluster.env([0, 1])`

    def status(self) -> ClusterStatus:
        if self.running:
            self.poll_dead()
        job = self.batch_job
        return ClusterStatus.of(self, batch_job=job.summary() if job is not None else "")

    def collectives(self, limit: int = 8) -> CollectivesView:
        """Each rank's last `limit` collectives side by side, from torch's flight recorder: one
        row per group and sequence id, operation and sizes per rank, mismatches named below."""
        self._require_running()
        return collectives_table(recent_collectives(self, limit))

    def save_collectives_trace(self, directory: str | os.PathLike[str],
                               stacks: bool = True) -> list[str]:
        """Every rank's flight-recorder trace as one file per rank in `directory`, for torch's
        analyser: ``python -m torch.distributed.flight_recorder.fr_trace DIRECTORY``."""
        self._require_running()
        return [str(path) for path in save_trace(self, directory, stacks)]

    def stop(self) -> list[int]:
        """Stop every process this cluster started, by PID (and close the TensorBoard file);
        returns the PIDs that were stopped."""
        try:
            return super().stop()
        finally:
            if self.tensorboard is not None:
                self.tensorboard.close()  # a later start writes a new file in the same run

    def dashboard(self) -> Dashboard:
        """The live dashboard of this cluster (created once, kept across cells)."""
        if self._dashboard is None:
            from nbdist.dashboard import Dashboard  # anywidget: imported only when shown

            self._dashboard = Dashboard(ranks=max(self.world_size, 1))
            # attach replays the payloads already received, so the first one is not lost
            self._dashboard.attach(self.telemetry)
        return self._dashboard
