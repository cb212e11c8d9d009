"""What the fault handling may see and do of a cell while it runs (`RunningCell`), so that the
policy, the ladder and the hang report need the runner's state, not the runner module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from nbdist.cells.output import OutputSink
from nbdist.cells.rank_output import RankOutput
from nbdist.cells.result import CellResult
from nbdist.config import NbdistConfig

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore


class RunningCell(Protocol):
    """The part of `nbdist.cells.execute.CellRun` that fault handling uses."""

    cluster: ClusterCore
    config: NbdistConfig
    sink: OutputSink
    targets: list[int]
    timeout: float | None
    result: CellResult
    pending: set[int]
    """Ranks still running the cell; a rank leaves it when it finishes or is found dead."""
    outputs: dict[int, RankOutput]

    def pump(self, wait: float) -> None:
        """Handle output, results and telemetry for up to `wait` seconds."""
        ...

    def pump_until(self, seconds: float, ranks: set[int] | None = None) -> bool:
        """Handle output and results until `ranks` are done or `seconds` pass; True if done."""
        ...


def finished_with_error(run: RunningCell, rank: int) -> bool:
    """The rank's cell already ended with an exception (it is idle now)."""
    out = run.outputs.get(rank)
    return out is not None and out.error is not None
