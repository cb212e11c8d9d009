"""A process tree stopped for good (frozen, SIGTERM, SIGKILL): by a rank or controller that ends
itself and by `%dist_stop`."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import NoReturn

import psutil


def same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process with this PID if it is still the one that was recorded (and not a zombie)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > 0.05 or _status(proc) in _EXITED:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def terminate_all(pids: list[tuple[int, float]], grace: float) -> list[int]:
    """Stop each still-living recorded process and all its descendants: SIGTERM, then SIGKILL
    after `grace` s; returns their PIDs. Frozen first (SIGSTOP), each level listed only once seen
    stopped, so that a process still forking leaves no child behind."""
    frozen = [p for p in (same_process(pid, ct) for pid, ct in pids) if p is not None]
    seen = {p.pid for p in frozen}
    level = list(frozen)
    while level:
        _signal_each(level, signal.SIGSTOP)
        _wait_for(level, _EXITED | {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}, 1.0)
        children = []
        for proc in level:
            try:
                children += [c for c in proc.children() if c.pid not in seen]
            except psutil.Error:
                continue
        seen.update(c.pid for c in children)
        frozen += children
        level = children
    stop_processes(frozen, grace)
    return [p.pid for p in frozen]


def exit_with_descendants(grace: float) -> NoReturn:
    """Stop every descendant (`terminate_all` on its children: on itself, it would freeze), then
    exit at once, whatever the main thread is blocked in."""
    children = []
    for child in psutil.Process().children():
        try:
            children.append((child.pid, child.create_time()))
        except psutil.Error:  # it exited meanwhile: nothing to stop
            continue
    terminate_all(children, grace=grace)
    os._exit(0)


def stop_processes(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM (and SIGCONT, for a frozen one to act on it), then SIGKILL after `grace` s."""
    _signal_each(procs, signal.SIGTERM)
    _signal_each(procs, signal.SIGCONT)
    still = _wait_for(procs, _EXITED, grace)
    _signal_each(still, signal.SIGKILL)
    _wait_for(still, _EXITED, grace)


_EXITED = {psutil.STATUS_ZOMBIE, "gone"}
"""A zombie has exited: one whose parent is gone may wait a while for init to reap it."""


def _status(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return "gone"


def _wait_for(procs: list[psutil.Process], states: set[str],
              timeout: float) -> list[psutil.Process]:
    """Those of `procs` not in one of `states` after `timeout` s (our exited children reaped)."""
    deadline, pause = time.monotonic() + timeout, 0.001
    still = list(procs)
    while True:
        _gone, still = psutil.wait_procs(still, timeout=0)
        still = [p for p in still if _status(p) not in states]
        if not still or time.monotonic() > deadline:
            return still
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def _signal_each(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)
