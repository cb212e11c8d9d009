"""Notebook side of ``breakpoint()`` in a ``%%distributed`` cell: show what the rank's pdb printed,
ask for a command and send the answer back to the rank over the cell channel (the rank side,
which waits for it, is `nbdist.worker.breakpoints`)."""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from nbdist.cells.output import OutputSink
from nbdist.cluster.cell_channel import NotebookChannel
from nbdist.cluster.ranks import RankProcess
from nbdist.protocol.wire import Answer, Prompt


class BreakpointPrompts:
    """Answers the pdb prompts of one cell run, one at a time."""

    def __init__(self, channel: NotebookChannel, ranks: Sequence[RankProcess],
                 sink: OutputSink) -> None:
        self.channel = channel
        self.ranks = ranks
        self.sink = sink
        self.headless = False
        """No one can answer (a kernel without stdin): every later prompt gets `c`."""
        self.interrupted = False
        """The stop button was pressed at a prompt: the ladder stops the ranks, no more asking."""

    def on_prompt(self, rank: int, prompt: Prompt) -> None:
        text = prompt.text
        if text:
            self.sink.on_stream(rank, "stdout", text if text.endswith("\n") else text + "\n")
        if prompt.prompt is None or prompt.seq is None or self.interrupted:
            return
        line = self._ask(rank, prompt.prompt)
        endpoint = self.ranks[rank].endpoint
        if endpoint is not None:
            self.channel.send_message(rank, endpoint, Answer(prompt.seq, line))

    def _ask(self, rank: int, prompt: str) -> str:
        if self.headless:
            return "c"
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            flush()  # what the rank's pdb printed, before its prompt (merged output holds lines)
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
