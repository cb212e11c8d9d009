"""Rank side of `%dist_debug`: a post-mortem `pdb.Pdb` on the rank's last failed cell, kept
between calls, that runs one command at a time and returns what it printed.

The notebook drives it (`nbdist.cells.post_mortem`), so tensors stay on the rank. The traceback
is the one IPython saved (`sys.last_exc` / `sys.last_value`), or, when nbdist's process-group
teardown cleared those to release a peer from a collective, the copy it kept.
"""

from __future__ import annotations

import contextlib
import io
import pdb
import sys
from typing import Any

from nbdist.worker import process_group
from nbdist.worker.tracebacks import first_cell_frame


def last_exception() -> BaseException | None:
    return (getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
            or process_group.kept_error())


QUIT_COMMANDS = frozenset({"q", "quit", "exit", "c", "cont", "continue"})
"""End the session: the rank is never resumed (post-mortem), so continue means quit too."""


class PostMortem:
    """A `pdb.Pdb` set up on a traceback that never reads stdin: `run(command)` returns the text
    the command printed. Frames start at the first cell frame (IPython's own frames dropped)."""

    def __init__(self, traceback: Any) -> None:
        self.output = io.StringIO()
        self.pdb = pdb.Pdb(stdin=io.StringIO(), stdout=self.output, readrc=False)
        self.pdb.prompt = ""
        self.pdb.reset()
        self.pdb.setup(None, first_cell_frame(traceback) or traceback)

    def current(self) -> str:
        """The frame the session is in, as pdb shows it on entry (`> file(line)func()`)."""
        with self._capture() as out:
            self.pdb.print_stack_entry(self.pdb.stack[self.pdb.curindex])
        return out.getvalue()

    def run(self, command: str) -> str:
        with self._capture() as out:
            self.pdb.onecmd(command)
        return out.getvalue()

    @contextlib.contextmanager
    def _capture(self) -> Any:
        self.output.seek(0)
        self.output.truncate()
        # statements (`!x = 1`, `print(x)`) print to sys.stdout, pdb's own commands to its stdout
        with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output):
            yield self.output

    def close(self) -> None:
        self.pdb.forget()  # drop the frame references pdb holds; the traceback itself stays


_SESSION: PostMortem | None = None


def last_traceback() -> Any:
    """The traceback of the last failed cell on this rank, or None."""
    exc = last_exception()
    tb = getattr(exc, "__traceback__", None) if exc is not None else None
    return tb if tb is not None else getattr(sys, "last_traceback", None)


def last_error() -> str:
    exc = last_exception()
    return "" if exc is None else f"{type(exc).__name__}: {exc}"


def start() -> dict[str, Any]:
    """Open a session on the last failed cell: {"ok", "error", "text"} (text: the current frame,
    or why there is nothing to debug)."""
    global _SESSION
    stop()
    tb = last_traceback()
    if tb is None:
        return {"ok": False, "error": "", "text": "no traceback to debug on this rank (its last "
                "cell did not fail, or the traceback was dropped when its process group was "
                "torn down)"}
    if first_cell_frame(tb) is None:
        return {"ok": False, "error": "", "text": f"the last error on this rank ({last_error()}) "
                "was not raised in a cell"}
    _SESSION = PostMortem(tb)
    return {"ok": True, "error": last_error(), "text": _SESSION.current()}


def command(line: str) -> dict[str, Any]:
    """Run one pdb command: {"text", "done"}; a quit command (`QUIT_COMMANDS`) ends the session."""
    if _SESSION is None:
        return {"text": "no debugging session on this rank", "done": True}
    if line.strip() in QUIT_COMMANDS:
        stop()
        return {"text": "", "done": True}
    return {"text": _SESSION.run(line), "done": False}


def stop() -> None:
    global _SESSION
    if _SESSION is not None:
        _SESSION.close()
    _SESSION = None
