"""Every process a cluster owns, by PID: its private directory, the controller and the children it
forks, the pid file that names them all, and the orphan watchdog that reads that file.

Nothing here knows ipyparallel; `nbdist.cluster.engines` reports the engine PIDs it starts.
"""

from __future__ import annotations

import os
import shutil
import signal
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

    def create_workdir(self) -> str:
        self.workdir = tempfile.mkdtemp(prefix="nbdist-")  # 0700 by construction
        self.pidfile = os.path.join(self.workdir, "pids.json")
        return self.workdir

    def record_controller(self, pid: int) -> None:
        self.controller = (pid, psutil.Process(pid).create_time())
        self._controller_children = set()

    def controller_alive(self) -> bool:
        if self.controller is None:
            return False
        return watchdog.same_process(*self.controller) is not None

    def controller_family(self) -> list[Pid]:
        """The controller and its children (its schedulers and heart monitor are forked
        processes). The children are remembered: when the controller is killed they are
        orphaned, and only the record still names them (measured: 8 left per kill)."""
        if not self.controller:
            return []
        proc = watchdog.same_process(*self.controller)
        if proc is not None:
            try:
                self._controller_children |= {(c.pid, c.create_time()) for c in proc.children(recursive=True)}
            except psutil.Error:
                pass
        return [self.controller, *sorted(self._controller_children)]

    def write_pidfile(self, pids: list[Pid]) -> None:
        if self.pidfile and os.path.isdir(self.workdir):
            watchdog.write_pidfile(self.pidfile, pids, self.cancel_commands)

    def start_watchdog(self) -> None:
        me = psutil.Process()
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "nbdist.cluster.watchdog", "--parent", str(me.pid),
             "--parent-create-time", repr(me.create_time()), "--pidfile", self.pidfile,
             "--workdir", self.workdir, "--interval", str(self.config.internal.watchdog_interval),
             "--grace", str(self.config.internal.orphan_kill_grace)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop_watchdog(self) -> None:
        if self.pidfile and os.path.exists(self.pidfile):
            os.remove(self.pidfile)  # tells the watchdog to exit quietly
        if self.watchdog is None:
            return
        # it only sleeps between checks (up to watchdog_interval): end it now, not at its
        # next check; its work is done, the processes it guards are already stopped
        try:
            self.watchdog.terminate()
        except OSError:
            pass
        try:
            self.watchdog.wait(timeout=2 * self.config.internal.watchdog_interval + 1)
        except subprocess.TimeoutExpired:
            self.watchdog.send_signal(signal.SIGKILL)
            self.watchdog.wait(timeout=2)
        self.watchdog = None

    def remove_workdir(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


@contextmanager
def private_files() -> Iterator[int]:
    """While ipyparallel starts processes and writes the cluster's files (connection files with
    the key, logs, the profile's directories): umask 077, so each is owner-only from its creation.
    The umask is per process, so the notebook's other threads meanwhile create owner-only files
    too (never more open ones). Yields the umask it replaced, the user's."""
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
