"""Render a running cell in the notebook: labelled per-rank output, rich displays, values.

Used by the magics; plain printing to the kernel's stdout/stderr, which Jupyter streams live.
Lines a rank redraws with ``\r`` (tqdm) become one display per rank updated in place
(``progress.py``).
"""

from __future__ import annotations

import sys
from typing import Any

from nbdist.cells.result import CellResult
from nbdist.cluster.ranks import format_ranks
from nbdist.notebook.progress import ProgressBars, visible_text

_COLORS = ("34", "31", "32", "35", "36", "33", "94", "91")


def rank_label(rank: int) -> str:
    return f"\x1b[{_COLORS[rank % len(_COLORS)]}m[rank {rank}]\x1b[0m"


class NotebookSink:
    """Streams each rank's output live, one labelled line at a time."""

    def __init__(self, only_rank0: bool = False, dashboard_factory: Any = None) -> None:
        self.only_rank0 = only_rank0
        self._partial: dict[tuple[int, str], str] = {}
        self._dashboard_factory = dashboard_factory
        self.dashboard: Any = None
        self.bars = ProgressBars(_show_text, min_interval=0.05)

    def _shown(self, rank: int) -> bool:
        return not self.only_rank0 or rank == 0

    def on_stream(self, rank: int, name: str, text: str) -> None:
        if not self._shown(rank):
            return
        key = (rank, name)
        buffered = self._partial.get(key, "") + text.replace("\r\n", "\n")
        *complete, rest = buffered.split("\n")
        out = sys.stderr if name == "stderr" else sys.stdout
        label = rank_label(rank)
        lines: list[str] = []
        for line in complete:
            if key in self.bars or "\r" in line:  # a bar's last redraw, ended by its newline
                self._write(out, lines, label)
                if not self.bars.redraw(key, f"{label} {visible_text(line)}"):
                    lines.append(visible_text(line))  # no frontend: its final state, printed
                self.bars.finish(key)
            else:
                lines.append(line)
        self._write(out, lines, label)
        if "\r" in rest or key in self.bars:
            rest = visible_text(rest)
            if rest and not self.bars.redraw(key, f"{label} {rest}"):
                rest = "\r" + rest  # no frontend: printed once the line ends
        self._partial[key] = rest

    @staticmethod
    def _write(out: Any, lines: list[str], label: str) -> None:
        if lines:
            out.write("".join(f"{label} {line}\n" for line in lines))
            out.flush()
            lines.clear()

    def on_display(self, rank: int, content: dict[str, Any]) -> None:
        if not self._shown(rank):
            return
        from IPython.display import publish_display_data

        self.flush()
        print(f"{rank_label(rank)} display:")
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

    def flush(self) -> None:
        for (rank, name), rest in list(self._partial.items()):
            if (rank, name) in self.bars:
                self.bars.finish((rank, name))
            elif rest:
                out = sys.stderr if name == "stderr" else sys.stdout
                out.write(f"{rank_label(rank)} {visible_text(rest)}\n")
                out.flush()
            self._partial[(rank, name)] = ""

    def show_values(self, result: CellResult) -> None:
        self.flush()
        groups = result.grouped_values()
        if self.only_rank0:
            groups = [([0], text) for ranks, text in groups if 0 in ranks]
        for ranks, text in groups:
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            sep = "\n" if "\n" in text else " "
            print(f"Out[{who}]:{sep}{text}")


class _TextDisplay:
    """A text/plain display updated in place (IPython's DisplayHandle, raw bundles)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def update(self, text: str) -> None:
        self._handle.update({"text/plain": text}, raw=True)


def _show_text(text: str) -> _TextDisplay | None:
    from IPython import get_ipython
    from IPython.display import display

    if get_ipython() is None:  # plain Python: no frontend to update a display in
        return None
    handle = display({"text/plain": text}, raw=True, display_id=True)
    return None if handle is None else _TextDisplay(handle)
