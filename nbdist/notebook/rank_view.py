"""The per-rank view under a cell on many ranks: an anywidget drawn by ``rank_view.js`` while the
cell runs (the reader's filter lives in the browser, so updates never reset it); when the cell
ends its output is replaced by the static view (``rank_board.static_bundle``) and the widget
closed, as the dashboard does, so a saved notebook never shows "model not found"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anywidget
import traitlets

from nbdist.notebook.rank_board import RankBoard, static_bundle

_HERE = Path(__file__).parent

SYNC_INTERVAL = 0.5
"""Least seconds between two updates of the live view."""


class RankView(anywidget.AnyWidget):
    """The live view of one `RankBoard`."""

    _esm = _HERE / "rank_view.js"
    _css = _HERE / "rank_view.css"

    rows = traitlets.List().tag(sync=True)
    """One dict per rank (rank, state, lines, last), errors first."""
    texts = traitlets.Dict().tag(sync=True)
    """Each rank's last lines, by rank (as a string)."""
    summary = traitlets.Unicode("").tag(sync=True)

    def __init__(self, board: RankBoard, more: str) -> None:
        super().__init__()
        self.board = board
        self.more = more
        self._synced_version = -1
        self._synced_at = -float("inf")
        self._handle: Any = None
        self.syncs = 0

    def show(self) -> None:
        from IPython.display import display

        self.sync(0.0, force=True)
        data, metadata = self._repr_mimebundle_()  # type: ignore[misc]
        data = {**data, "text/plain": f"nbdist: {self.board.summary()}"}
        self._handle = display(data, metadata=metadata, raw=True, display_id=True)

    def sync(self, now: float, force: bool = False) -> float | None:
        """Push the board if it changed and the last push is `SYNC_INTERVAL` old (or `force`);
        seconds until a held-back change is due, None when nothing is held back."""
        if self.board.version == self._synced_version:
            return None
        wait = self._synced_at + SYNC_INTERVAL - now
        if wait > 0 and not force:
            return wait
        rows, texts = self.board.live_view()
        with self.hold_sync():  # one comm message for the three traits
            self.rows, self.texts, self.summary = rows, texts, self.board.summary()
        self._synced_version, self._synced_at = self.board.version, now
        self.syncs += 1
        return None

    def finalize(self) -> None:
        """The cell ended: its output becomes the static view; the widget goes."""
        if self._handle is not None:
            self._handle.update(static_bundle(self.board, self.more), metadata={}, raw=True)
            self._handle = None
        self.close()
