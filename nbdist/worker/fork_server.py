"""The fork server: one process that imports torch, ipyparallel's engine and nbdist's worker once,
then forks ready engines on request: a start or restart pays for those imports once, not per rank.

Run as ``python -m nbdist.worker.fork_server SOCKET``; `nbdist.cluster.fork_launcher` starts it and
asks it, over that Unix socket (in the cluster's private directory), for engines: one connection
per engine, one JSON line each way, then a last line when that engine exits.

- ``{"args": [...], "env": {...}, "cwd": "...", "log": "..."}`` -> ``{"pid": N}``
- then ``{"pid": N, "exit_code": CODE}`` once it exited (``-SIGNAL`` when killed, as `subprocess`
  says it), or ``{"error": "..."}`` instead of the pid

Fork safety: the server runs no thread of its own and never touches a device, so no CUDA context,
no thread pool and no lock held by another thread is copied into an engine; each engine picks its
GPU after the fork (`nbdist.worker.bootstrap`). The socket appears only once the imports are done:
a client that can connect is served at once.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Any

ENGINE_MODULE = "nbdist.worker.engine"
"""The module a forked engine runs as ``__main__``, as ``python -m nbdist.worker.engine`` does."""

_PRELOAD = (
    "torch", "torch.distributed", "numpy", "psutil", "zmq", "tornado.ioloop",
    "IPython.core.interactiveshell", "ipykernel.ipkernel", "ipyparallel.engine.app",
    "ipyparallel.engine.kernel", "ipyparallel.serialize", "nbdist.worker.release",
    "nbdist.worker.bootstrap",
)

REQUEST_TIMEOUT = 5.0
"""Seconds the server waits for a launcher's request once it connected (it sends it at once)."""


def preload() -> dict[str, str]:
    """Import what every engine needs; {module: error} for those that failed (an engine then
    imports them itself and reports the real error)."""
    import importlib

    failed = {}
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


class ForkServer:
    """The server's loop: fork an engine per connection, reap engines and tell each launcher."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.waiting: dict[int, socket.socket] = {}  # engine pid -> its launcher's connection
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def serve(self) -> None:
        # SIGCHLD only writes a byte to the wake-up pipe: the loop reaps, no handler runs code
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            selector.register(self.wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self.listener:
                        self._serve_one(selector)
                    else:
                        os.read(self.wake_r, 4096)
                        self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.waiting.pop(pid, None)
            if conn is not None:
                _send(conn, {"pid": pid, "exit_code": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _serve_one(self, selector: selectors.BaseSelector) -> None:
        conn, _addr = self.listener.accept()
        try:
            conn.settimeout(REQUEST_TIMEOUT)
            with conn.makefile("rb") as lines:
                request = json.loads(lines.readline())
            args = list(request["args"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _send(conn, {"error": f"bad request: {type(exc).__name__}: {exc}"})
            conn.close()
            return
        if args[1:3] != ["-m", ENGINE_MODULE]:
            _send(conn, {"error": f"the fork server only starts {ENGINE_MODULE} engines, "
                                  f"not {args[:3]}"})
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self._become_engine(request, conn, selector)  # never returns
        self.waiting[pid] = conn
        _send(conn, {"pid": pid})

    def _become_engine(self, request: dict[str, Any], conn: socket.socket,
                       selector: selectors.BaseSelector) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            selector.close()
            # a launcher must see its connection close when the server dies, engines or not
            for sock in (conn, self.listener, *self.waiting.values()):
                sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            _engine_process_setup(request)
            import runpy

            runpy.run_module(ENGINE_MODULE, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)


def _send(conn: socket.socket, reply: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:  # the launcher is gone: nobody to tell
        pass


def _engine_process_setup(request: dict[str, Any]) -> None:
    """What Popen would have done for a new engine: its own session (a stop button in the notebook
    never reaches it), stdin from /dev/null, stdout and stderr to its log, its directory, its
    environment, its argv; and fresh random state (a fork copies the server's)."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    os.chdir(request.get("cwd") or ".")
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["args"][0], *request["args"][3:]]
    if "numpy" in sys.modules:  # numpy seeded itself once, in the server: every engine would agree
        sys.modules["numpy"].random.seed()


def main() -> None:
    path = sys.argv[1]
    started = time.perf_counter()
    failed = preload()
    print(f"nbdist fork server {os.getpid()}: imports in {time.perf_counter() - started:.2f} s"
          + (f"; failed: {failed}" if failed else ""), flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # listen on a temporary name, then rename: a client that finds the socket can use it
    tmp = f"{path}.{os.getpid()}.tmp"
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    listener.listen(64)
    os.replace(tmp, path)
    ForkServer(listener).serve()


if __name__ == "__main__":
    main()
