"""Every figure a tutorial's prose quotes is one its saved outputs show (tests/tutorial_figures.py):
a re-saved run cannot silently contradict the text around it. Reads the saved notebooks only, so
it runs in the default suite; `python -m tests.notebook_outputs` reports the same after a save."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from tests.tutorial_figures import problems, quoted_figures

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

QUOTING = {"02_ddp", "04_fsdp", "06_memory_anatomy", "08_pipeline_parallel", "13_memory_savers"}
"""Tutorials whose prose quotes their outputs' figures (each carries at least one marker)."""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_quoted_figures_are_the_ones_shown(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert not problems(nb, path.stem), "\n".join(problems(nb, path.stem))
    if path.stem in QUOTING:
        assert quoted_figures(nb), f"{path.stem} lost its figure markers"


def _notebook(prose: str, printed: str) -> nbformat.NotebookNode:
    code = nbformat.v4.new_code_cell("print(...)", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=printed)])
    return nbformat.v4.new_notebook(cells=[code, nbformat.v4.new_markdown_cell(prose)])


def test_a_quote_the_outputs_no_longer_show_is_reported() -> None:
    prose = 'In use: 236 of\n288 MiB.\n<!-- figures from cell 0: "236 of 288 MiB" -->'
    assert problems(_notebook(prose, "\x1b[34m[rank 0]\x1b[0m in use: 236 of 288 MiB\n"), "t") == []
    moved = problems(_notebook(prose, "[rank 0] in use: 2360 of 288 MiB\n"), "t")
    assert len(moved) == 1 and "saved outputs do not show it" in moved[0]


def test_a_quote_the_prose_does_not_say_and_a_bad_marker_are_reported() -> None:
    unsaid = problems(_notebook('Falls. <!-- figures from cell 0: "0.059" -->', "loss 0.059"), "t")
    assert len(unsaid) == 1 and "its prose does not say '0.059'" in unsaid[0]
    malformed = problems(_notebook("x <!-- figures cell 0 0.059 -->", "loss 0.059"), "t")
    assert len(malformed) == 1 and "malformed marker" in malformed[0]
    not_code = problems(_notebook('7 <!-- figures from cell 1: "7" -->', "7"), "t")
    assert len(not_code) == 1 and "not a code cell" in not_code[0]
