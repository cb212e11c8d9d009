"""ipyparallel's controller, started as ``python -m nbdist.cluster.controller WORKDIR -- ARGS`` so
that it ends with the kernel, whose `kill -9` runs no cleanup: it and each process it forks poll
the kernel (no prctl, as ipykernel's ParentPollerUnix)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time

PARENT_POLL_SECONDS = 0.2
"""How often the controller's processes look whether the kernel that started it is still there."""


def controller_command(workdir: str) -> list[str]:
    """ipyparallel's `controller_cmd` for a cluster whose private directory is `workdir`."""
    return [sys.executable, "-m", __name__, workdir, "--"]


def _end_with_kernel(kernel: tuple[int, float], controller: int, workdir: str) -> None:
    """Once the kernel is gone, remove the private directory and end the controller's process
    group (it, its schedulers and heart monitor). Its forked processes watch as well: after the
    controller itself was killed, nothing else would end them."""
    from nbdist.worker.process_tree import exit_with_descendants, same_process

    while same_process(*kernel) is not None:
        time.sleep(PARENT_POLL_SECONDS)
    shutil.rmtree(workdir, ignore_errors=True)
    if os.getpgid(0) == controller:  # its own group (ipyparallel starts it in a new session)
        os.killpg(0, signal.SIGKILL)
    exit_with_descendants(grace=0.5)


def main() -> None:
    import psutil

    workdir = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[3:]]  # ipyparallel's arguments, after WORKDIR --
    kernel, controller = (os.getppid(), psutil.Process(os.getppid()).create_time()), os.getpid()

    def watch() -> None:
        threading.Thread(target=_end_with_kernel, args=(kernel, controller, workdir),
                         name="nbdist-end-with-kernel", daemon=True).start()

    watch()
    os.register_at_fork(after_in_child=watch)
    from ipyparallel.controller.app import main as controller_main

    controller_main()


if __name__ == "__main__":
    main()
