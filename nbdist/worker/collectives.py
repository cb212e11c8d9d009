"""What torch's flight recorder cannot say about a rank's collectives: whether its main thread
waits in one right now, where in the cell it called it, and the group it broke when one failed
(torch < 2.8 records no gloo collective: there the count per cell names a rank that skipped one).

``install()`` wraps the public torch.distributed collectives (module attributes, so code that calls
``dist.all_reduce`` — the user's or torch's own — goes through the wrapper). The cost is a few
attribute writes and one frame walk per call, plus the wait recorded for the dashboard's
straggler view (``step_timing``).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbdist.worker import step_timing

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
)

_TORCH_DIR = ""


def is_cell_file(filename: str) -> bool:
    """True for the pseudo-files IPython compiles notebook cells into."""
    return filename.startswith("<ipython-input") or (
        "ipykernel_" in filename and filename.endswith(".py")
    )


def describe_location(filename: str, lineno: int) -> str:
    if is_cell_file(filename):
        return f"cell line {lineno}"
    return f"{os.path.basename(filename)}:{lineno}"


def user_location(frame: Any) -> str:
    """The innermost frame outside torch and nbdist (the user's code), described briefly."""
    first = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if first is None:
            first = (filename, frame.f_lineno)
        if not _is_library_file(filename):
            return describe_location(filename, frame.f_lineno)
        frame = frame.f_back
    return describe_location(*first) if first else "?"


def _is_library_file(filename: str) -> bool:
    return (
        (bool(_TORCH_DIR) and filename.startswith(_TORCH_DIR))
        or f"{os.sep}nbdist{os.sep}" in filename
        or filename.startswith("<frozen")
    )


@dataclass
class CollectiveCall:
    name: str
    location: str
    """The user-level frame of the call (``cell line 3``): what the flight recorder cannot say."""
    since: float


class CollectiveTracker:
    """Per-process record of the collective the main thread is in, where the cell called it,
    and how many it entered this cell (the hang report's fallback without a flight recorder)."""

    def __init__(self) -> None:
        self.current: CollectiveCall | None = None
        self.count = 0
        self.failed_in: CollectiveCall | None = None
        self.group_broken = False
        """A collective of this cell left the group unusable (a peer went away, or it was
        interrupted midway): the notebook side rebuilds it after the cell. A collective that
        merely rejected its arguments breaks nothing."""
        self.main_thread_id = threading.main_thread().ident
        self._depth = 0

    def reset_cell(self) -> None:
        self.current = None
        self.count = 0
        self.failed_in = None
        self.group_broken = False
        self._depth = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self
        timing = step_timing.TIMING
        timing.learn_signature(name, fn)

        @functools.wraps(fn)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != tracker.main_thread_id or tracker._depth:
                return fn(*args, **kwargs)  # nested (all_gather_object -> all_gather) or a thread
            tracker.count += 1
            call = CollectiveCall(name, user_location(sys._getframe(1)), time.time())
            tracker.current = call
            tracker._depth += 1
            ticket = timing.before(name, args, kwargs)  # the straggler view's sequence number
            try:
                result = fn(*args, **kwargs)
                if ticket is not None:
                    timing.after(ticket, name)
                return result
            except BaseException as exc:
                tracker.failed_in = call
                if isinstance(exc, KeyboardInterrupt):
                    tracker.group_broken = True  # peers may have completed what this rank left
                elif is_transport_failure(exc):
                    tracker.group_broken = True
                    _release_broken_group(exc)
                raise
            finally:
                tracker._depth -= 1
                tracker.current = None

        tracked.__nbdist_original__ = fn  # type: ignore[attr-defined]
        return tracked

    def blocked_since(self) -> float | None:
        """When the main thread entered the collective it is in now (time.time()), or None."""
        current = self.current
        return None if current is None else current.since

    def snapshot(self) -> dict[str, Any]:
        """Where the main thread is now: collective in flight, count, and its user-level stack."""
        current = self.current
        return {
            "collective": None if current is None else {
                "name": current.name, "location": current.location, "since": current.since},
            "collectives_entered": self.count,
            "stack": main_thread_stack(self.main_thread_id),
        }


def _release_broken_group(exc: BaseException) -> None:
    """A failed collective leaves a broken group: close it now so peers blocked on this rank fail
    at once too. torch's own frames in the traceback hold the Work (and so the group's sockets)
    alive, so their locals are cleared first; the user's frames are left intact."""
    from nbdist.worker import process_group

    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if _TORCH_DIR and frame.f_code.co_filename.startswith(_TORCH_DIR):
            try:
                frame.clear()
            except RuntimeError:  # still executing (cannot happen below the wrapper)
                pass
        tb = tb.tb_next
    process_group.teardown()


_TRANSPORT_MARKS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


def is_transport_failure(exc: BaseException | None) -> bool:
    """A process-group operation failed because a peer went away (not the user's own error)."""
    if exc is None or isinstance(exc, KeyboardInterrupt):
        return False
    try:
        from torch.distributed import DistBackendError

        if isinstance(exc, DistBackendError):
            return True
    except ImportError:
        pass
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(mark in text for mark in _TRANSPORT_MARKS)


def record_implicit_failure(tracker: CollectiveTracker, exc: BaseException) -> CollectiveCall:
    """A collective torch ran by itself (DDP's gradient all-reduce in backward, FSDP's gathers)
    failed: record where, as the wrapper does for explicit calls, and close the broken group so
    peers blocked on this rank fail too."""
    cell_line = "?"
    in_backward = False
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_cell_file(code.co_filename):
            cell_line = describe_location(code.co_filename, tb.tb_lineno)
        if code.co_name in ("backward", "_engine_run_backward"):
            in_backward = True
        tb = tb.tb_next
    recorded = _recorded_name()
    if recorded:
        name = f"{recorded} (gradients in backward())" if in_backward else recorded
    else:
        name = "gradient all-reduce in backward()" if in_backward else "a collective inside torch"
    call = CollectiveCall(name, cell_line, time.time())
    tracker.failed_in = call
    tracker.group_broken = True
    _release_broken_group(exc)
    return call


def _recorded_name() -> str:
    """The collective torch's flight recorder saw this rank enter last, or "" without one."""
    from nbdist.worker import flight_recorder

    try:
        found = flight_recorder.entries() if flight_recorder.available() else []
    except Exception:  # the group is half torn down: the caller's own guess stands
        return ""
    return max(found, key=lambda entry: entry.since).title() if found else ""


def main_thread_stack(thread_id: int | None, limit: int = 12) -> list[str]:
    """The main thread's stack, innermost last, as short 'file:line in func' strings."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    lines: list[str] = []
    while frame is not None and len(lines) < 60:
        code = frame.f_code
        if f"{os.sep}nbdist{os.sep}" not in code.co_filename:  # its wrappers are not the user's
            lines.append(f"{describe_location(code.co_filename, frame.f_lineno)} in {code.co_name}")
        frame = frame.f_back
    lines.reverse()
    # keep from the first cell frame on: the engine's own dispatch frames say nothing useful;
    # a deep library stack (FSDP2's forward) must not push the cell's own last frame out
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


def install(tracker: CollectiveTracker = TRACKER) -> None:
    global _TORCH_DIR
    import torch
    import torch.distributed as dist

    _TORCH_DIR = os.path.dirname(torch.__file__)
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or hasattr(fn, "__nbdist_original__"):
            continue
        setattr(dist, name, tracker.wrap(name, fn))
