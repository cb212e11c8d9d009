"""Every process a cluster owns, by PID: its private directory, the controller and the children it
forks, the pid file that names them all, and the orphan watchdog that reads that file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psutil

from nbdist.cluster import watchdog
from nbdist.config import NbdistConfig

Pid = tuple[int, float]
"""A process as nbdist records it: (pid, create time), so a reused PID is never mistaken for it."""


class OwnedProcesses:
    """The cluster's private directory, its controller's process family and the orphan guard."""

    def __init__(self, config: NbdistConfig) -> None:
        self.config = config
        self.workdir = ""
        self.pidfile = ""
        self.watchdog: subprocess.Popen[bytes] | None = None
        self.controller: Pid | None = None
        self._controller_children: set[Pid] = set()
        self.cancel_commands: list[list[str]] = []
        """Commands that cancel the batch jobs of the engines (scancel ID), for the watchdog."""

    def create_workdir(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="nbdist-")  # 0700 by construction
        self.pidfile = os.path.join(self.workdir, "pids.json")

    def record_controller(self, pid: int) -> None:
        self.controller = (pid, psutil.Process(pid).create_time())
        self._controller_children = set()

    def controller_alive(self) -> bool:
        return self.controller is not None and watchdog.same_process(*self.controller) is not None

    def controller_family(self) -> list[Pid]:
        """The controller and its children (schedulers, heart monitor), remembered: once the
        controller is killed they are orphans that only this record still names."""
        if not self.controller:
            return []
        proc = watchdog.same_process(*self.controller)
        if proc is not None:
            self._controller_children.update(process_trees([proc.pid])[1:])
        return [self.controller, *sorted(self._controller_children)]

    def write_pidfile(self, pids: list[Pid]) -> None:
        if self.pidfile and os.path.isdir(self.workdir):
            watchdog.write_pidfile(self.pidfile, pids, self.cancel_commands)

    def start_watchdog(self) -> None:
        me, internal = psutil.Process(), self.config.internal
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "nbdist.cluster.watchdog", str(me.pid), repr(me.create_time()),
             self.pidfile, self.workdir, str(internal.watchdog_interval),
             str(internal.orphan_kill_grace)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def stop_watchdog(self) -> None:
        if self.pidfile and os.path.exists(self.pidfile):
            os.remove(self.pidfile)  # tells the watchdog to exit quietly
        if self.watchdog is not None:
            self.watchdog.terminate()  # it sleeps between checks: its work is done, end it now
            self.watchdog.wait()
            self.watchdog = None

    def remove_workdir(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


@contextmanager
def private_files() -> Iterator[int]:
    """umask 077 while ipyparallel writes the cluster's files (connection files with the key,
    logs), so each is owner-only from its creation; yields the user's umask it replaced."""
    previous = os.umask(0o077)
    try:
        yield previous
    finally:
        os.umask(previous)


def process_trees(pids: Iterable[int]) -> list[Pid]:
    """These local processes and all their children, as recorded PIDs (gone ones skipped)."""
    found: list[Pid] = []
    for pid in pids:
        if not isinstance(pid, int) or pid <= 0:  # a launcher that never started has pid -1
            continue
        try:
            proc = psutil.Process(pid)
            found.append((pid, proc.create_time()))
            found.extend((c.pid, c.create_time()) for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return found
