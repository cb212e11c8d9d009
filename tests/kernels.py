"""A real ipykernel driven through jupyter_client, as a notebook drives it: the one way the tests,
the benchmarks and the soak start a kernel, run cells in it, and stop its cluster and shut it down.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class KernelSession:
    """A real ipykernel (jupyter_client) running cells; `input()` there is answered from the list
    given to `answer_with`, in order, as a person typing at the prompt would.

    A subclass may define its own `run` (what a cell returns to it); `close` stops the cluster
    through that `run`, so its checks hold for `%dist_stop` too."""

    def __init__(self, cwd: Path, env: dict[str, str] | None = None) -> None:
        """`env`: variables set in the kernel on top of this process's environment."""
        from jupyter_client.manager import start_new_kernel

        options: dict[str, Any] = {} if env is None else {"env": {**os.environ, **env}}
        self.manager, self.client = start_new_kernel(
            kernel_name="python3", cwd=str(cwd), **options
        )
        self._answers: Iterator[str] = iter(())
        self.prompts: list[str] = []
        self.outputs: list[str] = []

    def answer_with(self, answers: list[str]) -> None:
        self._answers = iter(answers)

    def run(
        self, code: str, timeout: float = 240, output_hook: Callable[[dict], None] | None = None
    ) -> Any:
        """Execute one cell; its reply's content (status "ok" or "error"). The cell's stream text
        is kept in `outputs`; `output_hook` gets each of its IOPub messages as well."""

        def on_stdin(msg: dict) -> None:
            self.prompts.append(msg["content"]["prompt"])
            self.client.input(next(self._answers))

        def on_output(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                self.outputs.append(msg["content"]["text"])
            if output_hook is not None:
                output_hook(msg)

        reply = self.client.execute_interactive(code, allow_stdin=True, stdin_hook=on_stdin,
                                                output_hook=on_output, timeout=timeout)
        return reply["content"]

    def text(self) -> str:
        return "".join(self.outputs)

    def close(self) -> None:
        try:
            self.run("%dist_stop", timeout=60)  # a no-op message when no cluster runs
        finally:
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=False)
