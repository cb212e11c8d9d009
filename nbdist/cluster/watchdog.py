"""Orphan guard: a tiny process that ends the cluster's processes when the notebook kernel dies.

atexit does not run when a kernel is killed -9, so `Cluster.start` spawns this in its own session:
once the kernel's PID (and start time) is gone, it runs the pid file's cancel commands (`scancel`
of the engines' Slurm job), stops every PID listed there, and exits. It exits quietly when the pid
file is removed (a normal `%dist_stop`). Run: `python -m nbdist.cluster.watchdog PARENT
PARENT_CREATE_TIME PIDFILE WORKDIR INTERVAL GRACE`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil


def read_pidfile(path: str) -> tuple[list[tuple[int, float]], list[list[str]]]:
    """The recorded processes and the cancel commands; nothing from an unreadable file."""
    try:
        with open(path) as f:
            data = json.load(f)
        return ([(int(pid), float(ct)) for pid, ct in data["pids"]],
                [[str(arg) for arg in command] for command in data.get("cancel", [])])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [], []


def write_pidfile(path: str, pids: list[tuple[int, float]],
                  cancel_commands: list[list[str]] | None = None) -> None:
    write_private(path, json.dumps({"pids": pids, "cancel": cancel_commands or []}))


def write_private(path: str, text: str) -> None:
    """`text` into `path`, owner-only and atomically: no reader ever sees half of it."""
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
    """Stop each still-living recorded process and every child it has: SIGTERM, then SIGKILL
    what is left after `grace` seconds; returns the PIDs it found.

    The tree is frozen first (SIGSTOP), parents before children, each level listed only once
    its processes are seen stopped: a process that is still forking leaves no child behind."""
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


def stop_processes(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM these processes (and SIGCONT, for any frozen one to act on it), then SIGKILL
    whichever is still running after `grace` seconds."""
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
    while still:
        _gone, still = psutil.wait_procs(still, timeout=0)
        still = [p for p in still if _status(p) not in states]
        if not still or time.monotonic() > deadline:
            return still
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return still


def _signal_each(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def watch(parent_pid: int, parent_create_time: float, pidfile: str, workdir: str, interval: float,
          grace: float = 2.0) -> None:
    """Until the pid file goes away: once the parent is gone, stop every process it lists."""
    while os.path.exists(pidfile):  # else the cluster was stopped normally
        if same_process(parent_pid, parent_create_time) is None:
            pids, cancel_commands = read_pidfile(pidfile)
            for command in cancel_commands:  # one failing is no reason to leave the others
                try:
                    subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=30.0)
                except (OSError, subprocess.SubprocessError):
                    pass
            terminate_all(pids, grace=grace)
            shutil.rmtree(workdir, ignore_errors=True)
            return
        time.sleep(interval)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent, created, pidfile, workdir, interval, grace = sys.argv[1:]
    watch(int(parent), float(created), pidfile, workdir, float(interval), float(grace))
