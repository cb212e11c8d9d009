"""What the fault handling may see and do of a cell while it runs (`RunningCell`), so that the
policy, the ladder and the hang report need the runner's state, not the runner module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from nbdist.cells.output import OutputSink
from nbdist.cells.result import CellResult
from nbdist.config import NbdistConfig

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore


class RunningCell(Protocol):
    """The part of `nbdist.cells.runner.CellRun` that fault handling uses."""

    cluster: ClusterCore
    config: NbdistConfig
    sink: OutputSink
    targets: list[int]
    timeout: float | None
    result: CellResult
    pending: set[int]
    """Ranks still running the cell; a rank leaves it when it finishes or is found dead."""
    asyncs: dict[int, Any]
    metadata: dict[int, dict[str, Any]]

    def pump(self, wait: float) -> None:
        """Handle output, results and telemetry for up to `wait` seconds."""
        ...

    def pump_until(self, seconds: float, ranks: set[int] | None = None) -> bool:
        """Handle output and results until `ranks` are done or `seconds` pass; True if done."""
        ...


def finished_with_error(run: RunningCell, rank: int) -> bool:
    """The rank's cell already ended with an exception (it is idle now)."""
    md = run.metadata.get(rank) or {}
    if md.get("error") is not None:
        return True
    ar = run.asyncs.get(rank)
    if ar is None or not ar.done():
        return False
    try:
        return ar.exception(timeout=0) is not None
    except Exception:
        return False
