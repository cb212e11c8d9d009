"""What torch's flight recorder cannot say about a rank's collectives: whether its main thread
waits in one now, where in the cell it called it, the group it broke. The wrapper around the public
collectives also times each call (straggler view) and names it in a running profile."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from nbdist.worker import device_waits, flight_recorder, process_group
from nbdist.worker.metrics import TIMING

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv",
)

HISTORY = 64  # collectives a rank keeps for %dist_status --collectives without a flight recorder

PROFILE_PREFIX = "nbdist.collective:"  # a profiled call's range: "<prefix><name>|<group name>"

_TORCH_DIR = ""


def is_cell_file(filename: str) -> bool:
    """True for the pseudo-files IPython compiles notebook cells into."""
    return filename.startswith("<ipython-input") or (
        "ipykernel_" in filename and filename.endswith(".py"))


def describe_location(filename: str, lineno: int) -> str:
    return (f"cell line {lineno}" if is_cell_file(filename)
            else f"{os.path.basename(filename)}:{lineno}")


def user_location(frame: Any) -> str:
    """The innermost frame outside torch and nbdist (the user's code), described briefly."""
    for outer, lineno in traceback.walk_stack(frame):
        filename = outer.f_code.co_filename
        if (not filename.startswith((_TORCH_DIR, "<frozen"))
                and f"{os.sep}nbdist{os.sep}" not in filename):
            return describe_location(filename, lineno)
    return describe_location(frame.f_code.co_filename, frame.f_lineno)


@dataclass
class CollectiveCall:
    name: str
    location: str  # the user-level frame of the call ("cell line 3")
    since: float


def _position(fn: Any, name: str) -> int | None:
    try:
        return list(inspect.signature(fn).parameters).index(name)
    except (TypeError, ValueError):  # no signature, or no such parameter
        return None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int | None) -> Any:
    return kwargs.get(name, args[at] if at is not None and at < len(args) else None)


class CollectiveTracker:
    """The collective the main thread is in, where the cell called it, and how many it entered
    this cell (the hang report's fallback without a flight recorder)."""

    def __init__(self) -> None:
        self.main_thread_id = threading.main_thread().ident
        self.profiling = False  # a profile runs: each call is a named range in it
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        # "p2p 0->1": tensors sent from global rank 0 to 1 (counted by both ends) in this
        # generation; NCCL's sequence numbers count no point-to-point transfer
        self.p2p: dict[str, int] = {}
        self._sequence: dict[str, int] = {}
        self._generation = 0.0
        self.reset_cell()

    def reset_cell(self) -> None:
        self.current: CollectiveCall | None = None
        self.count = 0
        self.failed_in: CollectiveCall | None = None
        # a collective of this cell left the group unusable (a peer went away, or it was
        # interrupted midway); one that merely rejected its arguments breaks nothing
        self.group_broken = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        group_at, async_at = _position(fn, "group"), _position(fn, "async_op")
        peer = {"send": "dst", "recv": "src"}.get(name)
        peer_at = _position(fn, peer) if peer else None

        @functools.wraps(fn)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.main_thread_id or self.current is not None:
                return fn(*args, **kwargs)  # nested (all_gather_object -> all_gather) or a thread
            group = _argument(args, kwargs, "group", group_at)
            self.count += 1
            self.current = call = CollectiveCall(name, user_location(sys._getframe(1)), time.time())
            entry = self._remember(name, group, args, call.since)
            if peer:
                self._count_p2p(name, group, _argument(args, kwargs, peer, peer_at),
                                kwargs.get(f"group_{peer}"))
            ticket = TIMING.before(name, group, _argument(args, kwargs, "async_op", async_at))
            on_device = device_waits.start(_tensors(args)) if ticket is not None else None
            try:
                with _profile_range(name, group) if self.profiling else contextlib.nullcontext():
                    result = fn(*args, **kwargs)
                entry["completed"] = True
                if on_device is not None:  # NCCL returned at once: its wait is on the GPU
                    device_waits.finish(ticket, name, on_device)
                elif ticket is not None:
                    TIMING.after(ticket, name)
                return result
            except BaseException as exc:
                self.failed_in = call
                if isinstance(exc, KeyboardInterrupt):
                    self.group_broken = True  # peers may have completed what this rank left
                elif is_transport_failure(exc):
                    self.group_broken = True
                    _release_broken_group(exc)
                raise
            finally:
                self.current = None

        tracked.__nbdist_original__ = fn  # type: ignore[attr-defined]
        return tracked

    def _remember(self, name: str, group: Any, args: tuple[Any, ...],
                  since: float) -> dict[str, Any]:
        """Note the call as the flight recorder would (group, sequence id, input sizes), for
        `entries` where torch's recorder cannot be read."""
        import torch.distributed as dist

        if self._generation != process_group.GENERATION_STARTED:  # a new group counts from 1
            self._generation = process_group.GENERATION_STARTED
            self.history.clear()
            self._sequence.clear()
            self.p2p.clear()
        label = "default group"
        with contextlib.suppress(Exception):  # a group being torn down: the default label
            if group is not None and group is not dist.group.WORLD:
                label = f"group (ranks {', '.join(map(str, dist.get_process_group_ranks(group)))})"
        seq = self._sequence[label] = self._sequence.get(label, 0) + 1
        tensors = _tensors(args)
        entry = {"group": label, "seq": seq, "op": name, "since": since, "completed": False,
                 "sizes": tuple(tuple(t.shape) for t in tensors),
                 # the recorder's (c10's) dtype names: "torch.FloatTensor" -> "Float"
                 "dtypes": tuple(t.type().rsplit(".", 1)[-1].removesuffix("Tensor")
                                 for t in tensors)}
        self.history.append(entry)
        return entry

    def _count_p2p(self, name: str, group: Any, peer: int | None, group_peer: int | None) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):  # an invalid peer: torch's own call raises for it
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(group, group_peer)
            me = dist.get_rank()
            source = me if name == "send" else ("*" if peer is None else peer)
            key = f"p2p {source}->{peer if name == 'send' else me}"
            self.p2p[key] = self.p2p.get(key, 0) + 1

    def entries(self) -> list[flight_recorder.EnteredCollective]:
        """The collectives this rank's main thread called in the current group, oldest first."""
        return [flight_recorder.EnteredCollective(**e) for e in self.history]

    def blocked_since(self) -> float | None:
        """When the main thread entered the collective it is in now (time.time()), or None."""
        current = self.current
        return None if current is None else current.since

    def snapshot(self) -> dict[str, Any]:
        """Where the main thread is now: collective in flight, count, and its user-level stack."""
        current = self.current
        return {
            "collective": None if current is None else asdict(current),
            "collectives_entered": self.count,
            "stack": main_thread_stack(self.main_thread_id),
        }

    def cell_failed(self, exc: BaseException | None) -> None:
        """A collective torch ran by itself (DDP's all-reduce in backward, FSDP's gathers) failed
        the cell: record where, as the wrapper does, and release the broken group."""
        if self.failed_in is not None or not is_transport_failure(exc):
            return
        cell_line, in_backward = "?", False
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            code = frame.f_code
            if is_cell_file(code.co_filename):
                cell_line = describe_location(code.co_filename, lineno)
            in_backward = in_backward or code.co_name in ("backward", "_engine_run_backward")
        try:  # the collective torch's flight recorder saw this rank enter last
            found = flight_recorder.entries() if flight_recorder.available() else []
        except Exception:  # the group is half torn down: the guess below stands
            found = []
        recorded = max(found, key=lambda entry: entry.since).title() if found else ""
        if recorded:
            name = f"{recorded} (gradients in backward())" if in_backward else recorded
        else:
            name = ("gradient all-reduce in backward()" if in_backward
                    else "a collective inside torch")
        self.failed_in = CollectiveCall(name, cell_line, time.time())
        self.group_broken = True
        _release_broken_group(exc)


def _tensors(args: tuple[Any, ...]) -> list[Any]:
    """A collective's tensors: its tensor arguments, else those of its list arguments."""
    import torch

    return [a for a in args if isinstance(a, torch.Tensor)] or [
        t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]


def _profile_range(name: str, group: Any) -> Any:
    import torch
    import torch.distributed as dist

    group_name = getattr(dist.group.WORLD if group is None else group, "group_name", "")
    return torch.profiler.record_function(f"{PROFILE_PREFIX}{name}|{group_name or '?'}")


def _release_broken_group(exc: BaseException) -> None:
    """Close a broken group now so peers blocked on this rank fail at once too. torch's frames in
    the traceback hold the Work (and the group's sockets) alive: their locals are cleared first."""
    for frame, _lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename.startswith(_TORCH_DIR):
            with contextlib.suppress(RuntimeError):  # a frame still executing keeps its locals
                frame.clear()
    process_group.teardown()


_TRANSPORT_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "NCCL communicator was aborted", "Socket Timeout")


def is_transport_failure(exc: BaseException | None) -> bool:
    """A process-group operation failed because a peer went away (not the user's own error)."""
    from torch.distributed import DistBackendError

    return isinstance(exc, DistBackendError) or isinstance(exc, RuntimeError) and any(
        mark in str(exc) for mark in _TRANSPORT_MARKS)


def main_thread_stack(thread_id: int | None, limit: int = 12) -> list[str]:
    """The main thread's stack from its first cell frame on, innermost last, as short
    'file:line in func' strings; a deep library stack keeps the cell's own innermost frame."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return []
    lines = [f"{describe_location(f.f_code.co_filename, lineno)} in {f.f_code.co_name}"
             for f, lineno in traceback.walk_stack(frame)
             if f"{os.sep}nbdist{os.sep}" not in f.f_code.co_filename][:60][::-1]  # not the user's
    cell = [i for i, line in enumerate(lines) if line.startswith("cell line")]
    if not cell:
        return lines[-limit:]
    kept = lines[cell[0]:]
    if len(kept) <= limit:
        return kept
    innermost = cell[-1] - cell[0]
    head = kept[:1] + ([kept[innermost]] if 0 < innermost < len(kept) - limit + 2 else [])
    return head + kept[len(kept) - (limit - len(head)):]


TRACKER = CollectiveTracker()


def install() -> None:
    global _TORCH_DIR
    import torch
    import torch.distributed as dist

    _TORCH_DIR = os.path.dirname(torch.__file__)
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "__nbdist_original__"):
            setattr(dist, name, TRACKER.wrap(name, fn))
