"""Notebook to torchrun script: the %%distributed cells and pushed values of a session or a saved
notebook, written as one script that runs the same under torchrun."""

from nbdist.export.exporter import DEFAULT_NPROC, ExportReport, export_session
from nbdist.export.run import script_cell
from nbdist.export.script_text import export_script, script_head, write_script
from nbdist.export.session_log import PushedValue, SessionLog, describe_failure
from nbdist.export.sources import SKIP_TAGS, cells_from_history, cells_from_notebook, notebook_log
from nbdist.export.steps import (
    MAGIC,
    DistributedCell,
    Push,
    Step,
    distributed_cells,
    failed_cells,
    placeholders,
    script_steps,
)

__all__ = [
    "DEFAULT_NPROC",
    "MAGIC",
    "SKIP_TAGS",
    "DistributedCell",
    "ExportReport",
    "Push",
    "PushedValue",
    "SessionLog",
    "Step",
    "cells_from_history",
    "cells_from_notebook",
    "describe_failure",
    "distributed_cells",
    "export_script",
    "export_session",
    "failed_cells",
    "notebook_log",
    "placeholders",
    "script_cell",
    "script_head",
    "script_steps",
    "write_script",
]
