"""Local engines forked from a warm server (`nbdist.worker.fork_server`) instead of started cold,
as ipyparallel launcher classes: `ForkEngineSetLauncher` is a `LocalEngineSetLauncher` whose
engines are forked, so ipyparallel's Cluster, its engine sets and nbdist's PID handling stay.

`ForkServerProcess` is the kernel's handle on the server: started beside the controller, kept
across restarts, stopped by PID with the rest of the cluster. When the server is gone, an engine
launcher says why (`fallback_reason`) and starts its engine cold, as `LocalEngineLauncher` would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
from ipyparallel.cluster.launcher import (
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    ProcessStateError,
)
from traitlets import Float, Unicode
from traitlets.config import Config

from nbdist.cluster.processes import private_files
from nbdist.text import tail

SET_LAUNCHER = "nbdist.cluster.fork_launcher.ForkEngineSetLauncher"
"""The `engine_launcher_class` a local cluster with a fork server gives ipyparallel."""

POLL_SECONDS = 0.5
"""How often an engine's wait thread looks whether the cluster stopped waiting for it."""


class ForkServerUnavailable(Exception):
    """The fork server cannot fork an engine (gone, or it refused); the text says why."""


def fork(path: str, request: dict[str, Any], timeout: float,
         unread: bytearray) -> tuple[socket.socket, int]:
    """Ask the fork server at `path` for an engine (waiting up to `timeout` for it to listen):
    the connection, whose next line says how the engine ended, and the engine's PID."""
    conn = _connect(path, timeout)
    try:
        conn.settimeout(timeout)
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply = _read_line(conn, unread)
        assert reply is not None  # only a stop event makes it None
        if "error" in reply:
            raise ForkServerUnavailable(f"the fork server refused: {reply['error']}")
        return conn, int(reply["pid"])
    except BaseException:
        conn.close()
        raise


def _connect(path: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except OSError as exc:
            conn.close()
            if isinstance(exc, ConnectionRefusedError):  # the socket appears once it listens
                raise ForkServerUnavailable(f"the fork server at {path} is gone (connection "
                                            "refused)") from None
            if time.monotonic() > deadline:
                raise ForkServerUnavailable(f"no fork server listening at {path} ({exc})") from None
            if not os.path.exists(os.path.dirname(path)):
                raise ForkServerUnavailable(
                    f"the fork server's directory {os.path.dirname(path)} is gone") from None
            time.sleep(0.01)


def _read_line(conn: socket.socket, unread: bytearray,
               stop: threading.Event | None = None) -> dict[str, Any] | None:
    """One JSON line from the server; what came after it stays in `unread` for the next read.
    With `stop` (and a timeout on `conn`), None once `stop` is set; without, the timeout raises."""
    while b"\n" not in unread:
        if stop is not None and stop.is_set():
            return None
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            if stop is None:
                raise
            continue
        if not chunk:
            raise ForkServerUnavailable("the fork server closed the connection (it exited)")
        unread += chunk
    line, _, rest = bytes(unread).partition(b"\n")
    unread[:] = rest
    result: dict[str, Any] = json.loads(line)
    return result


class ForkEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the fork server; a cold start when the server cannot fork it."""

    fork_socket = Unicode("", config=True, help="The fork server's Unix socket.")
    fork_timeout = Float(90.0, config=True, help="Seconds to wait for the fork server to listen.")
    fallback_reason = ""
    """Why this engine was started cold instead of forked ('' when it was forked)."""
    _conn: socket.socket | None = None  # to the server while the engine lives

    def start(self) -> None:
        if self.state != "before":
            raise ProcessStateError(f"The process was already started and has state: {self.state}")
        env = os.environ.copy()
        env.update(self.get_env())
        request = {"args": list(self.args), "env": env, "cwd": self.work_dir,
                   "log": self.output_file}
        self._unread = bytearray()
        try:
            if not self.fork_socket:
                raise ForkServerUnavailable("no fork server was started for this cluster")
            self._conn, self.pid = fork(self.fork_socket, request, self.fork_timeout, self._unread)
        except (ForkServerUnavailable, OSError, ValueError) as exc:
            self.fallback_reason = str(exc)
            super().start()
            return
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()

    def _wait(self) -> None:
        if self._conn is None:
            super()._wait()
            return
        exit_code: Any = None
        try:
            self._conn.settimeout(POLL_SECONDS)  # wakes the wait to see _stop_waiting
            reply = _read_line(self._conn, self._unread, stop=self._stop_waiting)
            exit_code = reply["exit_code"] if reply is not None else None
        except (ForkServerUnavailable, OSError, ValueError):
            exit_code = self._wait_by_polling()  # the server is gone: no status to be had
        finally:
            self._conn.close()
        stop_data = {"exit_code": exit_code, "pid": self.pid, "identifier": self.identifier}
        self.loop.add_callback(lambda: self.notify_stop(stop_data))

    def _wait_by_polling(self) -> Any:
        # not our child, and its parent (the server) is gone: it ends as init's zombie, which an
        # init that never reaps (a container's sleep) keeps forever. A zombie has exited.
        while not self._stop_waiting.wait(POLL_SECONDS):
            try:
                if self.process.status() == psutil.STATUS_ZOMBIE:
                    return "unknown"
            except psutil.NoSuchProcess:
                return "unknown"
        return None


class ForkEngineSetLauncher(LocalEngineSetLauncher):
    """A set of local engines forked by the fork server (see `ForkEngineLauncher`; its traits,
    `ForkEngineLauncher.fork_socket` above all, come through the config)."""

    launcher_class = ForkEngineLauncher
    # ipyparallel sleeps this long between two engines of a set (0.1 s: 0.3 s of every start
    # and restart of 4 ranks); a fork takes milliseconds and nbdist orders the ranks itself
    delay = Float(0.0, config=True, help="Seconds between forking two engines of the set.")


class ForkServerProcess:
    """The kernel's handle on one fork server it started: its process, socket and log."""

    def __init__(self, workdir: str, python: str) -> None:
        """Start the server; returns at once (it imports torch meanwhile)."""
        self.socket_path = os.path.join(workdir, "fork-server.sock")
        self.log_path = os.path.join(workdir, "fork-server.log")
        with open(self.log_path, "ab") as log, open(os.devnull, "rb") as stdin:
            self.process = subprocess.Popen(
                [python, "-m", "nbdist.worker.fork_server", self.socket_path],
                stdout=log, stderr=subprocess.STDOUT, stdin=stdin, start_new_session=True)
        self.pid = self.process.pid
        try:
            self.create_time = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            self.create_time = 0.0

    def owned(self) -> list[tuple[int, float]]:
        """The server as a (pid, create time) record for the cluster's pid file."""
        return [(self.pid, self.create_time)]

    def alive(self) -> bool:
        return self.process.poll() is None

    def why_gone(self) -> str:
        """Why the server cannot fork ('' while it runs): how it exited and the end of its log."""
        code = self.process.poll()
        if code is None:
            return ""
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        try:
            with open(self.log_path, errors="replace") as f:
                log = tail(f.read(), 10)
        except OSError:
            log = ""
        return f"the fork server (pid {self.pid}) {how}" + (f":\n{log}" if log.strip() else "")

    def reap(self) -> None:
        """Collect the server's exit status once it is stopped (no zombie left)."""
        self.process.poll()


def start_fork_server(config: Config, workdir: str, wait: float) -> ForkServerProcess:
    """Start a fork server for a local cluster (with the engines' Python) and point the engine
    launchers of `config` at it; returns at once."""
    engine_set = config.LocalEngineSetLauncher
    python = engine_set.engine_cmd[0] if "engine_cmd" in engine_set else sys.executable
    with private_files():  # its log and socket: owner only
        server = ForkServerProcess(workdir, python)
    config.ForkEngineLauncher.fork_socket = server.socket_path
    config.ForkEngineLauncher.fork_timeout = wait
    return server
