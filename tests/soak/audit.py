"""What the soak checks from outside the kernel: its whole process tree (no orphan, none lost to
init), and the kernel's threads, file descriptors, ZMQ sockets, RSS and the cluster's logs on disk."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

# Defined in the kernel by the soak's first cell: the cluster's files on disk and, when asked,
# the ZMQ sockets still open in the kernel (a gc walk, so only now and then).
PROBE = '''
def _soak_probe(count_zmq=False):
    import gc, os, warnings, zmq
    import nbdist.notebook.magics as _m
    gc.collect()  # RSS is read next: count what the kernel holds, not cycles awaiting collection
    cluster, size = _m.current_cluster(), 0
    if cluster is not None and cluster.workdir:
        for root, _, files in os.walk(cluster.workdir):
            for name in files:
                try:
                    size += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass
    sockets = -1
    if count_zmq:
        with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
            warnings.simplefilter("ignore")
            sockets = sum(1 for o in gc.get_objects() if isinstance(o, zmq.Socket) and not o.closed)
    import threading
    names = sorted(t.name for t in threading.enumerate())
    return {"log_bytes": size, "zmq": sockets, "thread_names": names}
'''


@dataclass
class Sample:
    threads: int
    fds: int
    rss: int
    zmq: int = -1
    log_bytes: int = 0
    thread_names: tuple[str, ...] = ()


def sample(kernel_process: psutil.Process, probe: dict | None = None) -> Sample:
    probe = probe or {}
    return Sample(kernel_process.num_threads(), kernel_process.num_fds(),
                  kernel_process.memory_info().rss, probe.get("zmq", -1), probe.get("log_bytes", 0),
                  tuple(probe.get("thread_names", ())))


class ProcessTree:
    """Every process ever seen below the kernel. One that left the tree must be gone, not running
    on under init (an orphan); the tree's size must come back to the size of a healthy cluster."""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self.seen: dict[int, float] = {}  # pid -> create_time (a reused PID is another process)
        self.healthy_size = 0

    def current(self) -> dict[int, float]:
        tree = {}
        for child in self.root.children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    tree[child.pid] = child.create_time()
            except psutil.NoSuchProcess:
                pass
        return tree

    def note_healthy(self) -> None:
        tree = self.current()
        self.seen.update(tree)
        self.healthy_size = len(tree)

    def problems(self, within: float = 10.0) -> list[str]:
        """Orphans (seen before, out of the tree, still running) and a tree of the wrong size,
        after giving processes being stopped `within` seconds to go."""
        deadline = time.monotonic() + within
        while True:
            tree = self.current()
            self.seen.update(tree)
            orphans = [pid for pid, created in self.seen.items() if pid not in tree and _running(pid, created)]
            size_ok = len(tree) == self.healthy_size
            if (not orphans and size_ok) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        found = []
        if orphans:
            found.append("orphan process(es) outside the kernel's tree: " + ", ".join(
                f"{pid} {_describe(pid)}" for pid in orphans))
        if not size_ok:
            found.append(f"{len(tree)} processes under the kernel, a healthy cluster has {self.healthy_size}: "
                         + ", ".join(f"{pid} {_describe(pid)}" for pid in tree))
        for pid in [pid for pid in self.seen if pid not in tree and pid not in orphans]:
            del self.seen[pid]  # gone for good: forget it (its PID may be reused later)
        return found


def _running(pid: int, created: float) -> bool:
    try:
        process = psutil.Process(pid)
        return process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pid: int) -> str:
    try:
        return "(" + " ".join(psutil.Process(pid).cmdline()[-3:])[-80:] + ")"
    except psutil.Error:
        return "(gone)"
