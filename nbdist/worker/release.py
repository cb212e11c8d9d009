"""Release a rank whose main thread is blocked in a collective, and say where it is. Python runs
signal handlers only between the main thread's bytecodes (a rank blocked in C++ never sees SIGINT):
two more signals are blocked in every thread but one that waits for them."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

# fail the blocked collective (`release_now`); the group is broken afterwards, the notebook
# rebuilds it
RELEASE_SIGNAL = signal.SIGUSR2

# say where the rank is now (`report_hook`): no library here uses it (SIGUSR1 may be Slurm's
# warning before a job ends)
REPORT_SIGNAL = int(signal.SIGRTMIN) + 1

report_hook: Callable[[], None] | None = None

_SIGNALS: set[int] = {RELEASE_SIGNAL, REPORT_SIGNAL}

INSTALLED = False
GROUP_SOCKETS: dict[int, str] = {}  # fd -> inode name, so a reused fd is never touched

# seconds an NCCL abort may take (NbdistConfig.teardown_grace, set at set-up): torch's own waits
# up to the group's timeout (1800 s on NCCL) for ncclCommAbort
ABORT_TIMEOUT = 3.0

# time.time() of nbdist's last abort of this rank's NCCL communicators: a sync the abort ended
# (`x.item()` after the collective) returns whatever the buffer held, and raises nothing
NCCL_ABORTED_AT = 0.0


def install() -> None:
    """Call first thing in the engine's main thread: threads inherit the blocked mask."""
    global INSTALLED
    if INSTALLED or threading.active_count() > 1:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    # a forked child (a DataLoader worker) should not inherit signals nobody waits for
    os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS))
    threading.Thread(target=_wait_loop, name="nbdist-release", daemon=True).start()
    INSTALLED = True


def _wait_loop() -> None:
    while True:
        received = signal.sigwait(_SIGNALS)
        # never let the listener die: the next request must still work
        with contextlib.suppress(Exception):
            if received != REPORT_SIGNAL:
                release_now()
            elif report_hook is not None:
                report_hook()


def socket_fds() -> dict[int, str]:
    found: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:"):
                found[int(name)] = link
    return found


@contextlib.contextmanager
def recording_sockets() -> Iterator[None]:
    """Remember the sockets a group's creation (and first collective) opened."""
    before = socket_fds()
    yield
    after = socket_fds()
    GROUP_SOCKETS.update({fd: inode for fd, inode in after.items() if before.get(fd) != inode})


def watch_new_groups() -> None:
    """Record the sockets of every group created later too (``new_group``, a DeviceMesh's): torch
    creates every group through this one private helper (torch 2.6 to 2.13)."""
    from torch.distributed import distributed_c10d

    create = distributed_c10d._new_process_group_helper
    if not hasattr(create, "__nbdist_original__"):
        recorded = recording_sockets()(create)  # a fresh context per call (ContextDecorator)
        recorded.__nbdist_original__ = create  # type: ignore[attr-defined]
        distributed_c10d._new_process_group_helper = recorded


def uses_nccl(backend: str) -> bool:
    """`backend` as dist.get_backend() says it ("nccl", "cpu:gloo,cuda:nccl") runs NCCL."""
    return any(part.split(":")[-1].strip() == "nccl" for part in str(backend).split(","))


def release_now() -> bool:
    """Make a collective blocked on this rank fail: NCCL's communicators aborted, then the groups'
    sockets shut down (gloo's abort does not wake a waiting op). False if NCCL's abort did not
    finish within `ABORT_TIMEOUT`."""
    import torch.distributed as dist

    aborted = True
    with contextlib.suppress(Exception):
        if dist.is_initialized() and uses_nccl(dist.get_backend()):
            # aborted first: NCCL's proxy must not see its sockets fail under a live communicator
            aborted = abort_nccl(ABORT_TIMEOUT)
    shutdown_group_sockets()
    return aborted


def abort_nccl(seconds: float) -> bool:
    """Abort every group's NCCL communicators (torch's abort of the world aborts them all, within
    one NCCL group call), waiting at most `seconds`. Each NCCL backend's timeout, which torch's
    abort waits for, is cut to `seconds` first; the abort runs on a thread of its own, so a
    communicator whose abort hangs costs that thread, not the caller."""
    import torch
    from torch.distributed import distributed_c10d

    global NCCL_ABORTED_AT
    NCCL_ABORTED_AT = time.time()
    for group in list(distributed_c10d._world.pg_map):
        with contextlib.suppress(Exception):  # no CUDA backend: nothing of it to abort
            group._get_backend(torch.device("cuda")).set_timeout(
                datetime.timedelta(seconds=seconds))
    done = threading.Event()

    def abort() -> None:
        try:
            with contextlib.suppress(Exception):  # a group already broken can fail to abort
                distributed_c10d._abort_process_group()
        finally:
            done.set()

    threading.Thread(target=abort, name="nbdist-nccl-abort", daemon=True).start()
    return done.wait(seconds + 1.0)


def shutdown_group_sockets() -> None:
    """Shut down the groups' connected sockets (never a listener: gloo ends the process if its
    listener breaks), so peers fail even while a DDP model or a traceback holds the group."""
    current = socket_fds()
    for fd, inode in sorted(GROUP_SOCKETS.items()):
        if current.get(fd) != inode:  # closed since (the group was destroyed); fd may be reused
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()  # the fd stays gloo's; it closes it when the group is destroyed
