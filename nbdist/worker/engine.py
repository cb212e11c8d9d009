"""Entry point of an nbdist engine: an ipyparallel engine that imports torch on a thread while it
starts and registers (seconds saved). One forked by the fork server is set up by `ForkedEngine`."""

from __future__ import annotations

import contextlib
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

ENGINE_MODULE = "nbdist.worker.engine"  # what an engine runs as __main__, forked or not


def _preload() -> None:
    with contextlib.suppress(Exception):  # the bootstrap imports again and reports the error
        import torch.distributed  # noqa: F401


USER_UMASK_ENV = "NBDIST_USER_UMASK"
"""The notebook's umask (octal): nbdist starts engines under a private one (owner-only files,
`nbdist.cluster.processes.private_files`); the engine puts the user's back before any user code."""


def main() -> None:
    if umask := os.environ.pop(USER_UMASK_ENV, None):
        os.umask(int(umask, 8))
    release.install()  # first: before any thread starts (see nbdist.worker.release)
    # ipykernel imports debugpy (and pydevd: ~0.1 s of CPU per engine) for a debugger that
    # ipyparallel engines cannot use ("debugging will not be enabled"); it copes without it
    sys.modules.setdefault("debugpy", None)  # type: ignore[assignment]
    # a segfault's Python stack goes to the engine log, which nbdist shows: ipykernel later
    # points fd 2 at a pipe whose reader thread dies with the process, so to a copy of fd 2
    # (faulthandler holds the file, which keeps it open)
    faulthandler.enable(file=os.fdopen(os.dup(2), "w"))
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
            import warnings

            # the server imported this module to unpickle this object: running it again as
            # __main__ is meant, not the accident runpy warns of in the engine's log (which a
            # dead rank's report shows)
            warnings.filterwarnings("ignore", f"'{ENGINE_MODULE}' found in sys.modules",
                                    RuntimeWarning)
            runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
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
