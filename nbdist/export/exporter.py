"""One ``%dist_export`` as a plain function: pick the cells (this session's history or a saved
notebook), write the script, and report what was written and what was left out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nbdist.export.script_text import write_script
from nbdist.export.session_log import SessionLog
from nbdist.export.sources import cells_from_history, cells_from_notebook, notebook_log
from nbdist.export.steps import DistributedCell, Step, failed_cells, placeholders, script_steps

DEFAULT_NPROC = 2
"""Ranks the script is written for when neither --nproc nor a running cluster says."""


@dataclass
class ExportReport:
    """What an export wrote: the script's path, the rank count it is written for, its steps."""

    path: Path
    nproc: int
    steps: list[Step]

    def summary(self) -> list[str]:
        """What to tell the user: cell runs written, failed cells left out, values to define."""
        cells = [s for s in self.steps if isinstance(s, DistributedCell)]
        failed = failed_cells(self.steps)
        lines = [f"wrote {len(cells) - len(failed)} cell run(s) to {self.path}; run it with "
                 f"torchrun --nproc-per-node {self.nproc} {self.path}"]
        if failed:
            labels = ", ".join(c.label for c in failed)
            lines.append(f"left out {len(failed)} cell(s) that failed in the notebook "
                         f"({labels}); they are in the script as comments")
        missing = placeholders(self.steps)
        if missing:
            listed = "; ".join(f"{v.name} ({v.description})" for v in missing)
            lines.append(f"warning: {len(missing)} pushed value(s) cannot be written into the "
                         f"script: {listed}. The script raises NotImplementedError where each was "
                         "pushed: define them there.")
        return lines


def export_session(target: str | Path, raw_history: Sequence[str], session_log: SessionLog,
                   notebook: str | Path | None = None, world_size: int | None = None,
                   threads: int | None = None, nproc: int | None = None) -> ExportReport:
    """Write ``target`` from a saved ``notebook`` if given, else from this session's raw input
    history and log. ``world_size`` and ``threads`` come from the running cluster (None: none
    runs); the script is written for ``nproc`` ranks, else the cluster's, else two."""
    ranks = nproc or world_size or DEFAULT_NPROC
    if notebook:
        sources, log = cells_from_notebook(notebook), notebook_log(notebook)
    else:
        sources, log = cells_from_history(raw_history), session_log
    steps = script_steps(sources, world_size, log)
    path = write_script(target, steps, nproc=ranks, threads=threads)
    return ExportReport(path=path, nproc=ranks, steps=steps)
