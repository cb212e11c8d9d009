"""`%dist_run script.py [args]`: the cell that runs an existing torchrun script on every rank,
unchanged (the rank side is `nbdist.worker.pasted_code`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from nbdist.errors import NbdistError


def script_cell(path: str, argv: Sequence[str] = (), must_exist: bool = True) -> str:
    """One line of Python that runs `path` with `argv` in the rank's namespace. A cell, so that
    live output, the dashboard, interrupts and fault reports work as for any other cell."""
    if must_exist and not os.path.isfile(path):
        raise NbdistError(
            f"%dist_run: no script {path!r} (from {os.getcwd()}); the ranks run it from this "
            "notebook's working directory"
        )
    arguments = [str(a) for a in argv]
    return (
        "__import__('nbdist.worker.pasted_code', fromlist=['run_rank_script'])"
        f".run_rank_script({path!r}, {arguments!r}, globals())"
    )
