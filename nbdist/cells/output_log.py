"""Every line each rank printed in a cell, kept whole however much of it the notebook showed
(stdout and stderr as they came): in memory while the rank's output fits the cell, and once it
does not, in a file per rank in the cluster's private work directory (one folder per cell).
``CellResult.output(rank)`` and ``Cluster.output(rank)`` read it back."""

from __future__ import annotations

import os
import shutil
import time
from typing import IO

KEPT_CELLS = 20
"""Cells whose log folders stay on disk (the oldest go first); all go with ``%dist_stop``."""


class RankLogs:
    """The logs of one cell. A rank's text stays in memory until `spill` moves it to its file
    (a cell that prints little opens no file at all)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.directory = ""
        self._chunks: dict[int, list[str]] = {}
        self._files: dict[int, IO[str]] = {}

    def write(self, rank: int, text: str) -> None:
        out = self._files.get(rank)
        if out is not None:
            out.write(text)
        else:
            self._chunks.setdefault(rank, []).append(text)

    def spill(self, rank: int) -> None:
        """From now on the rank's text goes to its file (what it printed so far first)."""
        if rank in self._files:
            return
        if not self.directory:
            self.directory = _new_cell_folder(self.root)
        out = self._files[rank] = open(log_path(self.directory, rank), "w", encoding="utf-8",
                                       errors="replace")
        out.write("".join(self._chunks.pop(rank, ())))

    def close(self) -> dict[int, str]:
        """Close the files; the text of the ranks that stayed in memory, by rank."""
        for out in self._files.values():
            out.close()
        kept = {rank: "".join(chunks) for rank, chunks in self._chunks.items()}
        self._chunks.clear()
        return kept


def log_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.log")


def read_log(directory: str, rank: int) -> str:
    """What `rank` printed, from the cell folder `directory` ("" if it has no file there)."""
    if not directory:
        return ""
    try:
        with open(log_path(directory, rank), encoding="utf-8") as log:
            return log.read()
    except FileNotFoundError:
        return ""


def _new_cell_folder(root: str) -> str:
    os.makedirs(root, mode=0o700, exist_ok=True)
    folders = sorted(entry.path for entry in os.scandir(root) if entry.is_dir())
    for old in folders[:max(0, len(folders) - KEPT_CELLS + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    # named by time, so that they sort in the order the cells ran; 0700, as the work directory
    folder = os.path.join(root, f"cell-{time.time_ns():020d}")
    os.mkdir(folder, mode=0o700)
    return folder
