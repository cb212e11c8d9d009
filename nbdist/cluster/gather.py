"""Collect the results of calls sent to several engines under one shared deadline."""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from nbdist.errors import ClusterStartError
from nbdist.text import tail

K = TypeVar("K", bound=Hashable)


@dataclass
class Gathered(Generic[K]):
    """What came back: `results` by key, and a one-line reason for each key that failed."""

    results: dict[K, Any] = field(default_factory=dict)
    failures: dict[K, str] = field(default_factory=dict)


def gather(asyncs: Mapping[K, Any], timeout: float) -> Gathered[K]:
    """Every ipyparallel AsyncResult in `asyncs` under one deadline; never raises: an engine that
    raised or did not answer in time lands in `failures`."""
    deadline = time.monotonic() + timeout
    out: Gathered[K] = Gathered()
    for key, ar in asyncs.items():
        try:
            out.results[key] = ar.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # a RemoteError carries the engine-side traceback
            ready = ar.ready()
            out.failures[key] = short_error(exc) if ready else f"no answer within {timeout:g} s"
    return out


def collect(asyncs: Mapping[K, Any], timeout: float, what: str) -> dict[K, Any]:
    """Every result, or one ClusterStartError naming each engine that failed and why."""
    gathered = gather(asyncs, timeout)
    if gathered.failures:
        lines = [f"engine {key}: {why}" for key, why in gathered.failures.items()]
        raise ClusterStartError(f"{what} failed:\n" + "\n".join(lines))
    return gathered.results


def short_error(exc: BaseException) -> str:
    """`EName: value` and the last lines of the engine-side traceback, if any."""
    return rank_error(getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc)),
                      getattr(exc, "traceback", None))


def rank_error(ename: Any, evalue: Any, traceback: Any = None) -> str:
    """`EName: value` and the traceback's end, as a failure list shows it."""
    text = f"{ename}: {evalue}"
    return f"{text}\n{tail(str(traceback), 12)}" if traceback else text
