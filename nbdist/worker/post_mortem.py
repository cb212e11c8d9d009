"""Rank side of `%dist_debug`: a post-mortem pdb on the last failed cell, kept between calls, one
command at a time, returning what it printed (tensors stay on the rank)."""

from __future__ import annotations

import contextlib
import io
import pdb
import sys
from typing import Any

from nbdist.worker import process_group
from nbdist.worker.rank_service import command as rank_command
from nbdist.worker.tracebacks import first_cell_frame

# post-mortem: the rank is never resumed, so continue means quit too
QUIT_COMMANDS = frozenset({"q", "quit", "exit", "c", "cont", "continue"})


class CapturedPdb(pdb.Pdb):
    """pdb whose every word goes to `output` (also breakpoints.RankPdb's base)."""

    def __init__(self, **kwargs: Any) -> None:
        self.output = io.StringIO()
        super().__init__(stdin=io.StringIO(), stdout=self.output, readrc=False, **kwargs)

    def take_output(self) -> str:
        text = self.output.getvalue()
        self.output.seek(0)
        self.output.truncate()
        return text

    def onecmd(self, line: str) -> bool:
        # statements (`!x = 1`, `print(x)`) print to sys.stdout: they belong with pdb's answer
        with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output):
            return bool(super().onecmd(line))


class PostMortem(CapturedPdb):
    """pdb on a traceback, from its first cell frame on."""

    def __init__(self, traceback: Any) -> None:
        super().__init__()
        self.prompt = ""
        self.reset()
        self.setup(None, first_cell_frame(traceback) or traceback)
        self.print_stack_entry(self.stack[self.curindex])  # as pdb shows the frame on entry

    def run_command(self, command: str) -> str:
        """What `command` printed."""
        self.take_output()
        self.onecmd(command)
        return self.take_output()


_SESSION: PostMortem | None = None


@rank_command("post_mortem.start", main_thread=True)
def start() -> dict[str, Any]:
    """A session on the last failed cell: {"ok", "error", "text": its frame, or why none}."""
    global _SESSION
    stop()
    # what IPython saved, or the copy the process group's teardown kept when it cleared that
    exc = (getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
           or process_group.KEPT_ERROR)
    if exc is None or exc.__traceback__ is None:
        return {"ok": False, "error": "", "text": "no traceback to debug on this rank (its last "
                "cell did not fail, or the traceback was dropped when its process group was "
                "torn down)"}
    error = f"{type(exc).__name__}: {exc}"
    if first_cell_frame(exc.__traceback__) is None:
        return {"ok": False, "error": "", "text": f"the last error on this rank ({error}) "
                "was not raised in a cell"}
    _SESSION = PostMortem(exc.__traceback__)
    return {"ok": True, "error": error, "text": _SESSION.take_output()}


@rank_command("post_mortem.command", main_thread=True)
def command(line: str) -> dict[str, Any]:
    """One pdb command: {"text", "done"}; a quit command ends the session."""
    if _SESSION is None:
        return {"text": "no debugging session on this rank", "done": True}
    if line.strip() in QUIT_COMMANDS:
        stop()
        return {"text": "", "done": True}
    return {"text": _SESSION.run_command(line), "done": False}


@rank_command("post_mortem.stop", main_thread=True)
def stop() -> None:
    global _SESSION
    if _SESSION is not None:
        _SESSION.forget()  # drop the frame references pdb holds; the traceback itself stays
    _SESSION = None
