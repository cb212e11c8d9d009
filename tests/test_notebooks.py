"""Every tutorial executes headless (nbclient, the venv's python3 kernel) on CPU.

A notebook fails the test if any cell errors, except cells tagged ``raises-exception`` — and those
must raise, or the tag (and the lesson) has gone stale — or if its outputs no longer match the ones
saved in the repository (tests/notebook_outputs.py: structure, and figures within a tolerance).
00_quickstart runs in the default suite; the whole set runs with ``-m notebooks`` (a few minutes on
2 cores). 12_multi_node_slurm runs
through Slurm where ``sinfo`` answers and on local engines elsewhere; ``-m slurm`` runs it against
the test scheduler (tests/test_slurm.py):

    .venv/bin/python -m pytest -q -m notebooks tests/test_notebooks.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
DEFAULT_SUITE = {"00_quickstart"}
"""Run on every `pytest -q`; the rest are marked `notebooks`."""

CELL_TIMEOUT = 240
"""Seconds per cell: generous for a loaded 2-core CI machine (a cluster start is ~10-25 s)."""

RAISES = "raises-exception"

REQUIRES = "nbdist_requires"
"""Notebook metadata: the packages beyond nbdist's own a tutorial uses (without them: a skip)."""


def missing_packages(path: Path) -> list[str]:
    from importlib.util import find_spec

    needed = nbformat.read(path, as_version=4).metadata.get(REQUIRES, [])
    return [name for name in needed if find_spec(name) is None]


def run_notebook(path: Path, workdir: Path, kernel_name: str = "python3") -> tuple[nbformat.NotebookNode, float]:
    """Execute a copy of the notebook in `workdir`; returns it with its outputs and the seconds taken."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, kernel_name=kernel_name, timeout=CELL_TIMEOUT, allow_errors=False,
        resources={"metadata": {"path": str(workdir)}},
    )
    started = time.perf_counter()
    client.execute()  # nbclient itself lets tagged cells raise and fails on any other error
    return nb, time.perf_counter() - started


def check_tagged_cells_raised(nb: nbformat.NotebookNode, name: str) -> None:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and RAISES in cell.metadata.get("tags", []):
            errors = [o for o in cell.outputs if o.get("output_type") == "error"]
            assert errors, f"{name} cell {index} is tagged {RAISES} but did not raise:\n{cell.source}"


def _params() -> list[object]:
    marks = []
    for path in NOTEBOOKS:
        extra = () if path.stem in DEFAULT_SUITE else (pytest.mark.notebooks,)
        marks.append(pytest.param(path, id=path.stem, marks=extra))
    return marks


def test_every_tutorial_is_here() -> None:
    names = {p.stem for p in NOTEBOOKS}
    expected = {
        "00_quickstart", "01_collectives", "02_ddp", "03_ddp_model_parallel", "04_fsdp",
        "05_deepspeed", "06_memory_anatomy", "07_tensor_parallel", "08_pipeline_parallel",
        "09_rpc_parameter_server", "10_when_things_go_wrong", "11_notebook_to_script",
        "12_multi_node_slurm", "13_memory_savers", "15_bring_your_own_code",
        "16_data_and_evaluation", "17_2d_parallel",
    }
    assert expected <= names, f"missing: {sorted(expected - names)}"


def test_a_tutorial_names_the_packages_it_needs(tmp_path: Path) -> None:
    """What `test_notebook_executes` skips on: the packages in REQUIRES that are not installed."""
    path = tmp_path / "needs.ipynb"
    nbformat.write(nbformat.v4.new_notebook(metadata={REQUIRES: ["torch", "no_such_package_x"]}),
                   path)
    assert missing_packages(path) == ["no_such_package_x"]
    byoc = NOTEBOOK_DIR / "15_bring_your_own_code.ipynb"
    assert nbformat.read(byoc, as_version=4).metadata[REQUIRES] == [
        "lightning", "transformers", "accelerate", "deepspeed"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", _params())
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = missing_packages(path)
    if missing:
        pytest.skip(f"{path.stem} needs {', '.join(missing)} (pip install 'nbdist[frameworks]')")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    # DeepSpeed's C++ ops, built once by .ci/setup (.ci/prebuild-ops): the kernel and its ranks
    # inherit this, or 05_deepspeed builds them again mid-cell (~90 s each, 210 s seen under load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(NOTEBOOK_DIR.parent / ".torch_extensions")))
    nb, seconds = run_notebook(path, tmp_path)
    check_tagged_cells_raised(nb, path.stem)
    print(f"{path.stem}: {seconds:.1f} s")
    from tests.notebook_outputs import SAVE_COMMAND, SAVED_ELSEWHERE, compare

    if path.stem not in SAVED_ELSEWHERE:  # its saved run went through Slurm, this one may not
        moved = compare(nbformat.read(path, as_version=4), nb, path.stem)
        assert not moved, ("the saved outputs went stale (re-save with "
                           f"{SAVE_COMMAND} {path.stem} if the change is meant):\n" + "\n".join(moved))
