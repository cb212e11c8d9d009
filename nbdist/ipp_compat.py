"""Every use nbdist makes of ipyparallel's, ipykernel's or IPython's private attributes, and of
the standard library forkserver's undocumented protocol (`multiprocessing.forkserver.main`).

Each function names what it relies on and what happens when a release drops it. One use lives
elsewhere because it is a subclass: `cluster/fork_launcher.ForkEngineLauncher` overrides
`LocalProcessLauncher._wait` (started by `_start_waiting`, stopped by `_stop_waiting`).
tests/test_ipp_compat.py checks each one against the installed versions, and pyproject.toml caps
those packages at the versions checked.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

# ---------------------------------------------------------------- ipykernel, inside an engine


def iopub_thread() -> Any:
    """The engine's `IOPubThread`: ipykernel's `OutStream.pub_thread`, every publisher's way out."""
    return sys.stdout.pub_thread


def divert_iopub(iopub: Any, send: Callable[..., None]) -> None:
    """Route every IOPub message through `send`: an instance attribute shadows the class's
    `send_multipart` (`IOPubThread.send_multipart`, what `Session.send` calls)."""
    iopub.send_multipart = send


def restore_iopub(iopub: Any) -> None:
    iopub.__dict__.pop("send_multipart", None)


def iopub_send(iopub: Any, parts: list[Any], *args: Any, **kwargs: Any) -> None:
    """The class's own send, for what `divert_iopub`'s `send` passes on unchanged."""
    type(iopub).send_multipart(iopub, parts, *args, **kwargs)


# ---------------------------------------------------------------- IPython's shell


def skip_stored_tracebacks(shell: Any, store: Callable[..., dict[str, Any]]) -> None:
    """IPython's history keeps a second rendering of every error (`_format_exception_for_storage`);
    an engine never reads it."""
    shell._format_exception_for_storage = store


def show_traceback(shell: Any, etype: type, value: BaseException, stb: list[str]) -> None:
    """`InteractiveShell._showtraceback`: where ipykernel takes the error reply's traceback."""
    shell._showtraceback(etype, value, stb)


def forget_last_traceback(shell: Any) -> None:
    """IPython 9 keeps the last traceback (`_last_traceback`) besides `sys.last_traceback`."""
    if hasattr(shell, "_last_traceback"):
        shell._last_traceback = None


# ---------------------------------------------------------------- ipyparallel, in the notebook


def end_wait_threads(launchers: list[Any], owned: list[Any], timeout: float) -> None:
    """Stop ipyparallel's per-process wait threads (`_stop_waiting`, `_wait_thread`), which
    otherwise outlive a Cluster, then join those of the launchers we own."""
    import time

    for launcher in launchers:
        if hasattr(launcher, "_stop_waiting"):
            launcher._stop_waiting.set()
    deadline = time.monotonic() + timeout
    for launcher in owned:
        thread = getattr(launcher, "_wait_thread", None)
        if thread is not None:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def end_loop_thread(ipp: Any, timeout: float) -> None:
    """ipyparallel runs a Cluster's coroutines on a thread of its own (`_async_thread`,
    `_thread_loop`) when the caller has a running loop (a kernel always has) and never ends it."""
    thread = getattr(ipp, "_async_thread", None)
    loop = getattr(ipp, "_thread_loop", None)
    if thread is None or loop is None:
        return
    loop.add_callback(loop.stop)
    thread.join(timeout=timeout)
    if not thread.is_alive():
        loop.close(all_fds=False)


def run_wait_callbacks_at_once(launcher: Any) -> None:
    """A launcher's wait thread reaps its process but hands the exit status to `loop.add_callback`
    of an event loop a notebook kernel does not run, so `on_stop` never fires: run those hand-offs
    at once when they come from a wait thread (named ``wait(pid=N)`` by ipyparallel)."""
    loop = launcher.loop
    if getattr(loop, "_nbdist_wait_passthrough", False):
        return
    original = loop.add_callback

    def add_callback(callback: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.startswith("wait(pid="):
            try:
                callback(*args, **kwargs)
                return
            except Exception:
                pass
        original(callback, *args, **kwargs)

    loop.add_callback = add_callback
    loop._nbdist_wait_passthrough = True


def client_connection(client: Any) -> dict[str, Any]:
    """The connection info a Client was made from (`_config`: interface, location)."""
    return getattr(client, "_config", {}) or {}


def on_unregistration(client: Any, handler: Callable[[int], None]) -> bool:
    """Call `handler(engine_id)` when the controller drops an engine, before ipyparallel turns
    its task into an EngineError (`_notification_handlers`). False when the hook is gone."""
    handlers = getattr(client, "_notification_handlers", None)
    if not isinstance(handlers, dict) or "unregistration_notification" not in handlers:
        return False
    original = handlers["unregistration_notification"]

    def on_unregister(msg: Any) -> None:
        try:
            handler(int(msg["content"]["id"]))
        except Exception:
            pass
        original(msg)

    handlers["unregistration_notification"] = on_unregister
    return True


# ---------------------------------------------------------------- the standard library's forkserver


def forkserver_command(python: str, listener_fd: int, alive_fd: int,
                       preload: list[str]) -> list[str]:
    """A process that runs `multiprocessing.forkserver.main`: it imports `preload`, forks a child
    per connection to the listening socket and exits once `alive_fd` (a pipe) reads EOF."""
    main = f"main({listener_fd}, {alive_fd}, {preload!r})"
    return [python, "-c", f"from multiprocessing.forkserver import main; {main}"]


class ForkserverChild:
    """What a process the forkserver forks runs: `run`, whose return value is its exit code."""

    def run(self) -> int:
        raise NotImplementedError

    def _bootstrap(self, parent_sentinel: int) -> int:
        """What `multiprocessing.spawn._main` calls in the child once it unpickled this."""
        os.close(parent_sentinel)  # a copy of the data pipe, read already
        forget_forkserver_fds()
        return self.run()


def forkserver_fork(address: str, child: ForkserverChild, timeout: float) -> tuple[int, int]:
    """Have the forkserver at `address` fork a process that runs `child`: a pipe that reads its
    exit code (`forkserver_exit_code`) once it exited, and its PID."""
    import pickle
    import select
    import socket
    from multiprocessing import forkserver, reduction

    parent_r, child_w = os.pipe()
    child_r, parent_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX) as client, open(os.devnull, "rb") as nothing:
            client.settimeout(timeout)
            client.connect(address)
            # the server's alive pipe and a resource tracker's are the kernel's own: the child
            # gets /dev/null in their places (`forget_forkserver_fds`)
            reduction.sendfds(client, [child_r, child_w, nothing.fileno(), nothing.fileno()])
        if not select.select([parent_r], [], [], timeout)[0]:
            raise TimeoutError(f"the forkserver forked nothing within {timeout:.0f} s")
        pid = forkserver.read_signed(parent_r)
        with open(parent_w, "wb", closefd=False) as data:  # preparation data, then the object
            data.write(pickle.dumps({}) + pickle.dumps(child))
    except BaseException:
        os.close(parent_r)
        raise
    finally:
        for fd in (child_r, child_w, parent_w):
            os.close(fd)
    return parent_r, pid


def forkserver_exit_code(status_fd: int) -> int:
    """The exit code the forkserver writes when a child it forked exited (``-SIGNAL`` when
    killed); EOFError when the server is gone."""
    from multiprocessing import forkserver

    code: int = forkserver.read_signed(status_fd)
    return code


def forget_forkserver_fds() -> None:
    """In a forked child: close what the server passed as its alive pipe and resource tracker
    (`_forkserver._forkserver_alive_fd`, `_resource_tracker._fd`), as a fresh interpreter has
    neither; a resource tracker is then started on first use, as there."""
    from multiprocessing import forkserver, resource_tracker

    for holder, name in ((forkserver._forkserver, "_forkserver_alive_fd"),
                         (resource_tracker._resource_tracker, "_fd")):
        fd = getattr(holder, name, None)
        if fd is not None:
            setattr(holder, name, None)
            try:
                os.close(fd)
            except OSError:
                pass
