"""Step and collective timing for the dashboard's straggler view (the ``"timing"`` provider).

Every collective this rank finishes is recorded as (group, torch's per-group sequence number,
group size, name, seconds it waited inside), DDP's gradient all-reduces once per step
(``ddp_timing``); every optimizer step as its duration and the seconds waited in collectives
during it. The rank that arrived last at a collective is the one that waited
least, so the notebook compares waits, never clocks of different hosts. Recording is two
``perf_counter`` calls and a deque append; the telemetry thread drains the deques.
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections import deque
from typing import Any

MAX_KEPT = 512
"""Records kept between two drains (a drain every 0.1-0.5 s; DDP makes one per step)."""

DDP_NAME = "DDP gradient all-reduce"

WAKE_SPACING = 0.25
"""Least seconds between two wakes from optimizer steps: a loop that does not log() sends at most
4 light payloads a second per rank besides the ticks (each costs the controller and the notebook
about 1 ms), and a straggler is still named within a step or two of 0.25 s."""

POINT_TO_POINT = frozenset({"send", "recv"})
"""Not collectives: the pair's sequence numbers say nothing about who the group waited for."""

# (group name, sequence number, group size, collective, seconds waited inside)
CollectiveRecord = tuple[str, int, int, str, float]
# (rank time at the step's end, seconds since the previous step, of which waiting in collectives)
StepRecord = tuple[float, float, float]
# what the wrapper hands from before the call to after it: (group name, seq, size, started)
Ticket = tuple[str, int, int, float]


class StepTiming:
    """This rank's timing records; fed from the training thread and torch's comm threads."""

    def __init__(self) -> None:
        self.enabled = True
        """False: record nothing (the benchmark's "without" arm; NBDIST_STEP_TIMING=0)."""
        self.collectives: deque[CollectiveRecord] = deque(maxlen=MAX_KEPT)
        self.steps: deque[StepRecord] = deque(maxlen=MAX_KEPT)
        self.wake: threading.Event | None = None
        """The telemetry agent's wake event: set at an optimizer step at most every
        ``wake_spacing`` s (``log()`` sets it at every call), so the step's records leave soon."""
        self.wake_spacing = WAKE_SPACING
        self._woken_at = 0.0
        self._group_arguments: dict[str, tuple[int | None, int | None]] = {}
        self._lead: weakref.ref[Any] | None = None
        self._last_step_at: float | None = None
        self._waited = 0.0
        self._ddp_ready: tuple[Any, float] | None = None

    # -- collectives ---------------------------------------------------------------------------
    def learn_signature(self, name: str, fn: Any) -> None:
        """Where ``fn`` takes ``group`` and ``async_op`` positionally (once, at wrap time)."""
        self._group_arguments[name] = (parameter_index(fn, "group"), parameter_index(fn, "async_op"))

    def before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Ticket | None:
        """Called just before a blocking collective: its group's next sequence number."""
        if not self.enabled or name in POINT_TO_POINT:
            return None
        try:
            group_at, async_at = self._group_arguments.get(name, (None, None))
            if call_argument(args, kwargs, "async_op", async_at, False):
                return None  # returns at once: its wait is the caller's .wait(), not this call
            group = call_argument(args, kwargs, "group", group_at, None)
            if group is None:
                from torch.distributed import distributed_c10d

                group = distributed_c10d._get_default_group()
            return (group.group_name, group._get_sequence_number_for_group(), group.size(),
                    time.perf_counter())
        except Exception:  # not a group of this rank, no group yet: nothing to compare
            return None

    def after(self, ticket: Ticket, name: str) -> None:
        group, seq, size, started = ticket
        self.record(group, seq, size, name, time.perf_counter() - started)

    def record(self, group: str, seq: int, size: int, name: str, waited: float) -> None:
        self.collectives.append((group, seq, size, name, waited))
        self._waited += waited

    def ddp_ready(self, group: Any, at: float) -> None:
        """A DDP parameter's gradient is ready (``ddp_timing``): the last one before the next
        optimizer step is when this rank arrived at the step's gradient all-reduce."""
        self._ddp_ready = (group, at)

    def on_optimizer_step_begin(self, *_: Any) -> None:
        """Global optimizer-step pre hook: DDP's backward has waited for every rank by now."""
        ready, self._ddp_ready = self._ddp_ready, None
        if ready is None or not self.enabled:
            return
        group, arrived = ready
        waited = time.perf_counter() - arrived
        try:
            if group is None:
                from torch.distributed import distributed_c10d

                group = distributed_c10d._get_default_group()
            # the sequence number after the step's buckets: the same on every rank; ":ddp" keeps
            # it apart from the explicit collective that will be entered at that number next
            self.record(f"{group.group_name}:ddp", group._get_sequence_number_for_group(),
                        group.size(), DDP_NAME, waited)
        except Exception:
            pass

    # -- steps ---------------------------------------------------------------------------------
    def on_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        """torch's global optimizer-step post hook: one record per step of the lead optimizer
        (the first one that steps; a second optimizer in the same loop would halve the steps)."""
        lead = self._lead() if self._lead is not None else None
        if lead is None:
            self._lead = weakref.ref(optimizer)
        elif lead is not optimizer:
            return
        now = time.perf_counter()
        if self._last_step_at is not None and self.enabled:
            self.steps.append((time.time(), now - self._last_step_at, self._waited))
            wake = self.wake
            if wake is not None and now - self._woken_at >= self.wake_spacing:
                self._woken_at = now
                wake.set()
        self._last_step_at = now
        self._waited = 0.0

    def cell_started(self) -> None:
        # the time between two cells is not a step
        self._last_step_at = None
        self._waited = 0.0

    def drain(self) -> dict[str, Any] | None:
        """The ``"timing"`` provider: records since the last drain, or None."""
        collectives = _pop_all(self.collectives)
        steps = _pop_all(self.steps)
        if not collectives and not steps:
            return None
        return {"collectives": collectives, "steps": steps}


def parameter_index(fn: Any, name: str) -> int | None:
    """Where ``fn`` takes the parameter ``name`` positionally (None: not at all, or unknown)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


def call_argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, index: int | None,
                  default: Any) -> Any:
    """The argument ``name`` of one call, by keyword or at ``index`` (`parameter_index`)."""
    if name in kwargs:
        return kwargs[name]
    if index is not None and index < len(args):
        return args[index]
    return default


def _pop_all(records: deque[Any]) -> list[Any]:
    out = []
    pop = records.popleft
    while True:
        try:
            out.append(pop())
        except IndexError:
            return out


TIMING = StepTiming()

OPT_OUT = "NBDIST_STEP_TIMING"
"""``NBDIST_STEP_TIMING=0`` in a rank's environment: record nothing and leave DDP's own C++
all-reduce in place (read when the rank starts)."""


def install_step_timing(agent: Any, timing: StepTiming = TIMING) -> None:
    """Register the ``"timing"`` provider, the optimizer-step hook and DDP's timed comm hook
    (never raises: the dashboard is optional, the rank comes up without it)."""
    import os

    try:
        import torch.optim.optimizer as optimizer

        from nbdist.worker import ddp_timing

        timing.enabled = os.environ.get(OPT_OUT, "1").lower() not in ("0", "false", "no", "off")
        timing.wake = agent.wake
        agent.register("timing", timing.drain)
        if timing.cell_started not in agent.on_cell_start:
            agent.on_cell_start.append(timing.cell_started)
        if not _HOOKS:
            _HOOKS.append(optimizer.register_optimizer_step_pre_hook(timing.on_optimizer_step_begin))
            _HOOKS.append(optimizer.register_optimizer_step_post_hook(timing.on_optimizer_step))
        ddp_timing.install(timing)
    except Exception as exc:
        agent.provider_errors["timing"] = repr(exc)


def uninstall_step_timing(agent: Any = None, timing: StepTiming = TIMING) -> None:
    """Undo :func:`install_step_timing` (tests, teardown): hooks removed, DDP as torch has it."""
    from nbdist.worker import ddp_timing

    while _HOOKS:
        _HOOKS.pop().remove()
    ddp_timing.uninstall()
    timing.wake = None
    if agent is not None:
        agent.unregister("timing")
        if timing.cell_started in agent.on_cell_start:
            agent.on_cell_start.remove(timing.cell_started)


_HOOKS: list[Any] = []
"""The global optimizer-step hooks' handles (one pair per process)."""
