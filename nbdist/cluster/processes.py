"""Every process a cluster owns, by PID: its private directory, and the controller with the
children it forks."""

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
    """The cluster's private directory and its controller's process family."""

    def __init__(self, config: NbdistConfig) -> None:
        self.config = config
        self.workdir = ""
        self.controller: Pid | None = None
        self._controller_children: set[Pid] = set()

    def create_workdir(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="nbdist-")  # 0700 by construction

    def record_controller(self, pid: int) -> None:
        self.controller = (pid, psutil.Process(pid).create_time())
        self._controller_children = set()

    def controller_alive(self) -> bool:
        return self.controller is not None and same_process(*self.controller) is not None

    def remember_controller_children(self) -> None:
        """Note the controller's children (schedulers, heart monitor) while it lives: once it
        is killed they are orphans that only this record still names."""
        proc = same_process(*self.controller) if self.controller else None
        if proc is not None:
            self._controller_children.update(process_trees([proc.pid])[1:])

    def controller_family(self) -> list[Pid]:
        """The controller and its children, as remembered."""
        if not self.controller:
            return []
        self.remember_controller_children()
        return [self.controller, *sorted(self._controller_children)]

    def remove_workdir(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def write_private(path: str, text: str) -> None:
    """`text` into `path`, owner-only and atomically: no reader ever sees half of it."""
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
