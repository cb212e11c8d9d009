"""Every use nbdist makes of ipyparallel's, ipykernel's or IPython's private attributes.

Each function names what it relies on and what happens when a release drops it. One use lives
elsewhere because it is a subclass: `cluster/fork_launcher.ForkEngineLauncher` overrides
`LocalProcessLauncher._wait` (started by `_start_waiting`, stopped by `_stop_waiting`).
tests/test_ipp_compat.py checks each one against the installed versions, and pyproject.toml caps
those packages at the versions checked.
"""

from __future__ import annotations

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
