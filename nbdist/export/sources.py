"""Where an export's cells come from: this session's input history, or a saved .ipynb (its code
cells in document order, failures read from saved error outputs, pushes from literal lines)."""

from __future__ import annotations

import ast
import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbdist.export.session_log import FAILURE_LINE_LIMIT, PushedValue, SessionLog

SKIP_TAGS = frozenset({"raises-exception", "nbdist-no-export"})
"""Notebook cell tags whose cells are left out of an export (failures on purpose, demos)."""

_PUSH_LINE = "%dist_push"

def cells_from_history(raw_history: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, source)`` pairs from IPython's raw input history (index = execution count)."""
    return [(f"In[{i}]", src) for i, src in enumerate(raw_history) if i > 0 and src.strip()]


def cells_from_notebook(path: str | Path) -> list[tuple[str, str]]:
    """``(label, source)`` pairs of a .ipynb's code cells in document order, minus skipped tags."""
    out = []
    for label, cell in _code_cells(path):
        if SKIP_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        out.append((label, _source(cell)))
    return out


def notebook_log(path: str | Path) -> SessionLog:
    """A :class:`SessionLog` from a saved .ipynb (labels as :func:`cells_from_notebook` gives them):
    cells whose saved output is an error count as failed; pushed values are known only where
    the line spells a literal (``%dist_push lr=0.1``), the others become placeholders."""
    log = SessionLog()
    for label, cell in _code_cells(path):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            evalue = str(errors[0].get("evalue", "")).strip().splitlines()
            log.failures[label] = (f"its saved output is an error: {errors[0].get('ename', '')}"
                                   f"{': ' + evalue[0] if evalue else ''}")[:FAILURE_LINE_LIMIT]
        for line in _source(cell).splitlines():
            words = line.strip().split(None, 1)
            if len(words) == 2 and words[0] == _PUSH_LINE:
                log.pushes.setdefault(label, []).extend(_pushes_in_line(words[1]))
    return log


def _code_cells(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(label, cell)`` for each code cell; the label counts every cell, as Jupyter does."""
    with open(path, encoding="utf-8") as f:
        notebook = json.load(f)
    return [(f"cell {index}", cell) for index, cell in enumerate(notebook.get("cells", []))
            if cell.get("cell_type") == "code"]


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _pushes_in_line(arguments: str) -> list[PushedValue]:
    values = []
    for item in shlex.split(arguments):
        name, has_expr, expr = item.partition("=")
        try:
            if has_expr:
                values.append(PushedValue.of(name.strip(), ast.literal_eval(expr)))
            else:
                unknown = "value unknown: a saved .ipynb does not hold it"
                values.append(PushedValue(name, None, unknown))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            values.append(PushedValue(name.strip(), None, f"the value of `{expr}` in the notebook"))
    return values
