"""Name a rank that ran out of its `--memory-limit`: the report says which rank and which limit,
whether the allocation failed in Python (MemoryError, torch's "DefaultCPUAllocator: can't
allocate memory", CUDA's OutOfMemoryError) or killed the process (an uncaught std::bad_alloc)."""

from __future__ import annotations

import re
from collections.abc import Callable

from nbdist.cells.result import CellResult, RankError
from nbdist.text import format_bytes

_OOM_NAMES = {"MemoryError", "OutOfMemoryError"}
_OOM_TEXT = re.compile(
    r"can't allocate memory|cannot allocate memory|out of memory|std::bad_alloc|\bMemoryError\b"
    r"|thread creation failed",  # libgomp: a new thread's stack did not fit under RLIMIT_DATA
    re.IGNORECASE)


def is_out_of_memory(err: RankError, engine_log: str = "") -> bool:
    """A failed allocation: by the exception's name or message; for a dead rank, also by what
    its engine log says just before it died (`terminate ... std::bad_alloc`)."""
    if err.kind == "root":
        return err.ename in _OOM_NAMES or bool(_OOM_TEXT.search(f"{err.ename}: {err.evalue}"))
    if err.kind == "dead":
        return bool(_OOM_TEXT.search(f"{err.traceback}\n{engine_log}"))
    return False


def name_out_of_memory(result: CellResult, memory_limit: int | None,
                       engine_log: Callable[[int], str]) -> list[int]:
    """Mark every root-cause error that is an allocation failure under a memory limit with
    that limit (its headline then reads "rank N ran out of memory: it is limited to ...");
    returns those ranks. `engine_log(rank)`: the end of that rank's engine log (asked for dead
    ranks only)."""
    if memory_limit is None:
        return []
    named = []
    for rank, err in sorted(result.errors.items()):
        log = _safe_log(engine_log, rank) if err.kind == "dead" else ""
        if is_out_of_memory(err, log):
            err.out_of_memory = describe_memory_limit(memory_limit)
            line = _allocation_line(log)
            if line and line not in err.traceback:
                err.traceback = f"its engine log says: {line}\n{err.traceback}".rstrip()
            named.append(rank)
    return named


def _safe_log(engine_log: Callable[[int], str], rank: int) -> str:
    try:
        return engine_log(rank)
    except Exception:  # no log (a remote engine): the traceback alone decides
        return ""


def _allocation_line(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if _OOM_TEXT.search(ln)]
    return lines[-1] if lines else ""


def describe_memory_limit(size: int) -> str:
    """How a report names the limit: ``1.00 GiB by --memory-limit``."""
    return f"{format_bytes(size)} by --memory-limit (Cluster(memory_limit=...))"
