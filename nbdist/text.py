"""Plain-text formatting shared by every layer: one byte formatter and its parser, one table
renderer, one log tail, and terminal colour codes taken out."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """`text` without terminal colour and cursor codes (IPython colours a rank's traceback)."""
    return _ANSI.sub("", text) if "\x1b" in text else text


def format_bytes(value: float | None) -> str:
    """``1.50 GiB`` / ``312 MiB`` / ``12 KiB``: binary units, three significant figures."""
    if value is None or not math.isfinite(value):
        return "–"
    value = float(value)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            scaled = value / size
            digits = 2 if abs(scaled) < 10 else 1 if abs(scaled) < 100 else 0
            return f"{scaled:.{digits}f} {unit}"
    return f"{value:.0f} B"


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int | None:
    """``"1GiB"`` -> 1073741824: a size with a unit (KiB/MiB/GiB/TiB = 1024ⁿ, kB/MB/GB/TB =
    1000ⁿ, none = bytes) as whole bytes; None when `text` is not such a size."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        return None
    return int(float(match.group(1)) * _UNITS[unit])


def render_table(header: Sequence[str], rows: Sequence[Sequence[object]], *,
                 align: str = "left", rule: bool = False) -> str:
    """A fixed-width text table. `align` is "left" or "right" for every column; `rule` draws a
    line of dashes under the header."""
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]

    def line(values: Sequence[str]) -> str:
        pairs = zip(values, widths, strict=True)
        padded = (v.rjust(w) if align == "right" else v.ljust(w) for v, w in pairs)
        return "  ".join(padded).rstrip()

    out = [line(cells[0])]
    if rule:
        out.append(line(["-" * w for w in widths]))
    out.extend(line(row) for row in cells[1:])
    return "\n".join(out)


def tail(text: str, lines: int, skip: str | None = None) -> str:
    """The last `lines` lines of `text`; with `skip`, blank lines and lines containing it are
    left out first (an engine log's own "[IPEngine]" chatter, say)."""
    kept = text.splitlines()
    if skip is not None:
        kept = [line for line in kept if line.strip() and skip not in line]
    return "\n".join(kept[-lines:])
