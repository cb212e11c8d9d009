"""Render a running cell in the notebook: the ranks' lines (merged, per rank or raw), progress bars
updated in place, the per-rank view on many ranks, rich displays and values.

Plain printing to the kernel's stdout/stderr, which Jupyter streams live and a saved notebook keeps
as text. Every rank's text reaches it through ``nbdist.cells.output.CellOutput``, local or remote
alike; what it shows is docs/OUTPUT.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from nbdist.cells.result import CellResult
from nbdist.cluster.ranks import format_ranks
from nbdist.config import DEFAULT, NbdistConfig
from nbdist.notebook.merge import Event, LineMerger, Merged, StreamLines, ranks_of
from nbdist.notebook.noise import KnownNoise
from nbdist.notebook.progress import AggregatedBars, Key, ProgressBars
from nbdist.notebook.rank_board import RankBoard, who

_COLORS = ("34", "31", "32", "35", "36", "33", "94", "91")
_STREAMS = ("stdout", "stderr")

ALL_OF_IT = "_dist_result.output(rank)"
"""How to read every line a rank printed in the last cell (also ``Cluster.output(rank)``)."""


def rank_label(rank: int, color: bool = True) -> str:
    label = f"[rank {rank}]"
    return f"\x1b[{_COLORS[rank % len(_COLORS)]}m{label}\x1b[0m" if color else label


def ranks_label(ranks: list[int], color: bool = True) -> str:
    """``[rank 3]`` for one rank, ``[ranks 0-7]`` for several."""
    if len(ranks) == 1:
        return rank_label(ranks[0], color)
    label = f"[ranks {format_ranks(ranks)}]"
    return f"\x1b[1m{label}\x1b[0m" if color else label


class NotebookSink:
    """Streams each rank's output live; `output` is "merged", "ranks" or "raw"
    (NbdistConfig.output_mode). `ranks`: the ranks the cell runs on (None: not known, so a line
    waits its whole interval for the same line from others)."""

    def __init__(self, only_rank0: bool = False, dashboard_factory: Any = None, *,
                 output: str | None = None, ranks: Sequence[int] | None = None,
                 config: NbdistConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or DEFAULT
        settings = self.config.output
        self.output = output or settings.output_mode
        self.only_rank0 = only_rank0
        shown = [0] if only_rank0 else None if ranks is None else list(ranks)
        self._clock = clock
        self._color = _in_ipython()
        self._lines = StreamLines()
        self._noise = KnownNoise()
        self._mergers = {
            name: LineMerger(shown, settings.output_interval, settings.output_hold_max)
            for name in _STREAMS} if self.output == "merged" else {}
        self._labels: dict[int, str] = {}  # by the mask of ranks (see merge.ranks_of)
        many = shown is not None and len(shown) >= settings.rank_view_ranks
        self.board = RankBoard(shown or []) if self.output == "ranks" or (
            many and self.output == "merged") else None
        self.view: Any = None
        self._view_wanted = self.board is not None and _in_kernel()
        self.bars: ProgressBars | AggregatedBars = (
            AggregatedBars(_show_text, len(shown or ()), min_interval=0.05, clock=clock)
            if many and self.output != "raw" else ProgressBars(_show_text, 0.05, clock))
        self._dashboard_factory = dashboard_factory
        self.dashboard: Any = None

    @classmethod
    def for_cell(cls, cluster: Any, ranks: Sequence[int] | None, only_rank0: bool,
                 output: str | None) -> NotebookSink:
        """The sink a magic gives `cluster.run`: the cell's ranks, the cluster's config."""
        targets = list(range(cluster.world_size)) if ranks is None else list(ranks)
        return cls(only_rank0=only_rank0, dashboard_factory=cluster.dashboard, output=output,
                   ranks=targets, config=cluster.config)

    def _shown(self, rank: int) -> bool:
        return not self.only_rank0 or rank == 0

    # ---------------------------------------------------------------- the ranks' text
    def on_stream(self, rank: int, name: str, text: str) -> None:
        if not self._shown(rank):
            return
        self._show_view()
        now = self._clock()
        key = (rank, name)
        for event in self._lines.feed(key, text):
            self._take(key, event, now)
        merger = self._mergers.get(name)
        if merger is not None:
            self._write(name, merger.due(now))

    def _take(self, key: Key, event: Event, now: float) -> None:
        rank, name = key
        kind, payload = event
        if isinstance(payload, list):  # complete lines (or a bar's last, no frontend to draw it)
            if name == "stderr" and self.output != "raw":
                payload = self._noise.filter(rank, payload)
            merger = self._mergers.get(name)
            if merger is not None:
                merger.add(rank, payload, now)
            elif self.output == "raw":
                self._write(name, [(1 << rank, line) for line in payload])
            if self.board is not None:
                self.board.add_lines(rank, payload)
            return
        aggregated = isinstance(self.bars, AggregatedBars)
        shown = payload if aggregated else f"{rank_label(rank, self._color)} {payload}"
        if kind == "redraw":
            if self.board is not None:
                self.board.set_bar(rank, payload)
            self.bars.redraw(key, shown)
        elif key in self.bars:  # a bar's line ended: its display keeps the final text
            self.bars.finish(key, shown)
        else:
            self._take(key, ("lines", [payload]), now)

    def _write(self, name: str, lines: list[Merged]) -> None:
        if lines:
            out = sys.stderr if name == "stderr" else sys.stdout
            labels = self._labels
            for mask, _text in lines:
                if mask not in labels:
                    labels[mask] = ranks_label(ranks_of(mask), self._color)
            out.write("".join([f"{labels[mask]} {text}\n" for mask, text in lines]))
            out.flush()

    def on_rank_done(self, rank: int, state: str) -> None:
        """The rank's cell ended ("finished", "failed", "dead"): lines stop waiting for it."""
        for merger in self._mergers.values():
            merger.rank_done(rank)
        if self.board is not None and rank in self.board.records:
            self.board.set_state(rank, state)

    def tick(self) -> float | None:
        """Show what is due; seconds until the next held-back line or view update is due."""
        now = self._clock()
        dues = []
        for name, merger in self._mergers.items():
            self._write(name, merger.due(now))
            dues.append(merger.next_due(now))
        if self.view is not None:
            dues.append(self.view.tick(now))
        waits = [due for due in dues if due is not None]
        return min(waits) if waits else None

    def flush(self) -> None:
        """Show every line held back, and end unfinished ones."""
        now = self._clock()
        for key, event in self._lines.flush():
            self._take(key, event, now)
        for name, merger in self._mergers.items():
            self._write(name, merger.flush())

    # ---------------------------------------------------------------- the rest of the cell
    def on_display(self, rank: int, content: dict[str, Any]) -> None:
        if not self._shown(rank):
            return
        from IPython.display import publish_display_data

        self._show_view()
        self.flush()
        print(f"{rank_label(rank, self._color)} display:")
        publish_display_data(content.get("data", {}), content.get("metadata", {}))

    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
        if self.dashboard is None and payload.get("metrics") and self._dashboard_factory:
            from IPython.display import display

            self.dashboard = self._dashboard_factory()
            if self.dashboard is not None:
                display(self.dashboard)

    def on_status(self, text: str) -> None:
        self.flush()
        print(text, file=sys.stderr, flush=True)

    def show_values(self, result: CellResult) -> None:
        self.flush()
        groups = result.grouped_values()
        if self.only_rank0:
            groups = [([0], text) for ranks, text in groups if 0 in ranks]
        for ranks, text in groups:
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            sep = "\n" if "\n" in text else " "
            print(f"Out[{who}]:{sep}{text}")

    def close(self, result: CellResult | None = None) -> None:
        """The cell ended (`result`: None when it raised): last lines, bars and views frozen as
        what a saved notebook keeps."""
        self.flush()
        self.bars.finish_all()
        if self.board is not None:
            self.board.finish(result)
            if self.output == "ranks":
                self._print_blocks()
        if self.view is not None:
            self.view.finalize()
        finalize = getattr(self.dashboard, "finalize", None)
        if finalize is not None:
            try:
                finalize()
            except Exception:
                pass  # a view that cannot freeze itself must not hide the cell's own outcome

    def _show_view(self) -> None:
        if self._view_wanted:
            self._view_wanted = False
            from nbdist.notebook.rank_view import RankViewSlot

            assert self.board is not None
            self.view = RankViewSlot(self.board, ALL_OF_IT, self._clock())

    def _print_blocks(self) -> None:
        """`--output ranks`: each rank's lines as one block, errors first; ranks whose whole
        output is the same share a block."""
        assert self.board is not None
        blocks: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for record in self.board.ordered():
            blocks.setdefault((record.state, tuple(record.lines)), []).append(record.rank)
        text = []
        for (state, lines), ranks in blocks.items():
            text.append(f"── {who(ranks)} ({state}) ──\n")
            text.extend(f"{line}\n" for line in lines)
        sys.stdout.write("".join(text))
        sys.stdout.flush()


class _TextDisplay:
    """A text/plain display updated in place (IPython's DisplayHandle, raw bundles)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def update(self, text: str) -> None:
        self._handle.update({"text/plain": text}, raw=True)


def _show_text(text: str) -> _TextDisplay | None:
    from IPython.display import display

    if not _in_ipython():  # plain Python: no frontend to update a display in
        return None
    handle = display({"text/plain": text}, raw=True, display_id=True)
    return None if handle is None else _TextDisplay(handle)


def _in_ipython() -> bool:
    from IPython import get_ipython

    return get_ipython() is not None


def _in_kernel() -> bool:
    """A Jupyter kernel (a frontend draws widgets), not terminal IPython or plain Python."""
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None
