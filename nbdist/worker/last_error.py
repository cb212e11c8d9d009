"""The rank's last cell error, for `%dist_debug`: IPython's `sys.last_exc`, or the copy nbdist's
process-group teardown kept when it cleared that to release a peer from a collective."""

from __future__ import annotations

import sys

_KEPT: BaseException | None = None


def keep(exc: BaseException | None) -> None:
    """Hold on to the rank's last cell error when the teardown clears `sys.last_exc`."""
    global _KEPT
    if exc is not None:
        _KEPT = exc


def last_exception() -> BaseException | None:
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None) or _KEPT
