"""The per-rank view under a cell on many ranks. Its place is taken at the cell's first output (a
one-line summary, `RankViewSlot`); once the cell has run `WIDGET_AFTER` seconds the live view
takes it, an anywidget drawn by ``rank_view.js`` (the reader's filter lives in the browser, so
updates never reset it); when the cell ends the static view (``rank_board.static_bundle``)
replaces it and the widget is closed, as the dashboard does, so a saved notebook never shows
"model not found". A short cell never pays for a widget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anywidget
import traitlets

from nbdist.notebook.rank_board import RankBoard, static_bundle

_HERE = Path(__file__).parent

SYNC_INTERVAL = 0.5
"""Least seconds between two updates of the live view."""

WIDGET_AFTER = 0.5
"""Seconds a cell runs before its live view appears."""


class RankView(anywidget.AnyWidget):
    """The live view of one `RankBoard`."""

    _esm = _HERE / "rank_view.js"
    _css = _HERE / "rank_view.css"

    rows = traitlets.List().tag(sync=True)
    """One dict per rank (rank, state, lines, last), errors first."""
    texts = traitlets.Dict().tag(sync=True)
    """Each rank's last lines, by rank (as a string)."""
    summary = traitlets.Unicode("").tag(sync=True)

    def push(self, board: RankBoard) -> None:
        rows, texts = board.live_view()
        with self.hold_sync():  # one comm message for the three traits
            self.rows, self.texts, self.summary = rows, texts, board.summary()


class RankViewSlot:
    """Where the view sits under the cell, from its first output on."""

    def __init__(self, board: RankBoard, more: str, now: float) -> None:
        from IPython.display import display

        self.board = board
        self.more = more
        self.started = now
        self.widget: RankView | None = None
        self._pushed_version = -1
        self._pushed_at = -float("inf")
        self._handle: Any = display({"text/plain": f"nbdist: {board.summary()}"}, raw=True,
                                    display_id=True)

    def tick(self, now: float) -> float | None:
        """Bring the view up to date (at most every `SYNC_INTERVAL`); seconds until it next
        needs a turn (None: nothing pending)."""
        if self.widget is None:
            if now - self.started < WIDGET_AFTER:
                return self.started + WIDGET_AFTER - now
            self.widget = RankView()
            self._push(now)
            data, metadata = self.widget._repr_mimebundle_()  # type: ignore[misc]
            self._handle.update({**data, "text/plain": f"nbdist: {self.board.summary()}"},
                                metadata=metadata, raw=True)
            return None
        if self.board.version == self._pushed_version:
            return None
        wait = self._pushed_at + SYNC_INTERVAL - now
        if wait > 0:
            return wait
        self._push(now)
        return None

    def _push(self, now: float) -> None:
        assert self.widget is not None
        self.widget.push(self.board)
        self._pushed_version, self._pushed_at = self.board.version, now

    def finalize(self) -> None:
        """The cell ended: its place shows the static view; the widget goes."""
        self._handle.update(static_bundle(self.board, self.more), metadata={}, raw=True)
        if self.widget is not None:
            self.widget.close()
