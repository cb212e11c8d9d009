"""Release a rank whose main thread is blocked inside a collective, from another thread.

A rank blocked in C++ (a gloo barrier waiting for a peer that never comes) does not see SIGINT:
Python runs signal handlers only between bytecodes of the main thread. So an nbdist engine keeps
one more signal, ``RELEASE_SIGNAL`` (SIGUSR2), blocked in every thread but one that waits for it.
On that signal the thread makes the blocked collective fail:

- NCCL: ``_abort_process_group()``, which is what it is for; then the sockets of the group's
  gloo half (its CPU tensors), as below.
- gloo: its abort does not wake a waiting op (measured, torch 2.13), so the group's own connected
  sockets, recorded when the generation was created, are shut down; the op then fails with
  "Connection closed by peer". Listening sockets are left alone: gloo aborts the process if its
  listener breaks.

The group is broken afterwards; the notebook side rebuilds it (``nbdist.cells.faults``).

The same thread answers ``REPORT_SIGNAL``: the notebook asks where the rank is now (at a deadline,
the stop button), and a rank whose main thread is blocked still says so within milliseconds.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable

RELEASE_SIGNAL = signal.SIGUSR2

REPORT_SIGNAL = int(signal.SIGRTMIN) + 1
"""A real-time signal no library here uses (SIGUSR1 may be Slurm's warning before a job ends)."""

report_hook: Callable[[], None] | None = None
"""What the thread runs on REPORT_SIGNAL (the rank's telemetry says where it is)."""

_SIGNALS: set[int] = {RELEASE_SIGNAL, REPORT_SIGNAL}

INSTALLED = False
_GROUP_SOCKETS: dict[int, str] = {}  # fd -> inode name, so a reused fd is never touched


def install() -> None:
    """Call first thing in the engine's main thread, before any other thread starts: threads
    inherit the blocked mask, so only the waiting thread ever receives the signal."""
    global INSTALLED
    if INSTALLED or threading.active_count() > 1:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    os.register_at_fork(after_in_child=_unblock_in_child)
    threading.Thread(target=_wait_loop, name="nbdist-release", daemon=True).start()
    INSTALLED = True


def _unblock_in_child() -> None:
    # a forked child (a DataLoader worker) should not inherit signals nobody waits for
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def _wait_loop() -> None:
    while True:
        received = signal.sigwait(_SIGNALS)
        try:
            if received != REPORT_SIGNAL:
                release_now()
            elif report_hook is not None:
                report_hook()
        except Exception:  # never let the listener die: the next request must still work
            pass


def socket_fds() -> dict[int, str]:
    """This process's socket file descriptors and their inode names."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


def record_group_sockets(before: dict[int, str]) -> int:
    """After a generation is created: remember the sockets that appeared since `before`."""
    after = socket_fds()
    _GROUP_SOCKETS.update({fd: inode for fd, inode in after.items() if before.get(fd) != inode})
    return len(_GROUP_SOCKETS)


def watch_new_groups() -> None:
    """Record the sockets of every group created later too (``new_group``, a DeviceMesh's
    dimensions): a collective one member of a sub-group skips is released like the world's.
    Every way torch creates a group goes through this one private helper (torch 2.6 to 2.13)."""
    from torch.distributed import distributed_c10d

    create = distributed_c10d._new_process_group_helper
    if hasattr(create, "__nbdist_original__"):
        return

    def recorded(*args: object, **kwargs: object) -> object:
        before = socket_fds()
        group = create(*args, **kwargs)
        after = socket_fds()
        _GROUP_SOCKETS.update({fd: inode for fd, inode in after.items()
                               if before.get(fd) != inode})
        return group

    recorded.__nbdist_original__ = create  # type: ignore[attr-defined]
    distributed_c10d._new_process_group_helper = recorded


def forget_group_sockets() -> None:
    _GROUP_SOCKETS.clear()


def uses_nccl(backend: str) -> bool:
    """`backend` (as dist.get_backend() says it: "nccl", "cpu:gloo,cuda:nccl") runs NCCL."""
    return any(part.split(":")[-1].strip() == "nccl" for part in str(backend).split(","))


def release_now() -> int:
    """Make a collective blocked on this rank fail; returns how many sockets were shut down."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if dist.is_available() and dist.is_initialized() and uses_nccl(dist.get_backend()):
            # aborted first: NCCL's proxy must not see its sockets fail under a live communicator
            distributed_c10d._abort_process_group()
    except Exception:
        pass
    return shutdown_group_sockets()


def shutdown_group_sockets() -> int:
    """Shut down the current generation's connected sockets (not its listener). Peers blocked on
    this rank then fail at once, even while something (a DDP model, a traceback) still holds the
    group object and so keeps its sockets open."""
    closed = 0
    current = socket_fds()
    for fd, inode in sorted(_GROUP_SOCKETS.items()):
        if current.get(fd) != inode:  # closed since (the group was destroyed); fd may be reused
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the fd stays gloo's; it closes it when the group is destroyed
    return closed
