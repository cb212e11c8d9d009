"""Every timeout and knob nbdist uses, in one dataclass with documented defaults.

Tests build a config with short values; users change one field with ``Cluster(config=...)`` or
``nbdist.config.DEFAULT.<field> = ...`` before ``%dist_start``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class NbdistConfig:
    engine_start_timeout: float = 90.0
    """Seconds to wait for every engine to register with the controller."""

    bootstrap_timeout: float = 120.0
    """Seconds for the rank bootstrap (torch import, device pinning, first all_reduce)."""

    process_group_timeout: float = 60.0
    """torch.distributed timeout for collectives (gloo's own default is 30 minutes)."""

    cell_timeout: float | None = None
    """Default deadline for a %%distributed cell in seconds (None: no deadline)."""

    poll_interval: float = 0.02
    """How often the notebook side checks for output, results and dead ranks while a cell runs."""

    telemetry_interval: float = 0.5
    """Seconds between rank-side samples (memory, metrics, where the rank is)."""

    stale_after: float = 5.0
    """A running rank that has sent no telemetry for this long is shown as stale."""

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

    rebuild_timeout: float = 30.0
    """Seconds for rebuilding the process group (new generation, fresh store) after a fault."""

    stop_timeout: float = 5.0
    """Seconds %dist_stop waits for processes to exit before it kills them by PID."""

    max_output_chars: int = 200_000
    """Per rank and stream: output kept beyond this is truncated (with a note)."""

    watchdog_interval: float = 0.5
    """How often the orphan watchdog checks that the notebook kernel is still alive."""

    def replace(self, **changes: object) -> NbdistConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


DEFAULT = NbdistConfig()
"""The config used when none is given; change its fields to change the defaults."""
