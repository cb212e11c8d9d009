"""What torch's flight recorder says this rank's process groups did: the collectives each group
entered (Python's or C++'s: DDP's reducer, FSDP2), their sequence ids, sizes, and which one is
still in flight. It is torch's record, read back; nbdist adds no hook to any collective.

Reading it costs a pickle of the whole ring buffer, so while a cell runs it is read only when the
groups' progress has not moved since the last look (a rank that waits), never on every sample.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbdist import torch_support

BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch reads the first one set (the second is the older name) when a group first records."""


@dataclass(frozen=True)
class EnteredCollective:
    """One collective one rank entered, as its flight recorder holds it."""

    group: str
    """"default group", or "group 2 (ranks 0, 1)", or a DeviceMesh's own name for its group."""
    seq: int
    """The group's collective sequence id (the same on every member for the same call)."""
    op: str
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    completed: bool
    since: float
    """When the rank entered it (time.time())."""
    ranks: tuple[int, ...] = ()
    """Global ranks of the group; empty when unknown."""

    def title(self) -> str:
        """``all_reduce #9 of the default group``."""
        return f"{self.op} #{self.seq} of the {self.group}"

    def nbytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.sizes, self.dtypes, strict=False):
            count = 1
            for dim in shape:
                count *= int(dim)
            total += count * _DTYPE_BYTES.get(dtype, 4)
        return total

    def shapes(self) -> str:
        return ", ".join("[" + ", ".join(str(d) for d in shape) + "]" for shape in self.sizes)


_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
                "Short": 2, "Char": 1, "Byte": 1, "Bool": 1}


def buffer_environment(entries: int,
                       current: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The buffer size to set (unless the user set one: theirs wins, with a note)."""
    for name in BUFFER_VARIABLES:
        if name in current:
            note = [] if current[name].strip() == str(entries) else [
                f"{name}={current[name]} is yours and kept (nbdist would keep {entries} "
                "collectives: see docs/FAULTS.md)"]
            return {}, note
    return {BUFFER_VARIABLES[0]: str(entries)}, []


DUMP_FILE_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""Where the recorder's dump goes (NCCL's watchdog writes it on a timeout: docs/NCCL.md): the
value followed by the rank (torch reads the first one set; the second is the older name; its
default, /tmp/nccl_trace_rank_, would leave every rank's collectives readable by anyone)."""


def dump_environment(current: Mapping[str, str], rank: int,
                     private_dir: str | None) -> dict[str, str]:
    """The dump's prefix in a directory only this user reads, unless the user chose one: in the
    cluster's private directory for a rank on the notebook's machine (removed with it when the
    cluster stops), else a temporary directory of the rank's own, removed when its engine exits."""
    if any(name in current for name in DUMP_FILE_VARIABLES):
        return {}
    if private_dir:
        directory = os.path.join(private_dir, f"flight-recorder-rank{rank}")
        os.makedirs(directory, mode=0o700, exist_ok=True)
    else:
        directory = tempfile.mkdtemp(prefix="nbdist-flight-recorder-")  # 0700
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return {DUMP_FILE_VARIABLES[0]: os.path.join(directory, "nccl_trace_rank_")}


def available() -> bool:
    """torch records gloo's collectives too (2.8+) and the buffer is not turned off."""
    if not torch_support.has("flight-recorder"):
        return False
    for name in BUFFER_VARIABLES:
        if name in os.environ:
            return os.environ[name].strip() not in ("", "0")
    return True


def _dump(with_entries: bool) -> dict[str, Any]:
    from torch._C import _distributed_c10d as c10d

    raw = c10d._dump_fr_trace(includeCollectives=with_entries, includeStackTraces=False,
                              onlyActive=False)
    return pickle.loads(raw)


def progress() -> dict[str, tuple[int, int]]:
    """Group name -> (last collective entered, last completed): cheap, no entries."""
    status = _dump(False).get("pg_status") or {}
    return {str(name): (int(s.get("last_enqueued_collective", -1)),
                        int(s.get("last_completed_collective", -1)))
            for name, s in status.items()}


IN_FLIGHT_POLL = 0.005
"""Seconds between two looks at whether the collectives a rank left in flight have finished."""


def wait_for_in_flight(seconds: float) -> None:
    """Wait up to `seconds` while a group of this generation has a collective in flight (a torn
    down group keeps its last counts: it is not looked at). At a cell's end on gloo, a collective
    nothing waited for (a DTensor layer's, an ``async_op=True`` one) whose sizes differ across
    ranks ends one rank from gloo's own thread: it must do so in the cell that ran it, not
    between cells, where nothing reports it."""
    if seconds <= 0 or not available():
        return
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            current = _group_names()
            if not any(entered > completed for name, (entered, completed) in progress().items()
                       if name in current):
                return
            time.sleep(IN_FLIGHT_POLL)
    except KeyboardInterrupt:  # the stop button after the cell's code: the cell is over anyway
        return
    except Exception:  # a group torn down under the dump
        return


def entries() -> list[EnteredCollective]:
    """Every collective the buffer holds for the current generation's groups, oldest first."""
    from nbdist.worker.process_group import generation_started

    names = _group_names()
    since_ns = generation_started() * 1e9
    found = []
    for e in _dump(True).get("entries") or []:
        if e.get("is_p2p") or int(e.get("time_created_ns") or 0) < since_ns:
            continue
        name, desc = (tuple(e.get("process_group") or ("", "")) + ("", ""))[:2]
        label, ranks = names.get(str(name), (_label(str(name), str(desc), ()), ()))
        found.append(EnteredCollective(
            group=label, seq=int(e.get("collective_seq_id", 0)),
            op=str(e.get("profiling_name", "")).split(":")[-1],
            sizes=tuple(tuple(int(d) for d in s) for s in e.get("input_sizes") or ()),
            dtypes=tuple(str(d) for d in e.get("input_dtypes") or ()),
            completed=bool(e.get("retired")) or e.get("state") == "completed",
            since=int(e.get("time_created_ns") or 0) / 1e9, ranks=ranks,
        ))
    return found


def _group_names() -> dict[str, tuple[str, tuple[int, ...]]]:
    """torch's group name -> (how a person calls it, its global ranks)."""
    try:
        from torch.distributed import distributed_c10d
    except ImportError:
        return {}
    world = distributed_c10d._world
    default = world.default_pg
    found = {}
    for pg, name in list(world.pg_names.items()):
        ranks = tuple(sorted(world.pg_group_ranks.get(pg, {})))
        desc = "default_pg" if pg is default else str(getattr(pg, "group_desc", ""))
        found[str(name)] = (_label(str(name), desc, ranks), ranks)
    return found


def _label(name: str, desc: str, ranks: tuple[int, ...]) -> str:
    if desc == "default_pg":
        return "default group"
    listed = f" (ranks {', '.join(str(r) for r in ranks)})" if ranks else ""
    if desc and desc != "undefined":
        return f"group {desc}{listed}"
    return f"group {name}{listed}"


def latest(found: list[EnteredCollective]) -> list[EnteredCollective]:
    """Per group: the collective still in flight with the lowest sequence id, else the last one."""
    by_group: dict[str, EnteredCollective] = {}
    for entry in found:
        held = by_group.get(entry.group)
        if held is None or (held.completed and entry.seq > held.seq):
            by_group[entry.group] = entry
    return list(by_group.values())


class Watcher:
    """Reads the recorder for the telemetry thread: the entries only once the groups' progress
    has stayed put for one sample (a rank that waits, or one that stopped calling collectives);
    in between, the last reading."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_progress: dict[str, tuple[int, int]] | None = None
        self._read_at: dict[str, tuple[int, int]] | None = None
        self._latest: list[EnteredCollective] = []

    def forget(self) -> None:
        with self._lock:
            self._last_progress = None
            self._read_at = None
            self._latest = []

    def sample(self, fresh: bool = False) -> list[EnteredCollective] | None:
        """Per group the collective a rank is in or last entered (`fresh`: read now, whether
        or not the progress settled); None when unreadable."""
        if not available():
            return None
        try:
            now = progress()
            with self._lock:
                settled = now == self._last_progress
                self._last_progress = now
                if (settled or fresh) and now != self._read_at:
                    self._latest = latest(entries())
                    self._read_at = now
                return list(self._latest) if now == self._read_at else []
        except Exception:  # a torch without the dump, or a group torn down under it
            return None


WATCHER = Watcher()


def analyser_trace(stacks: bool = True) -> bytes:
    """The rank's whole trace in the format torch.distributed.flight_recorder's analyser reads
    (one file per rank); gloo leaves the groups' ranks out of it, so they are filled in here."""
    from torch._C import _distributed_c10d as c10d

    trace = pickle.loads(c10d._dump_fr_trace(includeCollectives=True,
                                             includeStackTraces=stacks, onlyActive=False))
    config = dict(trace.get("pg_config") or {})
    config.pop("", None)
    for name, (label, ranks) in _group_names().items():
        config.setdefault(name, {"name": name, "desc": label, "ranks": str(list(ranks))})
    trace["pg_config"] = config
    return pickle.dumps(trace)
