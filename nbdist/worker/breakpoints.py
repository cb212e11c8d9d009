"""Rank side of ``breakpoint()`` in a ``%%distributed`` cell: a `pdb.Pdb` whose prompt travels to
the notebook as a telemetry payload and whose commands come back over the cell channel, on any
host. The notebook half is `nbdist.cells.breakpoints`.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pdb
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from nbdist.worker import cell_channel

SKIPPED_MODULES = ["IPython.*", "ipykernel.*", "ipyparallel.*", "nbdist.*", "tornado.*",
                   "asyncio.*", "zmq.*", "traitlets.*", "contextlib", "codeop"]
"""Frames `n`/`s` never stop in: the engine's and nbdist's own (its collective wrappers), and
the compiler IPython calls between a cell's statements."""

_SEQ = itertools.count(1)


@dataclass
class _Settings:
    agent: Any  # the rank's TelemetryAgent: publishes prompts, knows whether a cell runs


_SETTINGS: _Settings | None = None


def install(agent: Any) -> None:
    """Make ``breakpoint()`` on this rank ask the notebook; `agent` publishes the prompts."""
    global _SETTINGS
    _SETTINGS = _Settings(agent)
    sys.breakpointhook = hook


def hook(*_args: Any, **_kwargs: Any) -> None:
    """``sys.breakpointhook``: stop the caller's frame at a notebook-driven pdb, or say in one
    line why this rank cannot and go on."""
    settings = _SETTINGS
    if settings is None:
        return
    rank = settings.agent.rank
    why = _cannot_stop(settings)
    if why:
        print(f"nbdist: rank {rank}: breakpoint() skipped: {why}", file=sys.stderr, flush=True)
        return
    RankPdb(rank, settings).set_trace(sys._getframe(1))


def _cannot_stop(settings: _Settings) -> str | None:
    if cell_channel.server() is None:
        return "the rank has no cell channel to the notebook"
    if threading.current_thread() is not threading.main_thread():
        return (f"only a cell's main thread can stop (this is thread "
                f"{threading.current_thread().name!r})")
    if not settings.agent.cell_running:
        return "no %%distributed cell is running to answer it"
    return None


class RankPdb(pdb.Pdb):
    """pdb with its output captured and its input answered by the notebook."""

    def __init__(self, rank: int, settings: _Settings) -> None:
        self.output = io.StringIO()
        self.reader = _AnswerReader(self, rank, settings)
        # nosigint: the stop button must interrupt the rank, not break into pdb again
        super().__init__(stdin=self.reader, stdout=self.output, skip=SKIPPED_MODULES,
                         nosigint=True, readrc=False)
        self.prompt = f"(rank {rank} pdb) "

    def take_output(self) -> str:
        text = self.output.getvalue()
        self.output.seek(0)
        self.output.truncate()
        return text

    def onecmd(self, line: str) -> bool:
        # statements (`!x = 1`, `print(x)`) print to sys.stdout: they belong with pdb's answer
        with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output):
            return bool(super().onecmd(line))

    def _cmdloop(self) -> None:
        # pdb's own loop re-prompts after KeyboardInterrupt; here the stop button (the ladder's
        # SIGINT) ends the cell on this rank as it would anywhere else
        try:
            self.cmdloop()
        except KeyboardInterrupt:
            self.set_quit()
            raise

    def postloop(self) -> None:
        text = self.take_output()
        # what the last command printed (before c, n, q): shown, nothing asked
        if text.strip() and self.reader.answerable():
            self.reader.publish(text, None)


class _AnswerReader:
    """pdb's stdin: each `readline` publishes the prompt and waits for the notebook's answer."""

    def __init__(self, debugger: RankPdb, rank: int, settings: _Settings) -> None:
        self.debugger = debugger
        self.rank = rank
        self.settings = settings

    def publish(self, text: str, seq: str | None) -> None:
        for stream in (sys.stdout, sys.stderr):  # the cell's own output first, then pdb's
            with contextlib.suppress(Exception):
                stream.flush()
        prompt = None if seq is None else self.debugger.prompt
        agent = self.settings.agent
        agent.send({"rank": self.rank, "t": time.time(), "reason": "debug", "cell": agent.cell_id,
                    "debug": {"text": text, "prompt": prompt, "seq": seq}})

    def answerable(self) -> bool:
        """False once stepping left the cell (nbdist's own after-cell code may hold the publish
        lock): no one would answer, so the rank continues silently."""
        return bool(self.settings.agent.cell_running)

    def readline(self) -> str:
        if not self.answerable():
            return "c\n"
        text = self.debugger.take_output()
        prompt = self.debugger.prompt
        if text.endswith(prompt):
            text = text[: -len(prompt)]
        server = cell_channel.server()
        if server is None:
            return "c\n"
        seq = f"{os.getpid()}-{next(_SEQ)}"  # never an answer left from an earlier engine
        self.publish(text, seq)
        line = server.wait_for_answer(seq)
        return line if line.endswith("\n") else line + "\n"
