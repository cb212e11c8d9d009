"""Feature slices: each package holds one feature's notebook half and rank half, plugged into the
core through rank commands (`nbdist.worker.rank_service`) and one registration line each."""

from collections.abc import Callable
from typing import Any


def register_feature_magics(ipython: Any, current: Callable[[], Any]) -> None:
    """Every feature's magics; `current()` is the running cluster (None before %dist_start)."""
    from nbdist.features import env

    env.register_magic(ipython, current)
