"""A real ipykernel driven through jupyter_client, as a person at the notebook drives it: cells in,
the stop button (an interrupt) at a chosen moment, everything the cell showed collected as text."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


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


class SoakKernel:
    """One ipykernel process for the whole soak; `pid` is its process, whose tree we audit."""

    def __init__(self, cwd: Path, env: dict[str, str] | None = None) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(cwd),
                                                     env={**os.environ, **(env or {})})
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
            reply = self.client.execute_interactive(code, output_hook=on_output, timeout=timeout)
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
        seconds = time.perf_counter() - started
        return Outcome(reply["content"]["status"], _ANSI.sub("", "".join(parts)), seconds, error)

    def value(self, expression: str, timeout: float = 60) -> str:
        """The repr of an expression evaluated in the kernel (raises when the cell fails)."""
        outcome = self.run(f"print(repr({expression}))", timeout=timeout)
        if not outcome.ok:
            raise AssertionError(f"kernel could not evaluate {expression!r}: {outcome.text}")
        return outcome.text.strip()

    def close(self) -> None:
        try:
            self.run("%dist_stop", timeout=60)
        finally:
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=False)
