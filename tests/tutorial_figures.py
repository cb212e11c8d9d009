"""The figures a tutorial's prose quotes, checked against the outputs the tutorial shows.

A markdown cell that quotes what a code cell printed says so in an HTML comment, which Jupyter
and the docs site do not render:

    the budget in use after training, 236 of 288 MiB, against 160.2 MiB of model states
    <!-- figures from cell 16: "236 of 288 MiB" "160.2 MiB" -->

Each quoted text must appear in the markdown cell's own prose (line breaks count as spaces) and
in the text that code cell 16 shows (its printed lines and the plain text of its displays, colour
codes removed), not as part of a longer number. A re-saved run whose numbers moved then fails
`tests/test_tutorial_figures.py` until the prose says what the outputs say.
"""

from __future__ import annotations

import re

import nbformat

from nbdist.text import strip_ansi

MARKER = re.compile(r"<!--\s*figures\b(.*?)-->", re.S)
"""Any comment that starts with `figures`: a malformed one is reported, not skipped."""

_WELL_FORMED = re.compile(r"\s+from cell (\d+):((?:\s*\"[^\"]+\")+)\s*$", re.S)
_QUOTED = re.compile(r"\"([^\"]+)\"")


def _flat(text: str) -> str:
    return " ".join(text.split())


def shown_text(cell: nbformat.NotebookNode) -> str:
    """What a code cell shows as text: streams and the plain text of results and displays."""
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        else:
            parts.append(output.get("data", {}).get("text/plain", ""))
    return _flat(strip_ansi("\n".join(parts)))


def _appears(quote: str, text: str) -> bool:
    """`quote` in `text`, not inside a longer number or word (236 is not in 2360 or 1.236)."""
    edge = r"(?<![\w.])" if quote[0].isalnum() else ""
    tail = r"(?![\w])" if quote[-1].isalnum() else ""
    return re.search(edge + re.escape(quote) + tail, text) is not None


def quoted_figures(nb: nbformat.NotebookNode) -> list[tuple[int, int, str]]:
    """(markdown cell, code cell, quoted text) of every well-formed marker."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for marker in MARKER.finditer(cell.source):
            parsed = _WELL_FORMED.match(marker.group(1))
            if parsed:
                found += [(index, int(parsed.group(1)), quote)
                          for quote in _QUOTED.findall(parsed.group(2))]
    return found


def problems(nb: nbformat.NotebookNode, name: str) -> list[str]:
    """Each quote that its prose or its code cell's outputs do not carry; malformed markers."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for marker in MARKER.finditer(cell.source):
            if not _WELL_FORMED.match(marker.group(1)):
                found.append(f"{name} cell {index}: malformed marker {marker.group(0)!r}: write"
                             ' <!-- figures from cell N: "text" "text" -->')
    for index, source, quote in quoted_figures(nb):
        where = f"{name} cell {index} quotes {quote!r} from cell {source}"
        if not 0 <= source < len(nb.cells) or nb.cells[source].cell_type != "code":
            found.append(f"{where}, which is not a code cell")
            continue
        if not any(ch.isdigit() for ch in quote):
            found.append(f"{where}: a quoted figure holds a number")
        if not _appears(quote, _flat(MARKER.sub("", nb.cells[index].source))):
            found.append(f"{where}, but its prose does not say {quote!r}")
        if not _appears(quote, shown_text(nb.cells[source])):
            found.append(f"{where}, but that cell's saved outputs do not show it:"
                         f" {shown_text(nb.cells[source])[:300]!r}")
    return found
