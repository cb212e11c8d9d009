"""Where a running cell's live output goes: the `OutputSink` protocol the notebook implements,
`NullSink` for callers that only want the result, and `CellOutput`, which every rank's text
passes through on its way there (local or remote rank alike): each rank's whole log on disk,
the head and the end of a flood, and the sink's pacing."""

from __future__ import annotations

import os
from typing import Any, Protocol

from nbdist.cells.output_log import RankLogs
from nbdist.cells.result import CellResult
from nbdist.cluster.ranks import format_ranks
from nbdist.config import NbdistConfig

EVERY_LINE = "every line: _dist_result.output(rank) or Cluster.output(rank)"


class OutputSink(Protocol):
    """Where live output goes while a cell runs (the magic renders it; tests record it).

    A sink may also have ``tick() -> float | None`` (called on every turn of the cell's loop:
    show what is due, return the seconds until something held back is), ``flush()`` (show
    everything held back, e.g. before a prompt) and ``on_rank_done(rank, state)`` ("finished",
    "failed", "dead"); `CellOutput` calls them when they are there."""

    def on_stream(self, rank: int, name: str, text: str) -> None: ...

    def on_display(self, rank: int, content: dict[str, Any]) -> None: ...

    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None: ...

    def on_status(self, text: str) -> None: ...


class NullSink:
    shows_status = False  # on_status lines go nowhere: the result must carry them

    def on_stream(self, rank: int, name: str, text: str) -> None:
        pass

    def on_display(self, rank: int, content: dict[str, Any]) -> None:
        pass

    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
        pass

    def on_status(self, text: str) -> None:
        pass


class _Stream:
    __slots__ = ("received", "lines", "chars", "cut")

    def __init__(self) -> None:
        self.received = 0  # characters that came as stream messages
        self.lines = 0  # line ends passed on to the sink
        self.chars = 0
        self.cut = False


class CellOutput:
    """One cell's stream output between the runner and the sink: all of it into the ranks' logs;
    per rank and stream the first `max_output_lines` lines (`max_output_chars` characters) to the
    sink, then nothing until the cell ends, when the stream's last `output_tail_chars` follow."""

    def __init__(self, sink: OutputSink, config: NbdistConfig, workdir: str) -> None:
        self.sink = sink
        self.config = config.output
        self.logs = RankLogs(os.path.join(workdir, "output"))
        self._streams: dict[tuple[int, str], _Stream] = {}
        self._unsaid: dict[str, list[int]] = {}  # ranks whose stream was cut, not yet told
        self._ends: list[tuple[int, str, str]] = []
        self._sink_tick = getattr(sink, "tick", None)
        self._sink_done = getattr(sink, "on_rank_done", None)

    def stream(self, rank: int, name: str, text: str) -> None:
        self.logs.write(rank, text)
        state = self._streams.get((rank, name))
        if state is None:
            state = self._streams[(rank, name)] = _Stream()
        state.received += len(text)
        if state.cut:
            return
        keep = _fits(text, self.config.max_output_lines - state.lines,
                     self.config.max_output_chars - state.chars)
        if keep < len(text):
            state.cut = True
            self._unsaid.setdefault(name, []).append(rank)
            self.logs.spill(rank)  # a flood's whole text goes to a file, not to memory
            text = text[:keep]
        if text:
            state.lines += text.count("\n")
            state.chars += len(text)
            self.sink.on_stream(rank, name, text)

    def rank_done(self, rank: int, state: str) -> None:
        if self._sink_done is not None:
            self._sink_done(rank, state)

    def tick(self) -> float | None:
        """Let the sink show what is due; seconds until it next needs a turn (None: no hurry)."""
        if self._unsaid:
            self._say_cut()
        return self._sink_tick() if self._sink_tick is not None else None

    def flush(self) -> None:
        flush = getattr(self.sink, "flush", None)
        if flush is not None:
            flush()

    def finish_stream(self, rank: int, name: str, full: str) -> None:
        """The cell ended and `full` is all the stream held: what raced the live messages goes
        out now, and a cut stream's end is kept for `close`."""
        state = self._streams.get((rank, name))
        received = state.received if state is not None else 0
        if len(full) > received:
            self.stream(rank, name, full[received:])
            state = self._streams[(rank, name)]
        if state is not None and state.cut:
            self._ends.append((rank, name, full))

    def close(self, result: CellResult) -> None:
        """After every `finish_stream`: the ends of the cut streams, one note per stream; the
        ranks' logs handed to `result`."""
        self._say_cut()
        for name in ("stdout", "stderr"):
            ends = [(rank, full) for rank, stream_name, full in self._ends if stream_name == name]
            if ends:
                self._show_ends(name, ends)
        self._ends.clear()
        self.flush()  # nothing held back once the cell is over, whoever made the sink
        result.outputs = self.logs.close()
        result.output_dir = self.logs.directory

    def _say_cut(self) -> None:
        for name, ranks in self._unsaid.items():
            self.sink.on_status(
                f"nbdist: rank(s) {format_ranks(ranks)} {name}: more than "
                f"{self.config.max_output_lines:,} lines (NbdistConfig.max_output_lines) or "
                f"{self.config.max_output_chars:,} characters; the rest is not shown here and "
                f"its end is when the cell ends ({EVERY_LINE})")
        self._unsaid.clear()

    def _show_ends(self, name: str, ends: list[tuple[int, str]]) -> None:
        tails, left_out = {}, []
        for rank, full in ends:
            shown = self._streams[(rank, name)].chars
            tail = full[-self.config.output_tail_chars:]
            if len(tail) < len(full) and "\n" in tail[:-1]:
                tail = tail[tail.index("\n") + 1:]  # start on a whole line
            if len(full) - len(tail) <= shown:
                tail = full[shown:]
            tails[rank] = tail if tail.endswith("\n") or not tail else tail + "\n"
            left_out.append(len(full) - shown - len(tail))
        counts = f"{min(left_out):,}" if min(left_out) == max(left_out) else \
            f"{min(left_out):,} to {max(left_out):,}"
        self.sink.on_status(f"nbdist: rank(s) {format_ranks(sorted(tails))} {name}: {counts} "
                            f"characters left out here; the last lines follow ({EVERY_LINE})")
        for rank, tail in tails.items():
            if tail:
                self.sink.on_stream(rank, name, tail)


def _fits(text: str, lines_left: int, chars_left: int) -> int:
    """How much of `text` fits in `lines_left` more line ends and `chars_left` more characters."""
    end = min(len(text), max(chars_left, 0))
    if lines_left <= 0:
        return 0
    if text.count("\n", 0, end) < lines_left:
        return end
    at = -1
    for _ in range(lines_left):
        at = text.index("\n", at + 1)
    return min(end, at + 1)
