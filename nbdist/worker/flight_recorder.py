"""What torch's flight recorder says this rank's groups did: every collective entered (Python's or
C++'s: DDP's reducer, FSDP2), its sequence id, sizes, and whether it is still in flight."""

from __future__ import annotations

import math
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

from nbdist import torch_support
from nbdist.strategies._common import RANK_DEVICE_VAR
from nbdist.worker import process_group

IN_FLIGHT_POLL = 0.005  # seconds between two looks at the collectives a rank left in flight


@dataclass(frozen=True)
class EnteredCollective:
    """One collective one rank entered, as its flight recorder holds it."""

    group: str  # "default group", "group 2 (ranks 0, 1)", or a DeviceMesh's name for it
    seq: int  # the group's sequence id: the same on every member for the same call
    op: str
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    completed: bool
    since: float  # when the rank entered it (time.time())
    ranks: tuple[int, ...] = ()  # the group's global ranks; empty when unknown

    def title(self) -> str:
        return f"{self.op} #{self.seq} of the {self.group}"

    def nbytes(self) -> int:
        return sum(math.prod(shape) * _DTYPE_BYTES.get(dtype, 4)
                   for shape, dtype in zip(self.sizes, self.dtypes, strict=False))

    def shapes(self) -> str:
        return ", ".join(str(list(shape)) for shape in self.sizes)


_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
                "Short": 2, "Char": 1, "Byte": 1, "Bool": 1}


def available() -> bool:
    """torch's recorder can be read here and its buffer is not turned off."""
    size = next((os.environ[n] for n in process_group.BUFFER_VARIABLES if n in os.environ), "1")
    return torch_support.has("flight-recorder") and size.strip() not in ("", "0")


def _dump(with_entries: bool, stacks: bool = False) -> dict[str, Any]:
    """gloo's record (torch's generic recorder), and where this rank runs NCCL, NCCL's own (a
    recorder apart, of CUDA events: `_dump_nccl_trace`), its entries and groups keyed apart."""
    from torch._C import _distributed_c10d as c10d

    trace = pickle.loads(c10d._dump_fr_trace(includeCollectives=with_entries,
                                             includeStackTraces=stacks, onlyActive=False))
    nccl = _nccl_dump(with_entries, stacks)
    if nccl is not None:
        trace.setdefault("entries", []).extend(
            {**e, "backend": "nccl"} for e in nccl.get("entries", []))
        trace["pg_status"] = {**{f"{name}{GLOO_HALF}": status for name, status
                                 in trace.get("pg_status", {}).items()},
                              **nccl.get("pg_status", {})}
    return trace


GLOO_HALF = " (CPU tensors)"  # an NCCL rank's gloo-recorded collectives: a sequence of their own


def _nccl_dump(with_entries: bool, stacks: bool) -> dict[str, Any] | None:
    """NCCL's record, read under the rank's own device: its event queries from this thread
    must not make a CUDA context on another GPU."""
    from torch._C import _distributed_c10d as c10d

    device = os.environ.get(RANK_DEVICE_VAR, "")
    if not device.startswith("cuda") or not hasattr(c10d, "_dump_nccl_trace"):
        return None
    import torch

    with torch.cuda.device(torch.device(device)):
        return pickle.loads(c10d._dump_nccl_trace(includeCollectives=with_entries,
                                                  includeStackTraces=stacks, onlyActive=False))


def progress() -> dict[str, tuple[int, int]]:
    """Group name -> (last collective entered, last completed): cheap, no entries."""
    return {name: (s["last_enqueued_collective"], s["last_completed_collective"])
            for name, s in _dump(False)["pg_status"].items()}


def wait_for_in_flight(seconds: float) -> None:
    """Wait up to `seconds` while a group of this generation (a torn down one keeps its last
    counts) has a collective in flight. On gloo, a collective nothing waited for (a DTensor
    layer's, an ``async_op=True`` one) whose sizes differ across ranks ends one rank from gloo's
    thread: it must do so in the cell that ran it, not between cells, where nothing reports it."""
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
    except (KeyboardInterrupt, Exception):  # the stop button, or a group torn down under the dump
        return


def entries() -> list[EnteredCollective]:
    """Every collective the buffer holds for the current generation's groups, oldest first
    (point-to-point transfers left out: their sequence ids count per pair)."""
    names = _group_names()
    since_ns = process_group.GENERATION_STARTED * 1e9
    found = []
    trace = _dump(True)
    nccl = any(e.get("backend") == "nccl" for e in trace["entries"])
    for e in trace["entries"]:
        if e["is_p2p"] or e["time_created_ns"] < since_ns:
            continue
        name, desc = e["process_group"]
        label, ranks = names.get(name, (process_group.group_label(name, desc, ()), ()))
        half = GLOO_HALF if nccl and e.get("backend") != "nccl" else ""
        found.append(EnteredCollective(
            group=label + half, seq=e["collective_seq_id"], op=e["profiling_name"].split(":")[-1],
            sizes=tuple(map(tuple, e["input_sizes"])), dtypes=tuple(e["input_dtypes"]),
            completed=e["retired"] or e["state"] == "completed",
            since=e["time_created_ns"] / 1e9, ranks=ranks))
    return sorted(found, key=lambda entry: entry.since)  # two recorders' entries, merged


def _group_names() -> dict[str, tuple[str, tuple[int, ...]]]:
    """torch's group name -> (how a person calls it, its global ranks)."""
    return {name: (label, ranks) for _pg, name, label, ranks, _backend in process_group.groups()}


def latest(found: list[EnteredCollective]) -> list[EnteredCollective]:
    """Per group: the collective still in flight with the lowest sequence id, else the last one."""
    by_group: dict[str, EnteredCollective] = {}
    for entry in found:
        held = by_group.get(entry.group)
        if held is None or (held.completed and entry.seq > held.seq):
            by_group[entry.group] = entry
    return list(by_group.values())


class Watcher:
    """Reads the recorder for the telemetry thread. Reading pickles the whole ring buffer, so the
    entries are read only once the groups' progress stayed put for one sample (a rank that waits,
    or stopped calling collectives); in between, the last reading."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_progress: dict[str, tuple[int, int]] | None = None
        self._read_at: dict[str, tuple[int, int]] | None = None
        self._latest: list[EnteredCollective] = []

    def sample(self, fresh: bool = False) -> list[EnteredCollective] | None:
        """Per group the collective the rank is in or last entered (`fresh`: read now, settled or
        not); None when unreadable."""
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
        except Exception:  # a group torn down under the dump
            return None


WATCHER = Watcher()


def analyser_trace(stacks: bool = True) -> bytes:
    """The rank's whole trace in the format torch.distributed.flight_recorder's analyser reads
    (one file per rank; NCCL's record where the rank runs NCCL, which is what torch's own dump
    holds); gloo leaves the groups' ranks out of it, so they are filled in here."""
    from torch._C import _distributed_c10d as c10d

    torch_support.require("flight-recorder")
    trace = _nccl_dump(True, stacks) or pickle.loads(c10d._dump_fr_trace(
        includeCollectives=True, includeStackTraces=stacks, onlyActive=False))
    config = trace["pg_config"]
    config.pop("", None)
    for name, (label, ranks) in _group_names().items():
        config.setdefault(name, {"name": name, "desc": label, "ranks": str(list(ranks))})
    return pickle.dumps(trace)
