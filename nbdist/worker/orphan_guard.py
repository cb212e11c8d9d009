"""A rank that nbdist started ends itself, and everything it started, once the notebook kernel is
gone: its end of the cell channel closes (even on `kill -9`), and nothing else would stop it."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from nbdist.worker.process_group import remove_temporary_dumps
from nbdist.worker.process_tree import exit_with_descendants, same_process

LOST_POLL_SECONDS = 0.1  # while the notebook's end is disconnected: how often to look again
Notebook = tuple[int, float]  # the notebook kernel as (pid, create time)


def guard(socket: Any, notebook: Notebook, grace: float) -> None:
    """Watch the connection of `socket` (the rank's PUSH to the notebook) from a daemon thread.

    On the notebook's machine a disconnection ends the rank once the kernel's PID is gone: a
    kernel that closed its end on purpose and lives on never ends it. Elsewhere the kernel cannot
    be seen: the rank ends when no reconnection came within `grace` seconds."""
    import zmq

    monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    here = same_process(*notebook) is not None  # remote: no process of that PID and start time
    threading.Thread(target=_watch, args=(monitor, notebook if here else None, grace),
                     name="nbdist-orphan-guard", daemon=True).start()


def _watch(monitor: Any, notebook: Notebook | None, grace: float) -> None:
    """Until the socket is closed (its monitor stops): end the rank once the notebook is gone."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    lost_since: float | None = None
    try:
        while True:
            if monitor.poll(None if lost_since is None else LOST_POLL_SECONDS * 1000):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_MONITOR_STOPPED:  # the rank closed its socket itself
                    return
                if event == zmq.EVENT_CONNECTED:
                    lost_since = None
                elif lost_since is None:
                    lost_since = time.monotonic()
            if lost_since is not None and (same_process(*notebook) is None if notebook
                                           else time.monotonic() - lost_since > grace):
                # stop its descendants too: the main thread may be blocked in a collective
                print("nbdist: the notebook kernel is gone; this rank ends",
                      file=sys.__stderr__, flush=True)
                remove_temporary_dumps()  # the exit skips atexit
                exit_with_descendants(grace)
    except zmq.ZMQError:  # the context is ending with the engine
        return
    finally:
        monitor.close(linger=0)
