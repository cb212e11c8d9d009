"""A rank's ``nbdist.log`` records (``"metrics"``) and step and collective timing for the straggler
view (``"timing"``): the training thread only appends and wakes the telemetry thread, which drains.
The rank that arrived last at a collective waited least: the notebook compares waits, not clocks."""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from nbdist.worker.agent import TelemetryAgent

MAX_BUFFERED = 200_000  # records kept between two drains; beyond it the oldest are dropped
MAX_RECORDS_PER_PAYLOAD = 2_000  # per tick and rank; a faster logger is thinned evenly


@dataclass
class _MetricsBuffer:
    # (rank time, step, names, values); deque.append / popleft are atomic under the GIL: the
    # training and telemetry threads need no lock
    records: deque[tuple[float, float, tuple[str, ...], tuple[Any, ...]]] = field(
        default_factory=deque)
    wake: threading.Event | None = None  # the agent's while log() is enabled
    last_step: float = -1.0
    dropped: int = 0
    rejected: dict[str, str] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)


_BUFFER = _MetricsBuffer()


def log(step: int | float | None = None, **metrics: Any) -> None:
    """Record numeric metrics for the notebook's dashboard (cheap; never raises; a no-op outside
    an nbdist engine). ``step`` defaults to one past this rank's previous one. Values: Python or
    NumPy numbers or one-element tensors; a CUDA tensor is copied to the host asynchronously, so
    ``nbdist.log(loss=loss)`` does not stall the loop as ``loss.item()`` does. Anything else is
    skipped, the first offence per name reported in the payload's ``"rejected"``."""
    buffer = _BUFFER
    if buffer.wake is None or not metrics:
        return
    try:
        buffer.last_step = buffer.last_step + 1.0 if step is None else float(step)
        values = tuple(_capture(name, value) for name, value in metrics.items())
        if len(buffer.records) >= MAX_BUFFERED:
            buffer.records.popleft()
            buffer.dropped += 1
        buffer.records.append((time.time(), buffer.last_step, tuple(metrics), values))
        # after the append: the thread clears the event before it drains
        if not buffer.wake.is_set():
            buffer.wake.set()
    except Exception:  # a bad value must never surface in the training loop
        buffer.dropped += 1


def _capture(name: str, value: Any) -> Any:
    if isinstance(value, numbers.Real):
        return value if type(value) in (int, float) else float(value)
    if isinstance(value, PendingValue):
        return value
    if not hasattr(value, "item"):
        why = type(value).__name__
    elif hasattr(value, "numel") and value.numel() != 1:
        why = f"tensor with {value.numel()} elements"
    elif not getattr(value, "is_cuda", False):
        return value.item()
    elif _capturing():
        why = CAPTURED
    else:
        return _PendingCuda(value)
    if name not in _BUFFER.reported:
        _BUFFER.rejected.setdefault(name, why)
    return None


CAPTURED = ("a CUDA tensor logged while a CUDA graph captures: it has no value until the graph "
            "replays; log it after the captured region")


def _capturing() -> bool:
    """Whether the current stream captures a CUDA graph: a copy or event made now would become
    part of the graph, and its buffer would only be filled when the graph replays."""
    import torch

    return torch.cuda.is_current_stream_capturing()


class PendingValue:
    """A logged value not readable yet; a drain sends it once `ready()`, never waiting for it."""

    __slots__ = ()

    def ready(self) -> bool:
        raise NotImplementedError

    def value(self) -> float:
        raise NotImplementedError


class _PendingCuda(PendingValue):
    __slots__ = ("host", "event")

    def __init__(self, tensor: Any) -> None:
        import torch

        # detach: keeping the autograd graph alive until the next drain would pin activations
        self.host = tensor.detach().reshape(()).to("cpu", non_blocking=True)
        self.event = torch.cuda.Event()
        # torch copies to the host on the tensor's own device's current stream, which is not
        # the current device's for a tensor on another of the rank's GPUs
        self.event.record(torch.cuda.current_stream(tensor.device))

    def ready(self) -> bool:
        # query, never synchronize: behind a stuck collective the event may never fire
        return bool(self.event.query())

    def value(self) -> float:
        return float(self.host.item())


_NOT_YET = object()


def _settle(value: Any) -> Any:
    """A logged value as sent: a pending one read once ready, _NOT_YET before; None (a gap) when
    its query or read fails, never the buffer a copy that may not have finished was writing."""
    if not isinstance(value, PendingValue):
        return value
    try:
        return value.value() if value.ready() else _NOT_YET
    except Exception:
        return None


def drain(limit: int = MAX_RECORDS_PER_PAYLOAD) -> dict[str, Any] | None:
    """The ``"metrics"`` provider: the records since the last drain, thinned to ``limit``, as
    aligned columns ``{"t", "step", "values": {name: [value or None...]}, "dropped"}``, or None."""
    buffer = _BUFFER
    records = [buffer.records.popleft() for _ in range(len(buffer.records))]
    settled = []
    for t, step, names, values in records:
        read = tuple(map(_settle, values))
        if any(value is _NOT_YET for value in read):
            break
        settled.append((t, step, names, read))
    # the rest wait for the next drain, in order, ahead of anything logged meanwhile
    buffer.records.extendleft(reversed(records[len(settled):]))
    records = settled
    if not records:
        return None
    dropped = 0
    if len(records) > limit:  # evenly spaced, always keeping the newest (the current loss)
        stride = len(records) / limit
        keep = [records[int(i * stride)] for i in range(limit - 1)] + [records[-1]]
        dropped, records = len(records) - len(keep), keep
    columns: dict[str, list[Any]] = {}
    for index, (_t, _step, names, values) in enumerate(records):
        for name, value in zip(names, values, strict=False):
            if name not in columns:
                columns[name] = [None] * len(records)
            columns[name][index] = value
    payload: dict[str, Any] = {"t": [r[0] for r in records], "step": [r[1] for r in records],
                               "values": columns}
    lost, buffer.dropped = dropped + buffer.dropped, 0
    if lost:
        payload["dropped"] = lost
    if buffer.rejected:  # each bad name is reported once, not on every tick
        payload["rejected"] = dict(buffer.rejected)
        buffer.reported.update(buffer.rejected)
        buffer.rejected.clear()
    return payload


def install_metrics(agent: TelemetryAgent) -> None:
    global _BUFFER
    _BUFFER = _MetricsBuffer(wake=agent.wake)
    agent.register("metrics", drain)


def uninstall_metrics(agent: TelemetryAgent | None = None) -> None:
    global _BUFFER
    _BUFFER = _MetricsBuffer()
    if agent is not None:
        agent.unregister("metrics")


MAX_KEPT = 512  # timing records kept between two drains (0.1-0.5 s; DDP makes one per step)
DDP_NAME = "DDP gradient all-reduce"
WAKE_SPACING = 0.25  # least seconds between wakes from optimizer steps: payloads cost the notebook
# not collectives: the pair's sequence numbers say nothing about who the group waited for
POINT_TO_POINT = frozenset({"send", "recv"})
OPT_OUT = "NBDIST_STEP_TIMING"  # =0: record nothing and leave DDP's C++ all-reduce in place
Ticket = tuple[str, int, int, float]  # from before a collective: (group name, seq, size, started)


def _ticket(group: Any, started: float, suffix: str = "") -> Ticket:
    """The group's name (+ suffix), next sequence number and size; raises off a group."""
    from torch.distributed import distributed_c10d

    group = distributed_c10d._get_default_group() if group is None else group
    return (group.group_name + suffix, group._get_sequence_number_for_group(), group.size(),
            started)


class StepTiming:
    """This rank's timing records, fed from the training thread and torch's autograd threads."""

    def __init__(self) -> None:
        self.enabled = True
        # (group name, sequence number, group size, collective, seconds waited inside)
        self.collectives: deque[tuple[str, int, int, str, float]] = deque(maxlen=MAX_KEPT)
        # (rank time at the step's end, seconds since the previous step, of which in collectives)
        self.steps: deque[tuple[float, float, float]] = deque(maxlen=MAX_KEPT)
        self.wake: threading.Event | None = None  # the agent's, set at most every WAKE_SPACING
        self._woken_at = 0.0
        self._lead: weakref.ref[Any] | None = None
        self._last_step_at: float | None = None
        self._waited = 0.0
        self._ddp_ready: tuple[Any, float] | None = None

    def before(self, name: str, group: Any, async_op: bool) -> Ticket | None:
        """Just before a collective: its group's next sequence number. An async_op one returns
        at once: its wait is the caller's .wait(), not this call."""
        if not self.enabled or name in POINT_TO_POINT or async_op:
            return None
        try:
            return _ticket(group, time.perf_counter())
        except Exception:  # not a group of this rank, no group yet: nothing to compare
            return None

    def after(self, ticket: Ticket, name: str) -> None:
        group, seq, size, started = ticket
        waited = time.perf_counter() - started
        self.collectives.append((group, seq, size, name, waited))
        self._waited += waited

    def watch(self, ddp: Any) -> None:
        """Hook every trainable parameter of a DDP model: the last gradient ready in a backward is
        when this rank handed its last bucket to the all-reduce."""
        group = getattr(ddp, "process_group", None)

        def ready(_param: Any) -> None:
            self._ddp_ready = (group, time.perf_counter())

        with contextlib.suppress(Exception):  # an older torch or an odd module: trains untimed
            for param in ddp.module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(ready)

    def on_optimizer_step_begin(self, *_: Any) -> None:
        """Global optimizer-step pre hook: DDP's backward has waited for every rank by now."""
        ready, self._ddp_ready = self._ddp_ready, None
        if ready is None or not self.enabled:
            return
        group, arrived = ready
        with contextlib.suppress(Exception):
            # the sequence number after the step's buckets is the same on every rank; ":ddp"
            # keeps it apart from the explicit collective entered at that number next
            self.after(_ticket(group, arrived, ":ddp"), DDP_NAME)

    def on_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        """Global optimizer-step post hook: one record per step of the first optimizer that
        steps (a second one in the same loop would halve the steps)."""
        lead = self._lead() if self._lead is not None else None
        if lead is None:
            self._lead = weakref.ref(optimizer)
        elif lead is not optimizer:
            return
        now = time.perf_counter()
        if self._last_step_at is not None and self.enabled:
            self.steps.append((time.time(), now - self._last_step_at, self._waited))
            if self.wake is not None and now - self._woken_at >= WAKE_SPACING:
                self._woken_at = now
                self.wake.set()
        self._last_step_at = now
        self._waited = 0.0

    def cell_started(self) -> None:
        self._last_step_at = None  # the time between two cells is not a step
        self._waited = 0.0

    def drain(self) -> dict[str, Any] | None:
        collectives = [self.collectives.popleft() for _ in range(len(self.collectives))]
        steps = [self.steps.popleft() for _ in range(len(self.steps))]
        return {"collectives": collectives, "steps": steps} if collectives or steps else None


TIMING = StepTiming()
_HOOKS: list[Any] = []


def install_step_timing(agent: TelemetryAgent) -> None:
    """The ``"timing"`` provider, the optimizer-step hooks and DDP's parameter hooks."""
    import torch.optim.optimizer as optimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    TIMING.enabled = os.environ.get(OPT_OUT, "1").lower() not in ("0", "false", "no", "off")
    TIMING.wake = agent.wake
    agent.register("timing", TIMING.drain)
    if _HOOKS:  # the step hooks and DDP's wrapper: once per process
        return
    _HOOKS.extend((
        optimizer.register_optimizer_step_pre_hook(TIMING.on_optimizer_step_begin),
        optimizer.register_optimizer_step_post_hook(TIMING.on_optimizer_step)))
    original = DDP.__init__

    # DDP's own fused C++ all-reduce stays: a Python comm hook costs a second pass per bucket
    @functools.wraps(original)
    def init(ddp: Any, *args: Any, **kwargs: Any) -> None:
        original(ddp, *args, **kwargs)
        if TIMING.enabled:
            TIMING.watch(ddp)

    DDP.__init__ = init  # type: ignore[method-assign]
