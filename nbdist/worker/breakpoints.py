"""Rank side of ``breakpoint()`` in a ``%%distributed`` cell: a `pdb.Pdb` whose prompt travels to
the notebook as a telemetry payload and whose commands come back as files in the cluster's
private work directory (so only a rank on the notebook's machine can stop at one).

The notebook half is `nbdist.cells.breakpoints`; `answer_path` is the one name both agree on.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pdb
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

SKIPPED_MODULES = ["IPython.*", "ipykernel.*", "ipyparallel.*", "nbdist.*", "tornado.*",
                   "asyncio.*", "zmq.*", "traitlets.*", "contextlib", "codeop"]
"""Frames `n`/`s` never stop in: the engine's and nbdist's own (its collective wrappers), and
the compiler IPython calls between a cell's statements."""

_SEQ = itertools.count(1)


def answer_path(directory: str, rank: int, seq: str) -> str:
    """Where the notebook writes its answer to prompt `seq` of `rank`."""
    return os.path.join(directory, f"breakpoint-rank{rank}-{seq}.answer")


@dataclass
class _Settings:
    agent: Any  # the rank's TelemetryAgent: publishes prompts, knows whether a cell runs
    directory: str | None
    poll_interval: float


_SETTINGS: _Settings | None = None


def install(agent: Any, directory: str | None, poll_interval: float) -> None:
    """Make ``breakpoint()`` on this rank ask the notebook (`directory`: the cluster's workdir,
    None when this rank is on another machine); `agent` publishes the prompts."""
    global _SETTINGS
    _SETTINGS = _Settings(agent, directory, poll_interval)
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
    if settings.directory is None:
        return (f"it needs a rank on the notebook's machine (this rank runs on "
                f"{socket.gethostname()})")
    if threading.current_thread() is not threading.main_thread():
        return (f"only a cell's main thread can stop (this is thread "
                f"{threading.current_thread().name!r})")
    if not settings.agent.cell_running:
        return "no %%distributed cell is running to answer it"
    return None


class RankPdb(pdb.Pdb):
    """pdb with its output captured and its input read from the notebook's answer files."""

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
        seq = f"{os.getpid()}-{next(_SEQ)}"  # never an answer left from an earlier engine
        path = answer_path(str(self.settings.directory), self.rank, seq)
        self.publish(text, seq)
        while True:
            try:
                with open(path, encoding="utf-8") as answer:
                    line = answer.read()
            except FileNotFoundError:
                time.sleep(self.settings.poll_interval)
                continue
            with contextlib.suppress(OSError):
                os.unlink(path)
            return line if line.endswith("\n") else line + "\n"
