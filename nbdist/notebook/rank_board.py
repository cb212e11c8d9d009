"""What the per-rank view shows, as plain data: each rank's state, lines and last line, errors
first; and the view's static form (HTML and plain text) that a saved notebook keeps.

Fed by the notebook sink; drawn live by ``rank_view.py`` and, once the cell ends, frozen by
``static_bundle`` (no kernel is needed to read it, as on GitHub or the docs site).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbdist.cells.result import CellResult
from nbdist.cluster.ranks import format_ranks

ORDER = ("failed", "dead", "interrupted", "running", "finished")
"""States as the view sorts them: errors first."""

LIVE_LINES = 200
"""Lines per rank the live view carries (its last ones)."""

SAVED_LINES = 20
"""Lines per rank (or group of ranks printing alike) the saved view keeps."""

_LAST_CHARS = 160
"""A rank's last line is cut to this many characters in the summary."""


@dataclass
class RankRecord:
    rank: int
    state: str = "running"
    lines: list[str] = field(default_factory=list)
    bar: str = ""
    """Its progress bar's current text, while one is drawn."""
    headline: str = ""
    """How it failed (RankError.headline), once it did."""

    def last(self) -> str:
        text = self.headline or self.bar or next(
            (line for line in reversed(self.lines) if line.strip()), "")
        return text if len(text) <= _LAST_CHARS else text[:_LAST_CHARS - 3] + "..."


class RankBoard:
    """Every rank of one cell: what it printed (as the cell shows it, bounded) and its state."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.records = {rank: RankRecord(rank) for rank in ranks}
        self.version = 0
        """Counts changes, so that a view syncs only when something moved."""

    def add_lines(self, rank: int, lines: list[str]) -> None:
        record = self._record(rank)
        record.lines.extend(lines)
        record.bar = ""
        self.version += 1

    def set_bar(self, rank: int, text: str) -> None:
        self._record(rank).bar = text
        self.version += 1

    def set_state(self, rank: int, state: str, headline: str = "") -> None:
        record = self._record(rank)
        record.state, record.headline = state, headline or record.headline
        self.version += 1

    def finish(self, result: CellResult | None) -> None:
        """The cell ended: each rank's final state from `result` (its errors)."""
        errors = result.errors if result is not None else {}
        for rank, record in self.records.items():
            err = errors.get(rank)
            if err is not None:
                state = err.kind if err.kind in ("dead", "interrupted") else "failed"
                self.set_state(rank, state, err.headline())
            elif record.state == "running":
                self.set_state(rank, "finished" if result is not None else "interrupted")

    def ordered(self) -> list[RankRecord]:
        return sorted(self.records.values(), key=lambda r: (ORDER.index(r.state), r.rank))

    def summary(self) -> str:
        """``16 ranks: 12 running, 3 finished, 1 failed (rank 3)``."""
        by_state: dict[str, list[int]] = {}
        for record in self.records.values():
            by_state.setdefault(record.state, []).append(record.rank)
        parts = []
        for state in ORDER:
            ranks = by_state.get(state)
            if ranks:
                named = f" ({who(ranks)})" if state not in ("running", "finished") else ""
                parts.append(f"{len(ranks)} {state}{named}")
        return f"{len(self.records)} ranks: {', '.join(parts)}"

    def live_view(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The rows (errors first) and each rank's last `LIVE_LINES` lines, for the live view."""
        rows = [{"rank": r.rank, "state": r.state, "lines": len(r.lines), "last": r.last()}
                for r in self.ordered()]
        texts = {str(r.rank): "\n".join(r.lines[-LIVE_LINES:]) for r in self.records.values()}
        return rows, texts

    def groups(self) -> list[tuple[list[int], RankRecord]]:
        """Ranks that ended alike (state, line count, last lines) together, errors first."""
        groups: dict[tuple[Any, ...], tuple[list[int], RankRecord]] = {}
        for record in self.ordered():
            key = (record.state, record.headline, len(record.lines),
                   tuple(record.lines[-SAVED_LINES:]))
            groups.setdefault(key, ([], record))[0].append(record.rank)
        return list(groups.values())

    def _record(self, rank: int) -> RankRecord:
        if rank not in self.records:
            self.records[rank] = RankRecord(rank)
        return self.records[rank]


def static_bundle(board: RankBoard, more: str) -> dict[str, str]:
    """The finished cell's view with no widget in it: text/html (kept by JupyterLab's sanitizer
    in an untrusted notebook: details, pre, code) and a text/plain table. `more` says where
    every line is."""
    groups = board.groups()
    return {"text/plain": static_text(board, groups), "text/html": static_html(board, groups, more)}


def static_text(board: RankBoard, groups: Sequence[tuple[list[int], RankRecord]]) -> str:
    rows = [f"  {who(ranks):<14} {record.state:<11} {len(record.lines):>6} lines  {record.last()}"
            for ranks, record in groups]
    return "\n".join([f"nbdist: {board.summary()}", *rows])


def static_html(board: RankBoard, groups: Sequence[tuple[list[int], RankRecord]],
                more: str) -> str:
    items = []
    for ranks, record in groups:
        failed = record.state not in ("running", "finished")
        head = (f"<b>{who(ranks)}</b> · {record.state} · {len(record.lines)} lines · "
                f"{html.escape(record.last())}")
        shown = record.lines[-SAVED_LINES:]
        cut = len(record.lines) - len(shown)
        body = (f"({cut} earlier lines)\n" if cut else "") + "\n".join(shown)
        items.append(f'<details{" open" if failed else ""}><summary>{head}</summary>'
                     f"<pre>{html.escape(body)}</pre></details>")
    return (f'<div class="nbdist-ranks-static"><p><b>nbdist</b>: {html.escape(board.summary())}'
            f". Each rank's last lines below; every line: <code>{html.escape(more)}</code></p>"
            + "".join(items) + "</div>")


def who(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-7``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
