"""The fork server: one process that imports torch, ipyparallel's engine and nbdist's worker once,
then forks ready engines on request, so a start or restart pays for those imports once, not per rank.

Run as ``python -m nbdist.worker.fork_server SOCKET``; `nbdist.cluster.fork_launcher` starts it and
asks it, over that Unix socket (in the cluster's private directory), for engines. One JSON line a
request, one a reply:

- ``{"op": "fork", "args": [...], "env": {...}, "cwd": "...", "log": "..."}`` -> ``{"pid": N}``
- ``{"op": "wait", "pid": N}`` -> ``{"pid": N, "exit_code": CODE}`` once that engine exited
  (``-SIGNAL`` when killed, as `subprocess` says it)

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
import threading
import time
import traceback
from typing import Any

ENGINE_MODULE = "nbdist.worker.engine"
"""The module a forked engine runs as ``__main__`` (what ``python -m nbdist.worker.engine`` runs)."""

_PRELOAD = (
    "torch", "torch.distributed", "numpy", "psutil", "zmq", "tornado.ioloop",
    "IPython.core.interactiveshell", "ipykernel.ipkernel", "ipyparallel.engine.app",
    "ipyparallel.engine.kernel", "ipyparallel.serialize", "nbdist.worker.release",
    "nbdist.worker.bootstrap",
)


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
    """The server's loop: accept requests, fork engines, reap them and answer who waits for one."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytes] = {}
        self.exited: dict[int, int] = {}
        self.children: set[int] = set()
        self.waiters: dict[int, list[socket.socket]] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def serve(self) -> None:
        # SIGCHLD only writes a byte to the wake-up pipe: the loop reaps, no handler runs code
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.listener:
                    conn, _addr = self.listener.accept()
                    self.buffers[conn] = b""
                    self.selector.register(conn, selectors.EVENT_READ)
                elif key.fileobj == self.wake_r:
                    self._drain_wake_pipe()
                    self._reap()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.exited[pid] = os.waitstatus_to_exitcode(status)
            for conn in self.waiters.pop(pid, []):
                self._reply(conn, {"pid": pid, "exit_code": self.exited[pid]})

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        self.buffers[conn] += data
        while b"\n" in self.buffers.get(conn, b""):
            line, self.buffers[conn] = self.buffers[conn].split(b"\n", 1)
            self._handle(conn, json.loads(line))

    def _handle(self, conn: socket.socket, request: dict[str, Any]) -> None:
        op = request.get("op")
        if op == "fork":
            self._reply(conn, self._fork(request))
        elif op == "wait":
            pid = int(request["pid"])
            if pid in self.exited:
                self._reply(conn, {"pid": pid, "exit_code": self.exited[pid]})
            elif pid in self.children:
                self.waiters.setdefault(pid, []).append(conn)
            else:
                self._reply(conn, {"pid": pid, "error": "not an engine of this fork server"})
        elif op == "ping":  # also what a test checks: nothing fork-unsafe was started here
            torch = sys.modules.get("torch")
            cuda = bool(torch is not None and torch.cuda.is_initialized())
            self._reply(conn, {"pid": os.getpid(), "engines": sorted(self.children),
                               "python_threads": threading.active_count(), "cuda_initialized": cuda})
        else:
            self._reply(conn, {"error": f"unknown request {op!r}"})

    def _fork(self, request: dict[str, Any]) -> dict[str, Any]:
        args = list(request["args"])
        if args[1:3] != ["-m", ENGINE_MODULE]:
            return {"error": f"the fork server only starts {ENGINE_MODULE} engines, not {args[:3]}"}
        pid = os.fork()
        if pid == 0:
            self._become_engine(request)  # never returns
        self.children.add(pid)
        return {"pid": pid}

    def _become_engine(self, request: dict[str, Any]) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.selector.close()
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            for conn in list(self.buffers):
                conn.close()
            self.listener.close()
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

    def _reply(self, conn: socket.socket, reply: dict[str, Any]) -> None:
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        if conn in self.buffers:
            del self.buffers[conn]
            self.selector.unregister(conn)
        for waiting in self.waiters.values():
            if conn in waiting:
                waiting.remove(conn)
        conn.close()


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
