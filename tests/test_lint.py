"""Desync lint (`nbdist.lint`, and the one-line warning `%%distributed` prints before dispatch):
collectives only some ranks reach are flagged at their cell line; symmetric code and matched
send/recv are not; the tutorials have no finding but the hang they show on purpose."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from IPython.testing import globalipapp

import nbdist
from nbdist.notebook import magics

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_a_rank0_only_all_reduce_is_flagged_at_its_line() -> None:
    findings = nbdist.lint("t = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\nprint(t)\n")
    assert [f.line for f in findings] == [3]
    assert "all_reduce() runs only where `rank == 0`" in findings[0].message


@pytest.mark.parametrize("source", [
    "if rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.all_reduce(t)\n",
    "dist.all_reduce(t)\nif rank == 0:\n    print(t)\n",
    "if rank == 0:\n    dist.send(t, 1)\nelse:\n    dist.recv(t, 0)\n",
    "if rank == 0:\n    dist.send(t, 1)\nif rank == 1:\n    dist.recv(t, 0)\n",
    "if rank == 0:\n    dist.barrier()\nelif rank == 1:\n    dist.barrier()\n",
    "if step % 10 == 0:\n    dist.barrier()\n",
    "x = (1,\n",  # does not parse: the syntax check reports it, not the lint
], ids=["if-else", "outside", "send-recv", "send-recv-two-ifs", "elif", "not-rank", "syntax"])
def test_symmetric_code_and_matched_pairs_are_silent(source: str) -> None:
    assert nbdist.lint(source) == []


@pytest.mark.parametrize("source, line, word", [
    ("if dist.get_rank() != 0:\n    dist.broadcast(t, 0)\n", 2, "broadcast"),
    ("if rank == 0:\n    dist.barrier()\nelif rank == 1:\n    pass\n", 2, "barrier"),
    ("if rank == 0:\n    dist.send(t, 1)\n", 2, "send() with no recv()"),
    ("def step():\n    if rank == 0:\n        dist.all_gather(out, t)\n", 3, "all_gather"),
])
def test_one_sided_collectives_are_flagged(source: str, line: int, word: str) -> None:
    findings = nbdist.lint(source)
    assert [f.line for f in findings] == [line] and word in findings[0].message


def test_tutorials_have_no_finding_but_the_hang_they_show() -> None:
    flagged = []
    for path in NOTEBOOKS:
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            first, _, body = cell.source.partition("\n")
            if cell.cell_type == "code" and first.startswith("%%distributed") and nbdist.lint(body):
                flagged.append((path.stem, index, "raises-exception" in cell.metadata.get("tags", [])))
    assert flagged and all(on_purpose for *_, on_purpose in flagged), flagged


def test_the_magic_warns_in_one_line_and_runs_anyway(cluster2, capsys, monkeypatch) -> None:
    ip = globalipapp.start_ipython() or globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    monkeypatch.setattr(magics, "_CURRENT", cluster2)
    cell = "t = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.all_reduce(t)\n"
    ip.run_cell_magic("distributed", "", cell)
    assert "nbdist lint" not in capsys.readouterr().out
    ip.run_cell_magic("distributed", "", "if rank == 0:\n    dist.send(torch.ones(1), 1)\n"
                      "if rank == 1:\n    dist.recv(torch.zeros(1), 0)\nrank")
    assert "nbdist lint" not in capsys.readouterr().out
    with pytest.raises(nbdist.DistributedCellError):
        ip.run_cell_magic("distributed", "--timeout 3", "if rank == 0:\n    dist.barrier()\n")
    out = capsys.readouterr().out
    lint_lines = [line for line in out.splitlines() if line.startswith("nbdist lint:")]
    assert lint_lines == [lint_lines[0]] and "cell line 2: barrier()" in lint_lines[0]
    ip.run_cell_magic("distributed", "--no-lint --timeout 3", "dist.barrier()")
    assert "nbdist lint" not in capsys.readouterr().out
