"""Plain tracebacks on the ranks for the errors nbdist reports by one line only (an interrupt,
a peer gone): IPython's formatter costs seconds of CPU per rank there (docs/FAULTS.md)."""

from __future__ import annotations

import os
import sys
import traceback as _traceback
from typing import Any

from nbdist import ipp_compat, torch_support
from nbdist.worker import rank_memory
from nbdist.worker.collectives import is_cell_file, is_transport_failure
from nbdist.worker.pinning import device_index_hint


def install(shell: Any) -> None:
    # AttributeError: how a torch older than a feature needs fails (torch_support.FEATURES)
    shell.set_custom_exc((KeyboardInterrupt, RuntimeError, MemoryError, AttributeError), _format)
    # IPython's history keeps a second rendering of every error; the engines never need it
    ipp_compat.skip_stored_tracebacks(shell, _for_storage)


def _format(shell: Any, etype: type, value: BaseException, tb: Any,
            tb_offset: Any = None) -> list[str]:
    """IPython's custom-exception hook. It must show the error itself: IPython 9 drops what the
    hook returns, and ipykernel's error reply takes the traceback from ``_showtraceback``."""
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # as showtraceback does
    _note_old_torch(etype, value)
    with rank_memory.lifted():  # an error that hit --memory-limit must still be shown
        if etype is KeyboardInterrupt or is_transport_failure(value):
            # Python's own format from the first cell frame on (IPython's own frames dropped)
            lines = _traceback.format_exception(etype, value, first_cell_frame(tb) or tb)
            stb = ["".join(lines).rstrip("\n")]
        else:
            stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
        ipp_compat.show_traceback(shell, etype, value, stb)
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


def _for_storage(exception: BaseException, *_: Any, **__: Any) -> dict[str, Any]:
    return {"ename": type(exception).__name__, "evalue": str(exception), "traceback": []}
