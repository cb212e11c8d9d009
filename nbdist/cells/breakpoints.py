"""Notebook side of ``breakpoint()`` in a ``%%distributed`` cell: show what the rank's pdb printed,
ask for a command and hand the answer to the rank as a file in the cluster's private work
directory (the rank side, which waits for it, is `nbdist.worker.breakpoints`)."""

from __future__ import annotations

import builtins
import os
import re
import tempfile
from typing import Any

from nbdist.cells.output import OutputSink
from nbdist.worker.breakpoints import answer_path


class BreakpointPrompts:
    """Answers the "debug" payloads of one cell run, one prompt at a time."""

    def __init__(self, workdir: str, sink: OutputSink) -> None:
        self.workdir = workdir
        self.sink = sink
        self.headless = False
        """No one can answer (a kernel without stdin): every later prompt gets `c`."""
        self.interrupted = False
        """The stop button was pressed at a prompt: the ladder stops the ranks, no more asking."""

    def on_payload(self, rank: int, debug: dict[str, Any]) -> None:
        text = debug.get("text") or ""
        if text:
            self.sink.on_stream(rank, "stdout", text if text.endswith("\n") else text + "\n")
        if debug.get("prompt") is None or self.interrupted:
            return
        self._answer(rank, str(debug["seq"]), self._ask(rank, str(debug["prompt"])))

    def _ask(self, rank: int, prompt: str) -> str:
        if self.headless:
            return "c"
        try:
            # looked up now: ipykernel installs its own input() for each cell it runs
            return builtins.input(prompt)
        except KeyboardInterrupt:
            self.interrupted = True
            raise
        except Exception as exc:  # StdinNotImplementedError (headless), EOFError, ...
            self.headless = True
            self.sink.on_status(f"nbdist: rank {rank} stopped at breakpoint() but no one can "
                                f"answer ({type(exc).__name__}): continuing")
            return "c"

    def _answer(self, rank: int, seq: str, line: str) -> None:
        if not re.fullmatch(r"\d+-\d+", seq):  # the rank names its file: never a path
            self.sink.on_status(f"nbdist: rank {rank}: malformed breakpoint prompt id {seq!r}")
            return
        # written whole, then renamed: the rank, polling, never reads half an answer
        fd, tmp = tempfile.mkstemp(dir=self.workdir, prefix=".answer-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(line)
        os.replace(tmp, answer_path(self.workdir, rank, seq))
