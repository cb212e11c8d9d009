"""How a rank shows a cell's error: from the cell's first frame on, without nbdist's own frames
(its wrappers around torch.distributed, a pasted launcher run in place), drawn by IPython; plain
tracebacks for the errors nbdist reports by one line only (an interrupt, a peer gone): IPython's
formatter costs seconds of CPU per rank there (docs/FAULTS.md)."""

from __future__ import annotations

import os
import sys
import traceback as _traceback
from types import TracebackType
from typing import Any

from nbdist import ipp_compat, torch_support
from nbdist.worker import rank_memory
from nbdist.worker.collectives import is_cell_file, is_transport_failure
from nbdist.worker.pinning import device_index_hint

_NBDIST = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""nbdist's package directory: a frame of a file under it is nbdist's own."""


def install(shell: Any) -> None:
    # every error a cell raises: its traceback is trimmed before IPython draws it
    shell.set_custom_exc((Exception, KeyboardInterrupt), _format)
    # IPython's history keeps a second rendering of every error; the engines never need it
    ipp_compat.skip_stored_tracebacks(shell, _for_storage)


def _format(shell: Any, etype: type, value: BaseException, tb: Any,
            tb_offset: Any = None) -> list[str]:
    """IPython's custom-exception hook. It must show the error itself: IPython 9 drops what the
    hook returns, and ipykernel's error reply takes the traceback from ``_showtraceback``."""
    _note_old_torch(etype, value)
    shown = users_frames(tb)
    stb: list[str] = []
    with rank_memory.lifted():  # an error that hit --memory-limit must still be shown
        if etype is KeyboardInterrupt or is_transport_failure(value):
            lines = _traceback.format_exception(etype, value, shown or tb)
            stb = ["".join(lines).rstrip("\n")]
            ipp_compat.show_traceback(shell, etype, value, stb)
        elif issubclass(etype, SyntaxError):
            # IPython's caret block, under the cell's frames when its code raised it (compile,
            # ast.parse): IPython's showsyntaxerror would take every frame from sys.exc_info()
            frames = _traceback.extract_tb(shown) if shown is not None else []
            stb = shell.SyntaxTB.structured_traceback(etype, value, frames)
            ipp_compat.show_traceback(shell, etype, value, stb)
        else:  # IPython's own drawing (or an exception's own, _render_traceback_)
            shell.showtraceback((etype, value, shown or tb),
                                tb_offset=0 if shown is not None else tb_offset)
    # as showtraceback leaves them, but with every frame: post-mortem debugging walks them all
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    return stb


def _note_old_torch(etype: type, value: BaseException) -> None:
    """One line saying which torch a feature needs, when the error is how an older one fails;
    or which GPU is the rank's, when code took LOCAL_RANK for its index."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(value, "add_note"):
        return
    note = (torch_support.hint(etype.__name__, str(value), str(torch.__version__))
            or device_index_hint(str(value), os.environ))
    if note and note not in getattr(value, "__notes__", []):
        value.add_note(note)


def first_cell_frame(tb: Any) -> Any:
    """The traceback from the first cell frame on; None when no frame is a cell's."""
    while tb is not None and not is_cell_file(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def users_frames(tb: Any) -> TracebackType | None:
    """The traceback a user reads: from the first cell frame on, nbdist's own frames left out
    but the last (where nbdist itself raised, its message says why); None without a cell frame.
    A new chain: the exception keeps its own traceback, whole."""
    first = first_cell_frame(tb)
    frames = []
    while first is not None:
        frames.append(first)
        first = first.tb_next
    if not frames:
        return None
    kept = [frame for frame in frames[:-1]
            if not frame.tb_frame.f_code.co_filename.startswith(_NBDIST)] + frames[-1:]
    if len(kept) == len(frames):
        return frames[0]
    chain = None
    for frame in reversed(kept):
        chain = TracebackType(chain, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return chain


def _for_storage(exception: BaseException, *_: Any, **__: Any) -> dict[str, Any]:
    return {"ename": type(exception).__name__, "evalue": str(exception), "traceback": []}
