"""``nbdist.log(step=..., loss=...)``: rank-side metric logging that feeds the live dashboard.

``log`` only appends to a lock-free buffer and sets the agent's wake event; the rank's telemetry
thread drains the buffer (the ``"metrics"`` provider) within ``LOG_SPACING``, so the training
thread never does I/O, pickling or GPU synchronisation.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections import deque
from typing import Any

from nbdist.worker import progress_bars
from nbdist.worker.agent import TelemetryAgent
from nbdist.worker.step_timing import install_step_timing, uninstall_step_timing

MAX_BUFFERED = 200_000
"""Records kept between two drains; beyond this the oldest are dropped (and counted)."""

MAX_RECORDS_PER_PAYLOAD = 2_000
"""Records sent per tick and rank; a faster logger is thinned evenly (the newest always kept)."""

# One record: (rank time, step, names, values). Names are interned tuples so a loop that logs the
# same keys every step costs one dict lookup, not a fresh tuple per call.
_Record = tuple[float, float, tuple[str, ...], tuple[Any, ...]]


class _MetricsBuffer:
    def __init__(self) -> None:
        # deque.append / popleft are atomic under the GIL: the training thread and the telemetry
        # thread never need a lock, and no record can be lost between a read and a swap.
        self.records: deque[_Record] = deque()
        self.enabled = False
        self.wake: threading.Event | None = None
        """The agent's wake event: set once per batch so the records leave before the next tick."""
        self.last_step = -1.0
        self.dropped = 0
        self.rejected: dict[str, str] = {}
        self.reported: set[str] = set()

    def clear(self) -> None:
        self.records.clear()
        self.dropped = 0


_BUFFER = _MetricsBuffer()


def log(step: int | float | None = None, **metrics: Any) -> None:
    """Record numeric metrics for the notebook's dashboard (cheap; never raises).

    ``step`` defaults to one past the previous step this rank logged. Values may be Python or
    NumPy numbers or one-element tensors. A CUDA tensor is *not* synchronised here: it is copied
    to host memory asynchronously and read by the telemetry thread once its CUDA event has
    completed (a later publish carries it if it has not yet), so ``nbdist.log(loss=loss)`` does not stall the training loop the way
    ``loss.item()`` does. Anything else (strings, multi-element tensors) is skipped, and the
    first offence per name is reported in the payload's ``"rejected"`` field.

    Outside an nbdist engine (plain Python, torchrun, a test) ``log`` is a silent no-op, so the
    same training code runs everywhere without extra output.
    """
    buffer = _BUFFER
    if not buffer.enabled or not metrics:
        return
    try:
        if step is None:
            step_value = buffer.last_step + 1.0
        else:
            step_value = float(step)
        buffer.last_step = step_value
        names = tuple(metrics)
        values = tuple(_capture(name, value) for name, value in metrics.items())
        if len(buffer.records) >= MAX_BUFFERED:
            buffer.records.popleft()
            buffer.dropped += 1
        buffer.records.append((time.time(), step_value, names, values))
        wake = buffer.wake
        # after the append: the thread clears the event before it drains, so no record is stranded
        if wake is not None and not wake.is_set():
            wake.set()
    except Exception:  # a bad value must never surface in the training loop
        buffer.dropped += 1


def _capture(name: str, value: Any) -> Any:
    # Fast path first: most logs are Python floats.
    if isinstance(value, float | int) and not isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, PendingValue):
        return value
    item = getattr(value, "item", None)
    if item is None:
        _reject(name, type(value).__name__)
        return None
    numel = getattr(value, "numel", None)
    if numel is not None and numel() != 1:
        _reject(name, f"tensor with {numel()} elements")
        return None
    if getattr(value, "is_cuda", False):
        return _PendingCuda(value)
    return item()


def _reject(name: str, why: str) -> None:
    if name not in _BUFFER.reported:
        _BUFFER.rejected.setdefault(name, why)


class PendingValue:
    """A logged value not readable yet; a drain sends it once `ready()`, never waiting for it."""

    __slots__ = ()

    def ready(self) -> bool:
        raise NotImplementedError

    def value(self) -> float:
        raise NotImplementedError


class _PendingCuda(PendingValue):
    """A CUDA scalar on its way to the host: async copy now, read when its event has fired."""

    __slots__ = ("host", "event")

    def __init__(self, tensor: Any) -> None:
        import torch

        # detach: keeping the autograd graph alive until the next drain would pin activations
        self.host = tensor.detach().reshape(()).to("cpu", non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        # query, never synchronize: behind a stuck collective the event may never fire, and the
        # drain runs under the agent's publish lock
        return bool(self.event.query())

    def value(self) -> float:
        return float(self.host.item())


def _ready_prefix(records: list[_Record]) -> int:
    """How many records from the front can be sent now: up to the first with a value pending."""
    for index, (_t, _step, _names, values) in enumerate(records):
        for value in values:
            if isinstance(value, PendingValue):
                try:
                    if not value.ready():
                        return index
                except Exception:
                    continue  # a failed event: sent as a gap (None)
    return len(records)


def drain(limit: int = MAX_RECORDS_PER_PAYLOAD) -> dict[str, Any] | None:
    """The ``"metrics"`` provider: every record logged since the last drain, thinned to ``limit``.

    Returns ``{"t": [...], "step": [...], "values": {name: [value or None, ...]}, "dropped": n}``
    (columns aligned by index) or ``None`` when nothing was logged.
    """
    buffer = _BUFFER
    records: list[_Record] = []
    pop = buffer.records.popleft
    while True:
        try:
            records.append(pop())
        except IndexError:
            break
    ready = _ready_prefix(records)
    # the rest wait for the next drain, in order, ahead of anything logged meanwhile
    buffer.records.extendleft(reversed(records[ready:]))
    records = records[:ready]
    if not records:
        return None
    dropped = 0
    if len(records) > limit:
        # evenly spaced, always keeping the newest record (it carries the current loss)
        stride = len(records) / limit
        keep = [records[min(len(records) - 1, int(i * stride))] for i in range(limit - 1)]
        keep.append(records[-1])
        dropped = len(records) - len(keep)
        records = keep
    columns: dict[str, list[float | None]] = {}
    times: list[float] = []
    steps: list[float] = []
    for index, (t, step, names, values) in enumerate(records):
        times.append(t)
        steps.append(step)
        for name, value in zip(names, values, strict=False):
            if isinstance(value, PendingValue):
                try:
                    value = value.value()
                except Exception:
                    value = None
            column = columns.get(name)
            if column is None:
                column = columns[name] = [None] * index
            column.append(value)
        for column in columns.values():
            if len(column) < index + 1:
                column.append(None)
    payload: dict[str, Any] = {"t": times, "step": steps, "values": columns}
    lost = dropped + buffer.dropped
    buffer.dropped = 0
    if lost:
        payload["dropped"] = lost
    if buffer.rejected:
        # each bad name is reported once, not on every tick
        payload["rejected"] = dict(buffer.rejected)
        buffer.reported.update(buffer.rejected)
        buffer.rejected.clear()
    return payload


_INSTALL_LOCK = threading.Lock()


def install_metrics(agent: TelemetryAgent) -> None:
    """Enable :func:`log` in this process and register the ``"metrics"`` provider (never raises)."""
    try:
        with _INSTALL_LOCK:
            _BUFFER.clear()
            agent.register("metrics", drain)
            _BUFFER.wake = agent.wake
            _BUFFER.enabled = True
    except Exception as exc:  # the dashboard is optional: a rank must come up without it
        agent.provider_errors["metrics"] = repr(exc)
    # the straggler view's step and collective timing rides along with the metrics, and
    # tqdm.auto draws the console bar: one text display per rank in the notebook, kept when saved
    install_step_timing(agent)
    progress_bars.install()


def uninstall_metrics(agent: TelemetryAgent | None = None) -> None:
    """Turn :func:`log` back into a no-op (tests, teardown)."""
    _BUFFER.enabled = False
    _BUFFER.wake = None
    _BUFFER.clear()
    if agent is not None:
        agent.unregister("metrics")
    uninstall_step_timing(agent)
    progress_bars.uninstall()
