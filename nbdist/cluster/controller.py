"""The cluster's ipyparallel controller, started through this module so that it ends with the
notebook kernel: a `kill -9` of the kernel runs no cleanup there, and the controller would live on.

``python -m nbdist.cluster.controller WORKDIR -- CONTROLLER_ARGS``: a thread polls the parent
(the kernel; as ipykernel's ParentPollerUnix does, no prctl); once it is gone, the cluster's
private directory WORKDIR is removed and the controller's process group (it, its schedulers and
heart monitor) ends. Each process the controller forks watches the kernel as well: after the
controller itself was killed, nothing else would end it. Then ipyparallel's controller runs as
`python -m ipyparallel.controller` would.
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

def controller_command(workdir: str) -> list[str]:
    """ipyparallel's `controller_cmd` for a cluster whose private directory is `workdir`."""
    return [sys.executable, "-m", __name__, workdir, "--"]


def _end_with(parent: int, workdir: str) -> None:
    while os.getppid() == parent:  # an orphan is adopted by init (or a subreaper)
        time.sleep(PARENT_POLL_SECONDS)
    from nbdist.worker.process_tree import exit_with_descendants

    shutil.rmtree(workdir, ignore_errors=True)
    if os.getpgid(0) == os.getpid():  # its own group (ipyparallel starts it in a new session)
        os.killpg(0, signal.SIGKILL)
    exit_with_descendants(grace=0.5)


def _child_ends_with(kernel: int, kernel_created: float) -> None:
    """In a process the controller forks (a scheduler, the heart monitor): once the kernel is
    gone, end. Its own watch: a controller killed first leaves it to no one."""
    from nbdist.worker.process_tree import same_process

    while same_process(kernel, kernel_created) is not None:
        time.sleep(PARENT_POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    import psutil

    split = sys.argv.index("--")
    workdir = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[split + 1:]]
    kernel = os.getppid()
    threading.Thread(target=_end_with, args=(kernel, workdir),
                     name="nbdist-end-with-kernel", daemon=True).start()
    kernel_created = psutil.Process(kernel).create_time()
    os.register_at_fork(after_in_child=lambda: threading.Thread(
        target=_child_ends_with, args=(kernel, kernel_created),
        name="nbdist-end-with-kernel", daemon=True).start())
    from ipyparallel.controller.app import main as controller_main

    controller_main()


if __name__ == "__main__":
    main()
