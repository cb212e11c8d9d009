"""The cluster's ipyparallel controller, started through this module so that it ends with the
notebook kernel: a `kill -9` of the kernel runs no cleanup there, and the controller would live on.

``python -m nbdist.cluster.controller WORKDIR [PID:CREATE_TIME ...] -- CONTROLLER_ARGS``: a thread
polls the parent (the kernel; as ipykernel's ParentPollerUnix does, no prctl); once it is gone,
the listed processes (the engines' fork server) are killed, the cluster's private directory
WORKDIR is removed and the controller's process group (it, its schedulers and heart monitor)
ends. Then ipyparallel's controller runs as `python -m ipyparallel.controller` would.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time

PARENT_POLL_SECONDS = 0.2
"""How often the controller looks whether the kernel that started it is still its parent."""

Pid = tuple[int, float]


def controller_command(workdir: str, also: list[Pid]) -> list[str]:
    """ipyparallel's `controller_cmd` for a cluster whose private directory is `workdir`; `also`:
    processes of the cluster that end with the kernel too but cannot see it go themselves."""
    return [sys.executable, "-m", __name__, workdir, *(f"{pid}:{ct!r}" for pid, ct in also), "--"]


def _end_with(parent: int, workdir: str, also: list[Pid]) -> None:
    while os.getppid() == parent:  # an orphan is adopted by init (or a subreaper)
        time.sleep(PARENT_POLL_SECONDS)
    import psutil

    from nbdist.worker.process_tree import same_process, terminate_all

    for pid, create_time in also:
        proc = same_process(pid, create_time)
        if proc is not None:
            proc.kill()
    shutil.rmtree(workdir, ignore_errors=True)
    if os.getpgid(0) == os.getpid():  # its own group (ipyparallel starts it in a new session)
        os.killpg(0, signal.SIGKILL)
    terminate_all([(os.getpid(), psutil.Process().create_time())], grace=0.5)


def main() -> None:
    split = sys.argv.index("--")
    workdir, *also = sys.argv[1:split]
    processes = [(int(pid), float(ct)) for pid, ct in (item.split(":") for item in also)]
    sys.argv = [sys.argv[0], *sys.argv[split + 1:]]
    threading.Thread(target=_end_with, args=(os.getppid(), workdir, processes),
                     name="nbdist-end-with-kernel", daemon=True).start()
    from ipyparallel.controller.app import main as controller_main

    controller_main()


if __name__ == "__main__":
    main()
