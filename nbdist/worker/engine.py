"""Entry point of an nbdist engine: an ordinary ipyparallel engine that imports torch meanwhile.

Importing torch takes seconds; starting it on a thread lets it overlap with the engine's own
start-up and registration, so the rank bootstrap finds it already loaded. A local engine forked
from the cluster's fork server starts as a `ForkedEngine`, which sets it up as Popen would have.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from dataclasses import dataclass

from nbdist import ipp_compat
from nbdist.worker import release

FORK_PRELOAD = [
    "torch", "torch.distributed", "numpy", "psutil", "zmq", "tornado.ioloop",
    "IPython.core.interactiveshell", "ipykernel.ipkernel", "ipyparallel.engine.app",
    "ipyparallel.engine.kernel", "ipyparallel.serialize", "nbdist.worker.release",
    "nbdist.worker.bootstrap", "nbdist.worker.engine",
]
"""What the fork server imports once, so that every engine forked from it finds it loaded."""

ENGINE_MODULE = "nbdist.worker.engine"
"""The module an engine runs as ``__main__`` (``python -m nbdist.worker.engine``), forked or not."""


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


@dataclass(frozen=True)
class ForkedEngine(ipp_compat.ForkserverChild):
    """An engine the fork server forks: what Popen would have given it (argv, environment,
    directory, log), applied in the child before the engine runs."""

    args: list[str]
    env: dict[str, str]
    cwd: str
    log: str

    def run(self) -> int:
        code = 1
        try:
            self._become_engine()
            import runpy

            runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
        return code

    def _become_engine(self) -> None:
        # its own session: a stop button in the notebook never reaches it
        os.setsid()
        log = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.chdir(self.cwd or ".")
        os.environ.clear()
        os.environ.update(self.env)
        sys.argv = [self.args[0], *self.args[3:]]
        if "numpy" in sys.modules:  # seeded once, in the server: every engine would draw alike
            sys.modules["numpy"].random.seed()


if __name__ == "__main__":
    main()
