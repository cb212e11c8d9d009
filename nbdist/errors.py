"""Exceptions nbdist raises in the notebook: each says what happened and what to do next."""

from __future__ import annotations

from nbdist.text import strip_ansi


class NbdistWarning(UserWarning):
    """Warnings raised by nbdist itself (tests turn these into errors)."""


class NbdistError(RuntimeError):
    """Base class for nbdist's own errors (bad arguments, cluster state, start failures)."""


class ClusterNotRunningError(NbdistError):
    """A cell or command needs a running cluster and there is none."""


class ClusterStartError(NbdistError):
    """The controller or engines did not come up; the message carries their log tail."""


class DistributedCellError(NbdistError):
    """A distributed cell failed on one or more ranks.

    ``result`` is the full :class:`nbdist.cells.result.CellResult` (per-rank outputs, errors,
    report). ``str()`` is plain text, fit for a log; ``rendered`` (default: the message) is what
    a notebook shows, where the ranks' tracebacks keep IPython's colours.
    """

    def __init__(self, message: str, result: object, rendered: str | None = None) -> None:
        super().__init__(strip_ansi(message))
        self.result = result
        self.rendered = message if rendered is None else rendered

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of nbdist's own frames: the user's remote traceback matters.
        return self.rendered.splitlines()


class Interrupted(NbdistError, KeyboardInterrupt):
    """The stop button during a command (start, restart, push, pull): the message says what was
    stopped and what is left. Still a KeyboardInterrupt, for code that catches one."""
