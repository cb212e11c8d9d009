"""Local engines forked from the standard library's forkserver (through `nbdist.ipp_compat`),
one per cluster with its own socket, log and preload list, as ipyparallel launcher classes; an
engine the server cannot fork starts cold and says why (`fallback_reason`)."""

from __future__ import annotations

import os
import select
import socket
import subprocess
from typing import Any

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Float, Unicode

from nbdist import ipp_compat
from nbdist.text import tail
from nbdist.worker.engine import ENGINE_MODULE, FORK_PRELOAD, ForkedEngine

SET_LAUNCHER = "nbdist.cluster.fork_launcher.ForkEngineSetLauncher"  # engine_launcher_class
POLL_SECONDS = 0.5  # how often an engine's wait thread looks whether the cluster stopped waiting
_REAP_SECONDS = 5.0  # how long a stopped cluster waits for its fork server to exit


class ForkServerUnavailable(Exception):
    """The fork server cannot fork an engine (gone, or not asked for one); the text says why."""


def fork(address: str, engine: ForkedEngine, timeout: float) -> tuple[int, int]:
    """Ask the fork server at `address` for an engine (waiting up to `timeout` while it imports):
    a pipe that reads how the engine ended (`ipp_compat.forkserver_exit_code`), and its PID."""
    if engine.args[1:3] != ["-m", ENGINE_MODULE]:
        raise ForkServerUnavailable(f"the fork server only starts {ENGINE_MODULE} engines, "
                                    f"not {engine.args[:3]}")
    try:
        return ipp_compat.forkserver_fork(address, engine, timeout)
    except (ConnectionRefusedError, FileNotFoundError, EOFError) as exc:
        raise ForkServerUnavailable(f"the fork server at {address} is gone "
                                    f"({type(exc).__name__})") from None


class ForkEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the fork server; a cold start when the server cannot fork it."""

    fork_socket = Unicode("", config=True, help="The fork server's Unix socket.")
    fork_timeout = Float(90.0, config=True, help="Seconds to wait for the fork server to fork.")
    fallback_reason = ""  # why this engine was started cold instead of forked
    _status: int | None = None  # the pipe the server writes the engine's exit code to

    def start(self) -> None:
        env = {**os.environ, **self.get_env()}
        engine = ForkedEngine(list(self.args), env, self.work_dir, self.output_file)
        try:
            self._status, self.pid = fork(self.fork_socket, engine, self.fork_timeout)
        except (ForkServerUnavailable, OSError, ValueError) as exc:
            self.fallback_reason = str(exc)
            super().start()
            return
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()

    def _wait(self) -> None:
        if self._status is None:
            super()._wait()
            return
        exit_code: Any = None
        try:
            while not self._stop_waiting.is_set():  # woken to see _stop_waiting
                if select.select([self._status], [], [], POLL_SECONDS)[0]:
                    exit_code = ipp_compat.forkserver_exit_code(self._status)
                    break
        except (EOFError, OSError):
            exit_code = self._wait_by_polling()  # the server is gone: no status to be had
        finally:
            os.close(self._status)
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
    """Local engines forked by the fork server (`ForkEngineLauncher.fork_socket`, in the config)."""

    launcher_class = ForkEngineLauncher
    # ipyparallel waits 0.1 s between engines; a fork takes ms and nbdist orders the ranks itself
    delay = Float(0.0, config=True, help="Seconds between forking two engines of the set.")


class ForkServerProcess:
    """One fork server: kept across restarts, stopped by PID with the cluster, and ending by
    itself with the kernel (its alive pipe reads EOF)."""

    def __init__(self, workdir: str, python: str) -> None:
        """Start the server; returns at once (it imports torch meanwhile)."""
        self.socket_path = os.path.join(workdir, "fork-server.sock")
        self.log_path = os.path.join(workdir, "fork-server.log")
        # the server exits once this pipe reads EOF: when the cluster stops or the kernel dies
        alive_r, alive_w = os.pipe()
        self._alive_w: int | None = alive_w
        with socket.socket(socket.AF_UNIX) as listener, open(self.log_path, "ab") as log, \
                open(os.devnull, "rb") as stdin:
            listener.bind(self.socket_path)
            listener.listen()
            command = ipp_compat.forkserver_command(python, listener.fileno(), alive_r,
                                                    FORK_PRELOAD)
            try:
                self.process = subprocess.Popen(
                    command, pass_fds=(listener.fileno(), alive_r), stdout=log,
                    stderr=subprocess.STDOUT, stdin=stdin, start_new_session=True)
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        self.pid = self.process.pid
        self.create_time = psutil.Process(self.pid).create_time()  # unreaped: it is our child

    def alive(self) -> bool:
        return self.process.poll() is None

    def why_gone(self) -> str:
        """Why the server, gone, cannot fork: how it exited and the end of its log."""
        code = self.process.poll() or 0
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        try:
            with open(self.log_path, errors="replace") as f:
                log = tail(f.read(), 10)
        except OSError:
            log = ""
        return f"the fork server (pid {self.pid}) {how}" + (f":\n{log}" if log.strip() else "")

    def reap(self) -> None:
        """Let the server go, if it still runs, and collect its exit status (no zombie left)."""
        if self._alive_w is not None:
            os.close(self._alive_w)
            self._alive_w = None
        try:
            self.process.wait(timeout=_REAP_SECONDS)
        except subprocess.TimeoutExpired:  # still importing: it reads that pipe only afterwards
            self.process.kill()
            self.process.wait()
