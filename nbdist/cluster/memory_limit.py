"""`--memory-limit` / `Cluster(memory_limit=...)`: the per-rank memory budget as a byte count,
checked before anything starts. The rank applies it (`nbdist.worker.memory_limit`)."""

from __future__ import annotations

import re
from typing import Any

from nbdist.config import DEFAULT, NbdistConfig
from nbdist.errors import NbdistError
from nbdist.text import format_bytes

MIN_MEMORY_LIMIT = 64 * 2**20
"""Below this a rank has no room for its own bookkeeping (telemetry, messages, a new thread's stack)."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_EXAMPLES = "e.g. 512MiB, 1GiB, 2GB or a number of bytes"


def memory_limit_bytes(value: Any) -> int | None:
    """None, whole bytes, or a size with a unit (KiB/MiB/GiB/TiB = 1024ⁿ, kB/MB/GB/TB = 1000ⁿ)
    as bytes; anything else (a bad unit, 0, a negative, a bool) is an NbdistError that says why."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise NbdistError(f"--memory-limit {value!r}: give a size ({_EXAMPLES})")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise NbdistError(f"--memory-limit {value!r}: not a size ({_EXAMPLES})")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < MIN_MEMORY_LIMIT:
        raise NbdistError(f"--memory-limit {value!r}: at least {format_bytes(MIN_MEMORY_LIMIT)} "
                          "(a rank needs room for its own telemetry and messages)")
    return size


def with_memory_limit(config: Any, memory_limit: Any) -> Any:
    """`config` (or the default) with the checked limit in it; a config that is not an
    NbdistConfig is returned as it is, for the cluster's own argument check to name."""
    size = memory_limit_bytes(memory_limit)
    if config is not None and not isinstance(config, NbdistConfig):
        return config
    return (config or DEFAULT).replace(memory_limit=size)


def describe_memory_limit(size: int) -> str:
    """How a report names the limit: ``1.00 GiB by --memory-limit``."""
    return f"{format_bytes(size)} by --memory-limit (Cluster(memory_limit=...))"
