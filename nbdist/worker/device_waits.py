"""How long an NCCL collective held its rank's stream, from two CUDA events: NCCL returns to
Python once the collective is queued, so the host-side wait the straggler view compares is about
zero there. The start event fires when the rank's own work before the collective is done (its
arrival), the end event once the collective is (the stream waits for it): between them, this
rank's wait for the others plus the transfer, as a gloo rank's blocking call measures it.

Every CUDA call here runs on the main thread that launched the collective, on its stream and
device: events are recorded and queried there, never from the telemetry thread (whose current
device is not the rank's, and whose query would break a CUDA graph the main thread captures)."""

from __future__ import annotations

from collections import deque
from typing import Any

from nbdist.worker.metrics import MAX_KEPT, TIMING, Ticket

# (ticket, collective, start event, end event), oldest first
_PENDING: deque[tuple[Ticket, str, Any, Any]] = deque(maxlen=MAX_KEPT)


def start(tensors: list[Any]) -> Any | None:
    """Before a blocking collective on CUDA tensors: an event on the current stream, or None
    (CPU tensors, or the stream is being captured into a CUDA graph: no timing event there)."""
    if not tensors or not getattr(tensors[0], "is_cuda", False):
        return None
    import torch

    if torch.cuda.is_current_stream_capturing():
        return None
    resolve()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def finish(ticket: Ticket, name: str, started: Any) -> None:
    """After the collective returned: its end on the current stream, read once it has passed."""
    import torch

    end = torch.cuda.Event(enable_timing=True)
    end.record()
    _PENDING.append((ticket, name, started, end))


def resolve() -> None:
    """Hand every collective whose end event has passed to the straggler view's records, in
    order (a later one never before an earlier one); never waits for the GPU."""
    while _PENDING:
        (group, seq, size, _host_start), name, started, end = _PENDING[0]
        if not end.query():
            return
        _PENDING.popleft()
        TIMING.collectives.append((group, seq, size, name, started.elapsed_time(end) / 1000))
