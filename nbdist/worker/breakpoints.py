"""``breakpoint()`` on a rank: a pdb whose output and prompt travel to the notebook as a `Prompt`
and whose commands come back as an `Answer`, over the cell channel (the notebook half:
`nbdist.cells.breakpoints`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
from typing import Any

from nbdist.protocol.wire import Prompt
from nbdist.worker import cell_channel
from nbdist.worker.post_mortem import CapturedPdb

SKIPPED_MODULES = ["IPython.*", "ipykernel.*", "ipyparallel.*", "nbdist.*", "tornado.*",
                   "asyncio.*", "zmq.*", "traitlets.*", "contextlib", "codeop"]
"""Frames `n`/`s` never stop in: the engine's, nbdist's (collective wrappers), IPython's codeop."""

_SEQ = itertools.count(1)
_AGENT: Any = None  # the rank's TelemetryAgent: publishes prompts, knows whether a cell runs


def install(agent: Any) -> None:
    global _AGENT
    _AGENT = agent
    sys.breakpointhook = hook


def hook(*_args: Any, **_kwargs: Any) -> None:
    """Stop the caller at a notebook-driven pdb, or say in one line why this rank cannot."""
    if _AGENT is None:
        return
    if cell_channel.SERVER is None:
        why = "the rank has no cell channel to the notebook"
    elif threading.current_thread() is not threading.main_thread():
        why = (f"only a cell's main thread can stop (this is thread "
               f"{threading.current_thread().name!r})")
    elif not _AGENT.cell_running:
        why = "no %%distributed cell is running to answer it"
    else:
        RankPdb(_AGENT).set_trace(sys._getframe(1))
        return
    print(f"nbdist: rank {_AGENT.rank}: breakpoint() skipped: {why}", file=sys.stderr, flush=True)


class RankPdb(CapturedPdb):
    """pdb with its output captured and its input (`readline`) answered by the notebook."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        # nosigint: the stop button must interrupt the rank, not break into pdb again
        super().__init__(skip=SKIPPED_MODULES, nosigint=True)
        self.stdin = self
        self.prompt = f"(rank {agent.rank} pdb) "

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
        # what the last command printed (before c, n, q): shown, nothing asked; once stepping
        # left the cell no one would answer (nbdist's after-cell code may hold the publish lock)
        if text.strip() and self.agent.cell_running:
            self.publish(text, None)

    def publish(self, text: str, seq: str | None) -> None:
        server = cell_channel.SERVER
        if server is None:
            return
        for stream in (sys.stdout, sys.stderr):  # the cell's own output first, then pdb's
            with contextlib.suppress(Exception):
                stream.flush()
        server.send(Prompt(text, seq, None if seq is None else self.prompt))

    def readline(self) -> str:
        server = cell_channel.SERVER
        if not self.agent.cell_running or server is None:
            return "c\n"
        text = self.take_output().removesuffix(self.prompt)
        seq = f"{os.getpid()}-{next(_SEQ)}"  # never an answer left from an earlier engine
        self.publish(text, seq)
        line = server.wait_for_answer(seq)
        return line if line.endswith("\n") else line + "\n"
