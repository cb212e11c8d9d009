"""Turn what came back from a rank into a `RankError` (a remote exception, or a dead engine), and
after the cell tell root causes from consequences (a rank released from a collective by a peer)."""

from __future__ import annotations

import re
from typing import Any

from nbdist.cells.result import CellResult, RankError
from nbdist.worker.collectives import is_cell_file

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def rank_error_from_remote(rank: int, error: Any) -> RankError:
    """From a rank's error (ename, evalue, traceback; a RemoteError too): ``interrupted`` for a
    KeyboardInterrupt (with the cell line it stopped at), else ``root``."""
    ename = getattr(error, "ename", type(error).__name__)
    evalue = getattr(error, "evalue", str(error))
    traceback = getattr(error, "traceback", "") or ""
    if isinstance(traceback, list):
        traceback = "\n".join(traceback)
    kind = "interrupted" if ename == "KeyboardInterrupt" else "root"
    where = _last_cell_line(traceback) if kind == "interrupted" else ""
    return RankError(
        rank=rank, kind=kind, ename=ename, evalue=evalue, traceback=traceback, where=where
    )


_FRAME = re.compile(r'File "([^"]+)", line (\d+)|(Cell In\[\d+\]), line (\d+)|File (\S+):(\d+)')


def _last_cell_line(traceback: str) -> str:
    """The innermost frame of the cell itself: a rank interrupted inside torch (DDP's backward)
    has torch's frames below it, whose line numbers say nothing about the cell."""
    lines: list[str] = []
    for match in _FRAME.finditer(_ANSI.sub("", traceback)):
        filename = match.group(1) or match.group(3) or match.group(5) or ""
        if filename.startswith("Cell In") or is_cell_file(filename):
            lines.append(match.group(2) or match.group(4) or match.group(6))
    return f"cell line {lines[-1]}" if lines else ""


def dead_rank_error(rank: int, detail: str, output: str, engine_log: str) -> RankError:
    """A rank whose engine died: `detail` (why), then its last output lines and the crash part
    of its engine log, so the user sees what it was doing."""
    lines = []
    tail = [line for line in output.splitlines() if line.strip()][-5:]
    if tail:
        lines.append("its last output lines:")
        lines.extend(f"  {line}" for line in tail)
    log_tail = _crash_excerpt(engine_log)
    if log_tail:
        lines.append("its engine log ends with:")
        lines.extend(f"  {line}" for line in log_tail.splitlines())
    return RankError(
        rank=rank, kind="dead", ename="RankDied", evalue=detail, traceback="\n".join(lines)
    )


_CXX_REASON = re.compile(r"what\(\):\s+(.+)")
"""std::terminate's line for an uncaught C++ exception: why gloo (or another C++ library) ended
the process from a thread of its own, printed among faulthandler's thread dump."""

CXX_EXCEPTION = "uncaught C++ exception"
"""How a dead rank's report names that line (the process may end by SIGABRT or, while it
aborts, by SIGSEGV in another thread: gloo's size check ends it either way)."""


def _crash_excerpt(log: str) -> str:
    """From an engine log: the C++ exception that ended it, if one did, then faulthandler's block
    ("Fatal Python error: ...") if there is one."""
    lines = [ln for ln in log.splitlines() if "[KernelNanny" not in ln]
    reasons = [match.group(1).strip() for match in map(_CXX_REASON.search, lines) if match]
    head = [f"{CXX_EXCEPTION}: {reasons[-1]}"] if reasons else []
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    if starts:
        return "\n".join(head + lines[starts[-1]:starts[-1] + 12])
    return "\n".join(head + lines[-8:])


def classify_errors(
    result: CellResult, reports: dict[int, dict[str, Any]], ladder_ran: bool, killed: dict[int, str]
) -> None:
    """Re-label `result.errors` with what the ranks' post-cell `reports` say: an error raised
    inside a collective because a peer failed (or nbdist's ladder released it) is a consequence
    (``collective``), not a root cause; ranks nbdist killed at the deadline are ``dead``."""
    for rank, err in result.errors.items():
        failed_in = (reports.get(rank) or {}).get("failed_in")
        released = err.kind == "root" or (
            # SIGINT from nbdist's own ladder (not the user's stop button) while in a collective
            err.kind == "interrupted" and not result.interrupted and not result.timed_out
        )
        if failed_in and released:
            err.kind = "collective"
            err.where = f"{failed_in['name']} at {failed_in['location']}"
        elif failed_in and err.kind == "interrupted":
            err.where = f"{failed_in['name']} at {failed_in['location']}"
    if not [e for e in result.errors.values() if e.kind in ("root", "dead")]:
        # nobody raised first-hand: keep the collective errors' full tracebacks as the cause
        for err in result.errors.values():
            if err.kind == "collective" and not ladder_ran:
                err.kind = "root"
    if result.timed_out:
        for rank in killed:
            result.errors[rank].kind = "dead"
