"""Every process a cluster owns, by PID: its private directory and its controller's family."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psutil

from nbdist.config import NbdistConfig
from nbdist.worker.process_tree import same_process

Pid = tuple[int, float]
"""A process as nbdist records it: (pid, create time), so a reused PID is never mistaken for it."""


class OwnedProcesses:
    """The cluster's private directory and its controller."""

    def __init__(self, config: NbdistConfig) -> None:
        self.config = config
        self.workdir = ""
        self.controller: Pid | None = None

    def create_workdir(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="nbdist-")  # 0700 by construction

    def record_controller(self, pid: int) -> None:
        self.controller = (pid, psutil.Process(pid).create_time())

    def controller_alive(self) -> bool:
        return self.controller is not None and same_process(*self.controller) is not None

    def controller_family(self) -> list[Pid]:
        """The controller and every process of its process group (ipyparallel starts it in a
        session of its own; its schedulers and heart monitor are forked): found even after the
        controller was killed, since a group's ID is not reused while it has a member."""
        if not self.controller:
            return []
        leader, created = self.controller
        family = [self.controller]
        for proc in psutil.process_iter():
            try:
                if (proc.pid != leader and os.getpgid(proc.pid) == leader
                        and proc.create_time() >= created):
                    family.append((proc.pid, proc.create_time()))
            except (OSError, psutil.Error):  # gone meanwhile
                continue
        return family

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
