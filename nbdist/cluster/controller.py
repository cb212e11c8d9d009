"""The cluster's ipyparallel controller, started through this module so that it ends with the
notebook kernel: a `kill -9` of the kernel runs no cleanup there, and the controller would live on.

``python -m nbdist.cluster.controller WORKDIR -- CONTROLLER_ARGS``: a thread polls the parent
(the kernel; as ipykernel's ParentPollerUnix does, no prctl); once it is gone, the cluster's
private directory WORKDIR is removed and the controller's process group (it, its schedulers and
heart monitor) ends. Then ipyparallel's controller runs as `python -m ipyparallel.controller`
would.
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
    import psutil

    from nbdist.worker.process_tree import terminate_all

    shutil.rmtree(workdir, ignore_errors=True)
    if os.getpgid(0) == os.getpid():  # its own group (ipyparallel starts it in a new session)
        os.killpg(0, signal.SIGKILL)
    terminate_all([(os.getpid(), psutil.Process().create_time())], grace=0.5)


def main() -> None:
    split = sys.argv.index("--")
    workdir = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[split + 1:]]
    threading.Thread(target=_end_with, args=(os.getppid(), workdir),
                     name="nbdist-end-with-kernel", daemon=True).start()
    from ipyparallel.controller.app import main as controller_main

    controller_main()


if __name__ == "__main__":
    main()
