"""Every timeout and knob nbdist uses, in one dataclass with documented defaults.

Tests build a config with short values; users change one field with ``Cluster(config=...)`` or
``nbdist.config.DEFAULT.<field> = ...`` before ``%dist_start``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass


@dataclass
class NbdistConfig:
    engine_start_timeout: float = 90.0
    """Seconds to wait for every engine to register with the controller."""

    fork_server: bool = True
    """Local engines are forked from one warm process that imported torch once (fast start and
    restart); False starts each engine as a fresh interpreter, as ipyparallel does."""

    direct_cells: InitVar[bool | None] = None
    """Deprecated and ignored: every cell goes to every rank over the cell channel."""

    batch_queue_timeout: float = 0.0
    """Seconds a batch job (Slurm) may wait in the queue before start gives up and cancels it; 0:
    wait as long as it is queued (progress shows its state; interrupt to cancel)."""

    batch_query_interval: float = 1.0
    """Least seconds between two questions to the batch system about the engines' job (squeue
    asks slurmctld, which a tight poll loop would load)."""

    batch_command_timeout: float = 30.0
    """Seconds a batch-system command (squeue, scancel, sbatch --test-only) may take."""

    batch_end_settle: float = 3.0
    """Seconds to wait for why an ending job ends when Slurm does not say yet (COMPLETING with no
    reason and no signal: the moment before scancel's signal lands, or a job that completed)."""

    bootstrap_timeout: float = 120.0
    """Seconds for the rank bootstrap (torch import, device pinning, first all_reduce)."""

    process_group_timeout: float = 60.0
    """torch.distributed timeout for collectives on gloo (gloo's own default is 30 minutes)."""

    nccl_process_group_timeout: float = 1800.0
    """The same on NCCL, where a timed-out collective aborts the group's communicators: long
    enough for a pdb session, a checkpoint rank 0 writes alone or a DeepSpeed op build on one
    rank (docs/NCCL.md)."""

    cell_timeout: float | None = None
    """Default deadline for a %%distributed cell in seconds (None: no deadline)."""

    poll_interval: float = 0.02
    """How often the notebook side checks for output, results and dead ranks while a cell runs."""

    telemetry_interval: float = 0.5
    """Seconds between rank-side samples (memory, metrics, where the rank is)."""

    collective_report_interval: float = 0.1
    """While a rank waits inside a collective, seconds between reports of where it is: a peer
    that fails meanwhile is then known to block it within this, and only then is the group torn
    down (an error that every rank raised never touches it)."""

    flight_recorder_entries: int = 256
    """Collectives each rank's flight recorder keeps (``TORCH_FR_BUFFER_SIZE``; torch's own
    default is 2000): the hang report reads the last ones of each group. 0 turns it off."""

    check_collectives: bool = False
    """Run every rank with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch compares each collective's
    operation and shapes across ranks before running it, so a mismatch raises on every rank
    instead of aborting one (docs/FAULTS.md says what it costs)."""

    cell_end_collective_wait: float = 1.0
    """At a cell's end, seconds a gloo rank waits for collectives it left in flight (a DTensor
    layer's, ``async_op=True``) to finish: one whose sizes differ across ranks aborts a rank
    from gloo's own thread, and then does so in the cell that ran it (docs/FAULTS.md, row 23)."""

    stale_after: float = 5.0
    """A running rank that has sent no telemetry for this long is shown as stale."""

    where_answer_timeout: float = 1.0
    """At a deadline or the stop button, seconds to wait for the ranks still running to say where
    they are now (asked by a signal, they answer from a thread of their own in milliseconds,
    even from inside a collective): the report's first line is built from those answers."""

    fault_settle: float = 1.0
    """After the first rank fails, seconds to let the others report before the cell ends."""

    interrupt_grace: float = 2.0
    """After SIGINT, seconds for ranks running Python to stop before the ladder's next step."""

    collective_grace: float = 0.5
    """After SIGINT, seconds before a rank its telemetry shows blocked inside a collective is
    made to fail there (it cannot see SIGINT until the collective returns, which needs peers
    that were just interrupted)."""

    teardown_grace: float = 3.0
    """After tearing down process groups, seconds before an engine still busy is killed."""

    kill_confirm_wait: float = 3.0
    """After the ladder's SIGKILL, seconds to wait for the engine's exit before marking it dead."""

    cell_report_timeout: float = 5.0
    """Seconds to wait for ranks' post-cell reports (collectives entered, failed collective)."""

    dead_check_interval: float = 0.1
    """While a cell runs, seconds between checks for dead engine processes (each reads /proc)."""

    rebuild_timeout: float = 30.0
    """Seconds for rebuilding the process group (new generation, fresh store) after a fault."""

    stop_timeout: float = 5.0
    """Seconds %dist_stop waits for processes to exit before it kills them by PID."""

    max_output_chars: int = 200_000
    """Per rank and stream: output shown live beyond this is truncated (with a note); the
    stream's last `output_tail_chars` are shown when the cell ends."""

    output_tail_chars: int = 2_000
    """The end of a truncated stream, shown when the cell ends (whole lines)."""

    watchdog_interval: float = 0.5
    """How often the orphan watchdog checks that the notebook kernel is still alive."""

    orphan_kill_grace: float = 2.0
    """Once the kernel is gone, seconds the watchdog gives orphaned processes after SIGTERM."""

    startup_poll_interval: float = 0.02
    """How often start-up waits (connection file, engine registration) look again."""

    exit_status_timeout: float = 1.0
    """Seconds poll_dead waits for a reaped engine's exit status before calling it unknown."""

    exit_status_poll_interval: float = 0.01
    """How often poll_dead looks again for that exit status."""

    telemetry_start_delay: float = 0.05
    """A cell's start payload leaves only if the cell still runs this many seconds after it began."""

    telemetry_log_spacing: float = 0.1
    """Least seconds between two rank publishes prompted by ``nbdist.log()`` (batches a fast loop)."""

    memory_limit: int | str | None = None
    """Per-rank memory budget (bytes, or "512MiB", "1GiB", "2GB"): what each rank may allocate
    after start-up (RLIMIT_DATA on CPU, a CUDA memory fraction on GPU; see nbdist.worker.memory_limit).
    None: no limit. Set by ``Cluster(memory_limit=...)`` and ``%dist_start --memory-limit``."""

    def __post_init__(self, direct_cells: bool | None) -> None:
        if direct_cells is not None:
            _direct_cells_deprecated(stacklevel=4)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "direct_cells":
            _direct_cells_deprecated(stacklevel=3)
            return
        super().__setattr__(name, value)

    def replace(self, **changes: object) -> NbdistConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _direct_cells_deprecated(stacklevel: int) -> None:
    warnings.warn("NbdistConfig.direct_cells is deprecated and ignored: every cell goes to every "
                  "rank over nbdist's cell channel", DeprecationWarning, stacklevel=stacklevel)


DEFAULT = NbdistConfig()
"""The config used when none is given; change its fields to change the defaults."""
