"""Every timeout and knob nbdist uses: one frozen dataclass per concern (start, faults, telemetry,
output, batch), gathered in `NbdistConfig`, each field checked when the section is made.

``NbdistConfig(faults=FaultConfig(cell_timeout=60))`` and the flat spelling
``NbdistConfig(cell_timeout=60)`` make the same config; ``config.cell_timeout`` reads and
``nbdist.config.DEFAULT.cell_timeout = 60`` sets a field by its flat name too (docs/api/config.md).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from nbdist.errors import NbdistError
from nbdist.text import format_bytes, parse_bytes


@dataclass(frozen=True)
class StartConfig:
    """How ranks start, restart and stop."""

    engine_start_timeout: float = 90.0
    """Seconds to wait for every engine to register with the controller."""

    bootstrap_timeout: float = 120.0
    """Seconds for the rank bootstrap (torch import, device pinning, first all_reduce)."""

    rebuild_timeout: float = 30.0
    """Seconds for rebuilding the process group (new generation, fresh store) after a fault."""

    stop_timeout: float = 5.0
    """Seconds %dist_stop waits for processes to exit before it kills them by PID."""

    fork_server: bool = True
    """Local engines are forked from one warm process that imported torch once (fast start and
    restart); False starts each engine as a fresh interpreter, as ipyparallel does."""

    memory_limit: int | str | None = None
    """Per-rank memory budget (bytes, or "512MiB", "1GiB", "2GB"; kept as bytes): what each rank
    may allocate after start-up (RLIMIT_DATA on CPU, a CUDA memory fraction on GPU). None: no
    limit. Set by ``Cluster(memory_limit=...)`` and ``%dist_start --memory-limit``."""

    share_gpu: bool | None = None
    """Ranks that outnumber a host's GPUs share them round-robin, NCCL between them, instead of
    running on the CPU (gloo): for learning and testing, not speed (docs/NCCL.md). None: the
    notebook's ``NBDIST_SHARE_GPU`` (1 or 0). ``Cluster(share_gpu=)``, ``--share-gpu``."""

    def __post_init__(self) -> None:
        _check_fields(self)
        object.__setattr__(self, "memory_limit", memory_limit_bytes(self.memory_limit))


@dataclass(frozen=True)
class FaultConfig:
    """Deadlines, and what nbdist waits for after an error, a deadline or the stop button."""

    cell_timeout: float | None = None
    """Default deadline for a %%distributed cell in seconds (None: no deadline)."""

    process_group_timeout: float = 60.0
    """torch.distributed timeout for collectives on gloo (gloo's own default is 30 minutes)."""

    nccl_process_group_timeout: float = 1800.0
    """The same on NCCL, where a timed-out collective aborts the group's communicators: long
    enough for a pdb session, a checkpoint rank 0 writes alone or a DeepSpeed op build on one
    rank (docs/NCCL.md)."""

    fault_settle: float = 1.0
    """After the first rank fails, seconds to let the others report before the cell ends."""

    interrupt_grace: float = 2.0
    """After SIGINT, seconds for ranks running Python to stop before the ladder's next step."""

    collective_grace: float = 0.5
    """After SIGINT, seconds before a rank its telemetry shows blocked inside a collective is
    made to fail there (it cannot see SIGINT until the collective returns)."""

    teardown_grace: float = 3.0
    """After tearing down process groups, seconds before an engine still busy is killed; also
    the longest an abort of a rank's NCCL communicators may take."""

    device_wait_grace: float = 30.0
    """After SIGINT, seconds the ladder waits for NCCL ranks that wait on their GPU (a sync behind
    queued kernels; no collective missing a peer) before it aborts their group or kills them."""

    kill_confirm_wait: float = 3.0
    """After the ladder's SIGKILL, seconds to wait for the engine's exit before marking it dead."""

    where_answer_timeout: float = 1.0
    """At a deadline or the stop button, seconds to wait for the running ranks to say where they
    are now (they answer from a thread of their own, even from inside a collective)."""

    cell_report_timeout: float = 5.0
    """Seconds to wait for ranks' post-cell reports (collectives entered, failed collective)."""

    flight_recorder_entries: int = 256
    """Collectives each rank's flight recorder keeps (``TORCH_FR_BUFFER_SIZE``): the hang report
    reads the last ones of each group. 0 turns it off."""

    check_collectives: bool = False
    """Run every rank with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch compares each collective's
    operation and shapes across ranks before running it, so a mismatch raises on every rank
    instead of aborting one (docs/FAULTS.md says what it costs)."""

    cell_end_collective_wait: float = 1.0
    """At a cell's end, seconds a gloo rank waits for collectives it left in flight (a DTensor
    layer's, ``async_op=True``), so that one which fails does so in the cell that ran it."""

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class TelemetryConfig:
    """What ranks report while they run (memory, metrics, where they are)."""

    telemetry_interval: float = 0.5
    """Seconds between rank-side samples (memory, metrics, where the rank is)."""

    collective_report_interval: float = 0.1
    """While a rank waits inside a collective, seconds between reports of where it is: a peer
    that fails meanwhile is known to block it within this, and only then is the group torn down."""

    stale_after: float = 5.0
    """A running rank that has sent no telemetry for this long is shown as stale."""

    def __post_init__(self) -> None:
        _check_fields(self)


OUTPUT_MODES = ("merged", "ranks", "raw")
"""What ``%%distributed --output`` and `NbdistConfig.output_mode` accept."""


@dataclass(frozen=True)
class OutputConfig:
    """How a cell shows each rank's output (docs/OUTPUT.md)."""

    output_mode: str = "merged"
    """How a cell's output reads (``%%distributed --output``): "merged" (a line several ranks
    print alike shown once, ``[ranks 0-7] ...``; a per-rank view from `rank_view_ranks` ranks on),
    "ranks" (each rank's output in one block, in the per-rank view while the cell runs) or "raw"
    (every line as it comes, labelled with its rank)."""

    output_interval: float = 0.3
    """Seconds a line may wait for the same line from other ranks before it is shown (merged
    output); a line every rank printed is shown as soon as the last one's arrives. Above the
    0.2 s a rank's kernel gathers its output for: two ranks printing alike at once may send it
    up to that far apart."""

    output_hold_max: float = 2.0
    """Seconds a line may wait, at most, for ranks that printed the lines before it alike and have
    not printed it yet (merged output): on a busy machine such a rank's copy comes seconds late,
    and it is worth the wait; a line whose other ranks print something else waits
    `output_interval` only."""

    rank_view_ranks: int = 5
    """From this many ranks on, a cell shows the per-rank view (state and last line of each
    rank, a filter to read one rank or a group) and one progress bar per loop, not per rank."""

    max_output_lines: int = 1_000
    """Per rank and stream: lines shown under the cell; past them the rest goes only to the
    rank's log (``Cluster.output(rank)``) and the stream's end is shown when the cell ends."""

    max_output_chars: int = 200_000
    """The same limit in characters (one long line can be a flood too)."""

    output_tail_chars: int = 2_000
    """The end of a truncated stream, shown when the cell ends (whole lines)."""

    def __post_init__(self) -> None:
        if self.output_mode not in OUTPUT_MODES:
            raise NbdistError(f"NbdistConfig.output_mode {self.output_mode!r}: one of "
                              f"{', '.join(OUTPUT_MODES)}")
        _check_fields(self)
        if self.output_hold_max < self.output_interval:
            raise NbdistError(f"NbdistConfig.output_hold_max={self.output_hold_max}: at least "
                              f"output_interval ({self.output_interval})")
        if self.output_tail_chars > self.max_output_chars:
            raise NbdistError(f"NbdistConfig.output_tail_chars={self.output_tail_chars}: at most "
                              f"max_output_chars ({self.max_output_chars})")


@dataclass(frozen=True)
class BatchConfig:
    """Engines a batch system (Slurm) runs."""

    batch_queue_timeout: float = 0.0
    """Seconds a batch job may wait in the queue before start gives up and cancels it; 0: wait
    as long as it is queued (progress shows its state; interrupt to cancel)."""

    batch_query_interval: float = 1.0
    """Least seconds between two questions to the batch system about the engines' job (squeue
    asks slurmctld, which a tight poll loop would load)."""

    batch_command_timeout: float = 30.0
    """Seconds a batch-system command (squeue, scancel, sbatch --test-only) may take."""

    batch_end_settle: float = 3.0
    """Seconds to wait for why an ending job ends when Slurm does not say yet (COMPLETING with no
    reason and no signal: the moment before scancel's signal lands, or a job that completed)."""

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class InternalConfig:
    """Not public: how often nbdist looks again, and waits only tests shorten. These may change
    without notice; their flat names still work, with a DeprecationWarning."""

    poll_interval: float = 0.02
    """How often the notebook side checks for output, results and dead ranks while a cell runs."""

    dead_check_interval: float = 0.1
    """While a cell runs, seconds between checks for dead engine processes (each reads /proc)."""

    startup_poll_interval: float = 0.02
    """How often start-up waits (connection file, engine registration) look again."""

    exit_status_timeout: float = 1.0
    """Seconds poll_dead waits for a reaped engine's exit status before calling it unknown."""

    exit_status_poll_interval: float = 0.01
    """How often poll_dead looks again for that exit status."""

    orphan_kill_grace: float = 2.0
    """Once the notebook kernel is gone: seconds a rank on another machine waits for its cell
    channel to come back before it ends itself, and seconds its children get after SIGTERM."""

    telemetry_start_delay: float = 0.05
    """A cell's start payload leaves only if the cell still runs this long after it began."""

    telemetry_log_spacing: float = 0.1
    """Least seconds between two rank publishes prompted by ``nbdist.log()``."""

    def __post_init__(self) -> None:
        _check_fields(self)


_SECTIONS: dict[str, type] = {
    "start": StartConfig, "faults": FaultConfig, "telemetry": TelemetryConfig,
    "output": OutputConfig, "batch": BatchConfig, "internal": InternalConfig,
}
_SECTION_OF = {f.name: section for section, cls in _SECTIONS.items()
               for f in dataclasses.fields(cls)}
"""A field's flat name -> its section (every field name is unique across sections)."""


@dataclass(init=False)
class NbdistConfig:
    """nbdist's config: ``NbdistConfig(start=StartConfig(...), faults=FaultConfig(...))``, or
    the same fields by their flat names, ``NbdistConfig(stop_timeout=3.0, cell_timeout=60)``."""

    start: StartConfig = field(default_factory=StartConfig)
    """How ranks start, restart and stop."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Deadlines, and what nbdist waits for after an error, a deadline or the stop button."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """What ranks report while they run."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """How much of each rank's output a cell shows."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Engines a batch system (Slurm) runs."""
    internal: InternalConfig = field(default_factory=InternalConfig)
    """Not public: poll intervals and waits only tests shorten."""

    def __init__(self, start: StartConfig | None = None, faults: FaultConfig | None = None,
                 telemetry: TelemetryConfig | None = None, output: OutputConfig | None = None,
                 batch: BatchConfig | None = None, internal: InternalConfig | None = None,
                 **fields: Any) -> None:
        given = dict(start=start, faults=faults, telemetry=telemetry, output=output,
                     batch=batch, internal=internal)
        if fields.pop("direct_cells", None) is not None:
            _direct_cells_deprecated(stacklevel=3)
        unknown = sorted(set(fields) - set(_SECTION_OF))
        if unknown:
            raise TypeError(f"NbdistConfig has no field(s) {', '.join(unknown)}")
        for name, cls in _SECTIONS.items():
            section = given[name] if given[name] is not None else cls()
            changes = {key: value for key, value in fields.items() if _SECTION_OF[key] == name}
            _warn_if_internal(changes, stacklevel=2)
            object.__setattr__(self, name, _checked_section(name, section, changes))

    def __getattr__(self, name: str) -> Any:
        """A field by its flat name (``config.cell_timeout`` is ``config.faults.cell_timeout``)."""
        section = _SECTION_OF.get(name)
        if section is None:
            raise AttributeError(f"NbdistConfig has no field {name!r}")
        _warn_if_internal({name: None}, stacklevel=2)
        return getattr(object.__getattribute__(self, section), name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A section, or a field by its flat name (the section is replaced, checked again)."""
        if name == "direct_cells":
            _direct_cells_deprecated(stacklevel=3)
            return
        section = _SECTION_OF.get(name)
        if section is not None:
            _warn_if_internal({name: value}, stacklevel=2)
            name, value = section, _checked_section(section, getattr(self, section), {name: value})
        elif name in _SECTIONS:
            value = _checked_section(name, value, {})
        else:
            raise AttributeError(f"NbdistConfig has no field {name!r}")
        object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> NbdistConfig:
        """A copy with these sections or fields (flat names) changed."""
        return dataclasses.replace(self, **changes)


def _direct_cells_deprecated(stacklevel: int) -> None:
    warnings.warn("NbdistConfig.direct_cells is deprecated and ignored: every cell goes to every "
                  "rank over nbdist's cell channel", DeprecationWarning, stacklevel=stacklevel)


def _checked_section(name: str, section: Any, changes: dict[str, Any]) -> Any:
    if not isinstance(section, _SECTIONS[name]):
        raise NbdistError(f"NbdistConfig {name}={section!r}: give an "
                          f"nbdist.config.{_SECTIONS[name].__name__}")
    return dataclasses.replace(section, **changes) if changes else section


def _warn_if_internal(fields: dict[str, Any], stacklevel: int) -> None:
    internal = sorted(name for name in fields if _SECTION_OF[name] == "internal")
    if internal:
        warnings.warn(f"NbdistConfig.{internal[0]} is internal now (NbdistConfig.internal."
                      f"{internal[0]}) and may change without notice", DeprecationWarning,
                      stacklevel=stacklevel + 1)


_MAY_BE_ZERO = {"batch_queue_timeout"}
"""Timeouts whose 0 means "no limit"; every other `*_timeout` and `*_interval` must be above 0."""


def _check_fields(section: Any) -> None:
    """Each field's value fits its type: bools are bools, counts whole and not negative, seconds
    finite and not negative (above 0 for timeouts and intervals), None only where allowed."""
    for f in dataclasses.fields(section):
        value, kind, name = getattr(section, f.name), str(f.type), f"NbdistConfig.{f.name}"
        if f.name == "memory_limit" or value is None and "None" in kind or kind == "str":
            continue  # (a str field is checked by its section)
        if kind.startswith("bool") and not isinstance(value, bool):
            raise NbdistError(f"{name} {value!r}: must be True or False")
        if kind == "int":
            check_whole(value, name, minimum=0)
        elif not kind.startswith("bool"):
            zero = not f.name.endswith(("_timeout", "_interval")) or f.name in _MAY_BE_ZERO
            check_seconds(value, name, zero=zero)


def check_whole(value: Any, name: str, minimum: int) -> int:
    """A whole number, `minimum` or more (a bool is not one), else an NbdistError naming `name`:
    every count nbdist takes (ranks, threads, GPUs per rank, config counts) is checked here."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise NbdistError(f"{name} {value!r}: must be a whole number, {minimum} or more")
    return value


def check_seconds(value: Any, name: str, zero: bool = False) -> float:
    """A finite number of seconds above 0 (or 0 where `zero`), else an NbdistError naming
    `name`: every timeout nbdist takes (config fields, --timeout) is checked here."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NbdistError(f"{name} {value!r}: must be a number of seconds")
    if not math.isfinite(value) or value < 0 or value == 0 and not zero:
        raise NbdistError(f"{name} {value!r}: must be a finite number of seconds, "
                          f"{'0 or more' if zero else 'more than 0'}")
    return float(value)


MIN_MEMORY_LIMIT = 64 * 2**20
"""Below this a rank has no room for its own bookkeeping (telemetry, messages, a thread's stack)."""

_EXAMPLES = "e.g. 512MiB, 1GiB, 2GB or a number of bytes"


def memory_limit_bytes(value: Any) -> int | None:
    """None, whole bytes, or a size with a unit (KiB/MiB/GiB/TiB = 1024ⁿ, kB/MB/GB/TB = 1000ⁿ)
    as bytes; anything else (a bad unit, 0, a negative, a bool) is an NbdistError that says why."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise NbdistError(f"--memory-limit {value!r}: give a size ({_EXAMPLES})")
    size = value if isinstance(value, int) else parse_bytes(value)
    if size is None:
        raise NbdistError(f"--memory-limit {value!r}: not a size ({_EXAMPLES})")
    if size < MIN_MEMORY_LIMIT:
        raise NbdistError(f"--memory-limit {value!r}: at least {format_bytes(MIN_MEMORY_LIMIT)} "
                          "(a rank needs room for its own telemetry and messages)")
    return size


DEFAULT = NbdistConfig()
"""The config used when none is given; change its fields to change the defaults."""
