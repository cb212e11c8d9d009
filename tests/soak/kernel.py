"""A real ipykernel driven through jupyter_client, as a person at the notebook drives it: cells in,
the stop button (an interrupt) at a chosen moment, everything the cell showed collected as text."""

from __future__ import annotations

import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.kernels import KernelSession

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

LOST_REPLY = "lost-reply"
"""Outcome status of a request the kernel finished without an execute_reply. ipykernel's own
window, not nbdist's: a stop button that lands in ipykernel's execute_request handler before or
after the cell's code (its SIGINT handler is already Python's, nothing catches the interrupt
there) is logged as "KeyboardInterrupt caught in kernel." and the reply is never sent. Measured on
a bare kernel (no nbdist loaded): the stop button 1-10 ms into `x = sum(range(1000))` lost 7
replies of 60; the kernel stayed idle and the next cell ran. A notebook shows such a cell as still
running; the kernel itself is fine."""

REPLY_GRACE = 10.0
"""Seconds to wait for the reply after the kernel went idle (it is sent just before idle)."""


@dataclass
class Outcome:
    """One executed cell: its reply status, all it showed (streams, displays, the error), how long."""

    status: str
    text: str
    seconds: float
    error: str = ""  # "ename: evalue" when status == "error"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class SoakKernel(KernelSession):
    """One ipykernel process for the whole soak; `pid` is its process, whose tree we audit."""

    def __init__(self, cwd: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(cwd, env)
        self.pid = self.manager.provisioner.process.pid  # type: ignore[union-attr]
        self.process = psutil.Process(self.pid)

    def run(self, code: str, timeout: float = 180, interrupt_after: float | None = None) -> Outcome:
        """Execute one cell; with `interrupt_after`, press the stop button that many seconds in."""
        parts: list[str] = []
        error = ""

        def on_output(msg: dict) -> None:
            nonlocal error
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                parts.append(content["text"])
            elif kind in ("display_data", "execute_result"):
                parts.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
                parts.append("\n".join(content["traceback"]) + "\n")

        timer = None
        if interrupt_after is not None:
            timer = threading.Timer(interrupt_after, self.manager.interrupt_kernel)
            timer.start()
        started = time.perf_counter()
        try:
            reply = self._execute(code, on_output, timeout)
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
        seconds = time.perf_counter() - started
        status = reply["content"]["status"] if reply is not None else LOST_REPLY
        return Outcome(status, _ANSI.sub("", "".join(parts)), seconds, error)

    def _execute(self, code: str, on_output, timeout: float) -> dict | None:
        """jupyter_client's execute_interactive, except that a request the kernel finished (its
        status went back to idle) without a reply returns None instead of waiting out `timeout`."""
        msg_id = self.client.execute(code)
        deadline = time.monotonic() + timeout
        while True:  # what the cell shows, until the kernel is idle again for this request
            try:
                msg = self.client.get_iopub_msg(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no idle status within {timeout:.0f} s for: {code[:80]!r}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
            on_output(msg)
        reply_by = time.monotonic() + REPLY_GRACE
        while time.monotonic() < reply_by:
            try:
                reply = self.client.get_shell_msg(timeout=max(0.0, reply_by - time.monotonic()))
            except queue.Empty:
                break
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
        return None

    def value(self, expression: str, timeout: float = 60) -> str:
        """The repr of an expression evaluated in the kernel (raises when the cell fails)."""
        outcome = self.run(f"print(repr({expression}))", timeout=timeout)
        if not outcome.ok:
            raise AssertionError(f"kernel could not evaluate {expression!r}: {outcome.text}")
        return outcome.text.strip()
