"""Notebooks are code: ruff checks their cells, and saved outputs are stripped (never stale), or
deliberately kept from one real run of exactly the code cells there now (a run the notebook suite
cannot repeat everywhere, e.g. through Slurm: see KEPT_OUTPUTS).

Ruff skips cells that start with a cell magic, so a small extractor turns each notebook into two
Python files — the `%%distributed` cells (the ranks' program, in order, after a header that
defines the names nbdist injects) and the notebook's own cells — with IPython-only lines
commented out, then runs ruff on both.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

RANK_HEADER = (
    "import torch\nimport torch.distributed as dist\n\n"
    "rank = world_size = local_rank = 0\ndevice = torch.device('cpu')\ngpus = []\n"
    "_injected = (dist, device, gpus)\n"
)
# E402: imports follow earlier cells; B018: a cell's last expression is its displayed result;
# I001: each cell orders its own imports; E731: small lambdas are fine in teaching code.
IGNORE = "E402,B018,I001,E731"
_MAGIC_ASSIGN = re.compile(r"^(\s*)(\w+)\s*=\s*%.*$")
_BRACED = re.compile(r"\{([^{}]+)\}")
_PUSH = re.compile(r"^\s*%dist_push\s+(.*)$", re.M)
BUILTINS = "builtins = ['display', '_dist_result']"
"""IPython's display() exists in every kernel, ranks included; %%distributed sets _dist_result."""


KEPT_OUTPUTS = "nbdist_kept_outputs"
"""Notebook metadata of a notebook saved with its outputs: {"from": how they were produced,
"sources": code_digest of the cells that produced them}. An edited code cell makes them stale."""


def code_digest(nb: nbformat.NotebookNode) -> str:
    code = "\0".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    return hashlib.sha256(code.encode()).hexdigest()


def save_with_outputs(nb: nbformat.NotebookNode, path: Path, produced_by: str) -> None:
    """Write an executed notebook with its outputs kept (and nbclient's timestamps dropped); the
    notebook's own settings in its KEPT_OUTPUTS metadata (a figure tolerance) stay."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata[KEPT_OUTPUTS] = {**nb.metadata.get(KEPT_OUTPUTS, {}), "from": produced_by,
                                 "sources": code_digest(nb)}
    nbformat.write(nb, path)


def pushed_names(notebook_cells: list[str]) -> list[str]:
    """Names `%dist_push a b=expr` defines on the ranks."""
    names = []
    for source in notebook_cells:
        for match in _PUSH.finditer(source):
            names += [item.split("=", 1)[0] for item in match.group(1).split()]
    return names


def python_of(cells: list[str]) -> str:
    """Join cell sources as one module; IPython-only lines become `pass`/assignments of None."""
    out = []
    for index, source in enumerate(cells):
        out.append(f"# cell {index}")
        for line in source.splitlines():
            stripped = line.lstrip()
            assign = _MAGIC_ASSIGN.match(line)
            if assign:  # x = %dist_pull t
                out.append(f"{assign.group(1)}{assign.group(2)} = None")
            elif stripped.startswith(("%", "!")):
                # `!cmd {sys.executable}` uses notebook names: keep them visible to ruff
                used = ", ".join(_BRACED.findall(stripped)) if stripped.startswith("!") else ""
                out.append(f"{line[: len(line) - len(stripped)]}{f'_ = ({used},)' if used else 'pass'}")
            else:
                out.append(line)
        out.append("")
    return "\n".join(out) + "\n"


def split_cells(nb: nbformat.NotebookNode) -> tuple[list[str], list[str]]:
    rank_cells, notebook_cells = [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        first, _, body = cell.source.partition("\n")
        if first.startswith("%%distributed"):
            if "raises-exception" in cell.metadata.get("tags", []) and not _parses(body):
                continue  # a SyntaxError shown on purpose (tests/test_notebooks.py runs it)
            rank_cells.append(body)
        elif not first.startswith("%%"):
            notebook_cells.append(cell.source)
    return rank_cells, notebook_cells


def _parses(source: str) -> bool:
    try:
        compile(source, "<cell>", "exec")
    except SyntaxError:
        return False
    return True


def ruff(source: str, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--extend-ignore", IGNORE, "--config", BUILTINS,
         "--stdin-filename", name, "-"],
        input=source, capture_output=True, text=True, cwd=NOTEBOOK_DIR.parent,
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_cells_pass_ruff(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    rank_cells, notebook_cells = split_cells(nb)
    pushed = "".join(f"{name} = None\n" for name in pushed_names(notebook_cells))
    for label, source in (("ranks", RANK_HEADER + pushed + python_of(rank_cells)),
                          ("notebook", python_of(notebook_cells))):
        result = ruff(source, f"{path.stem}_{label}.py")
        assert result.returncode == 0, f"{path.name} ({label} cells):\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stripped_and_valid(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    kept = nb.metadata.get(KEPT_OUTPUTS)
    if kept:
        counts = [cell.execution_count for cell in nb.cells if cell.cell_type == "code"]
        assert kept["sources"] == code_digest(nb), (
            f"{path.name}: code cells changed since its outputs were saved: re-run it ({kept['from']})")
        assert counts == list(range(1, len(counts) + 1)), f"{path.name}: not one run top to bottom"
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and not kept:
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name} cell {index} has saved outputs: strip them "
                "(jupyter nbconvert --clear-output --inplace notebooks/*.ipynb)"
            )
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "What you learn" in first.source and "What you need" in first.source


def test_extractor_comments_out_magics() -> None:
    text = python_of(["x = 1\n%dist_push x\npulled = %dist_pull x\n!ls {path}"])
    assert "pulled = None" in text and "_ = (path,)" in text and "%" not in text and "!ls" not in text
    assert pushed_names(["%dist_push a b=2"]) == ["a", "b"]
