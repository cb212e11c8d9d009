"""Every tutorial is stored with the outputs of a real run, and the comparison that keeps them from
going stale (tests/notebook_outputs.py) catches a moved figure and a changed structure. The fresh
runs themselves are compared in `-m notebooks` (tests/test_notebooks.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest

from tests.notebook_outputs import (
    _NUMBER,
    FIGURES,
    cell_numbers,
    compare,
    missing_outputs,
    output_kinds,
)
from tests.test_notebooks import NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_is_saved_with_its_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert missing_outputs(nb, path.stem) == []
    assert any(cell.get("outputs") for cell in nb.cells), f"{path.stem}: no cell shows anything"


def _figure_cells() -> list[tuple[Path, int]]:
    found = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        found += [(path, i) for i, cell in enumerate(nb.cells)
                  if FIGURES in cell.metadata.get("tags", []) and cell_numbers(cell)]
    return found


def test_the_tutorials_record_figures() -> None:
    notebooks = {path.stem for path, _index in _figure_cells()}
    assert len(notebooks) >= 8, f"only {sorted(notebooks)} record figures"


def test_a_saved_notebook_matches_itself_and_a_moved_figure_is_caught() -> None:
    path, index = _figure_cells()[0]
    saved = nbformat.read(path, as_version=4)
    assert compare(saved, copy.deepcopy(saved), path.stem) == []
    moved = copy.deepcopy(saved)
    for output in moved.cells[index].outputs:  # every number in the cell doubled
        key = "text" if output["output_type"] == "stream" else None
        if key:
            output["text"] = _doubled(output["text"])
        elif "text/plain" in output.get("data", {}):
            output["data"]["text/plain"] = _doubled(output["data"]["text/plain"])
    problems = compare(saved, moved, path.stem)
    assert len(problems) == 1 and "moved beyond" in problems[0], problems


def test_a_changed_output_structure_is_caught() -> None:
    path = NOTEBOOKS[0]
    saved = nbformat.read(path, as_version=4)
    changed = copy.deepcopy(saved)
    index = next(i for i, cell in enumerate(changed.cells) if cell.cell_type == "code" and cell.outputs)
    changed.cells[index].outputs.append(nbformat.v4.new_output(
        "error", ename="RuntimeError", evalue="boom", traceback=[]))
    problems = compare(saved, changed, path.stem)
    assert len(problems) == 1 and "error:RuntimeError" in problems[0], problems
    assert "error:RuntimeError" in output_kinds(changed.cells[index])


def _doubled(text: str) -> str:
    return _NUMBER.sub(lambda m: repr(float(m.group()) * 2 + 1), text)
