"""Entry point of an nbdist engine: an ordinary ipyparallel engine that imports torch meanwhile.

Importing torch takes seconds; starting it on a thread lets it overlap with the engine's own
start-up and registration, so the rank bootstrap finds it already loaded.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

from nbdist.worker import release


def _preload() -> None:
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except Exception:  # the bootstrap imports again and reports the real error
        pass


_CRASH_LOG = None

USER_UMASK_ENV = "NBDIST_USER_UMASK"
"""The notebook's umask (octal): nbdist starts engines under a private one (owner-only files,
`nbdist.cluster.processes.private_files`); the engine puts the user's back before any user code."""


def _restore_user_umask() -> None:
    value = os.environ.pop(USER_UMASK_ENV, None)
    if value:
        os.umask(int(value, 8))


def main() -> None:
    # a segfault or abort then leaves a Python stack in the engine log, which nbdist shows
    # ipykernel later points fd 2 at a pipe that a thread forwards to the notebook; that thread
    # dies with the process, so write crash stacks to a duplicate of the real stderr (the log)
    global _CRASH_LOG
    _restore_user_umask()
    release.install()  # first: before any thread starts (see nbdist.worker.release)
    # ipykernel imports debugpy (and pydevd: ~0.1 s of CPU per engine) for a debugger that
    # ipyparallel engines cannot use ("debugging will not be enabled"); it copes without it
    sys.modules.setdefault("debugpy", None)  # type: ignore[assignment]
    _CRASH_LOG = os.fdopen(os.dup(2), "w")
    faulthandler.enable(file=_CRASH_LOG)
    threading.Thread(target=_preload, name="nbdist-preload", daemon=True).start()
    from ipyparallel.engine.app import main as engine_main

    engine_main()


if __name__ == "__main__":
    main()
