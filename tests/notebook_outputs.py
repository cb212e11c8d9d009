"""The tutorials' saved outputs: produce them, and check a fresh run against them.

    .venv/bin/python -m tests.notebook_outputs                 # execute every tutorial, save outputs
    .venv/bin/python -m tests.notebook_outputs 04_fsdp 06      # just these (a name's prefix will do)

Each tutorial is stored as one real run top to bottom (nbclient, the venv's python3 kernel, 2 CPU
threads per machine as on a laptop), with the digest of the code that produced it
(`test_notebook_lint`: an edited code cell makes the outputs stale). `-m notebooks` executes each
tutorial again and compares, code cell by code cell (`compare`):

- the structure: which kinds of output the cell shows (printed text, a display or a result and
  its mime types, an error and its type), as a set: ranks' streamed lines interleave differently
  from run to run, so chunks and their order are not structure. stderr is not structure either:
  it carries warnings that come and go with the machine (a DeepSpeed op built on first use, a
  deprecation); nor is printed text in a cell tagged `raises-exception` (a rank's last line races
  its death), where the error and its type are;
- the recorded figures: in cells tagged `figures`, every number of the text the cell shows (a
  line merged for several ranks counted once per rank), in order after sorting each output's
  lines, within the notebook's `figure_tolerance` (relative; default `FIGURE_TOLERANCE`). Only
  cells whose numbers are properties of the code (bytes, counts, estimates, seeded losses) carry
  the tag; timings are not figures, they move with the machine.

12_multi_node_slurm keeps the outputs of a run through Slurm (tests/test_slurm.py re-saves it).
After a save, the command lists the figures the prose quotes that the new outputs no longer show
(tests/tutorial_figures.py): fix the prose, or tests/test_tutorial_figures.py fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

from nbdist.text import strip_ansi
from tests.test_notebook_lint import KEPT_OUTPUTS, save_with_outputs
from tests.test_notebooks import NOTEBOOKS, RAISES, check_tagged_cells_raised, run_notebook
from tests.tutorial_figures import problems as figure_problems

FIGURES = "figures"
"""Cell tag: this cell's numbers are recorded figures (checked within the tolerance)."""

FIGURE_TOLERANCE = 0.25
"""Relative: a figure may move by a quarter (allocator, BLAS and reduction-order differences)."""

SAVED_ELSEWHERE = {"12_multi_node_slurm"}
"""Saved from a run this command cannot repeat (a Slurm cluster): tests/test_slurm.py saves it."""

SAVE_COMMAND = ".venv/bin/python -m tests.notebook_outputs"

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_MERGED = re.compile(r"\[ranks ([\d,-]+)\] ")
_ABSOLUTE = 1e-6
"""Numbers this close are equal whatever their size (a loss that is 1e-9 in one run, 0 in another)."""


def output_kinds(cell: nbformat.NotebookNode) -> set[str]:
    """The structure of one code cell's outputs: `stream:stdout`, `display_data:image/svg+xml`..."""
    kinds = set()
    for output in cell.get("outputs", []):
        kind = output["output_type"]
        if kind == "stream":
            if output["name"] == "stdout":  # stderr: warnings that come and go with the machine
                kinds.add("stream:stdout")
        elif kind == "error":
            kinds.add(f"error:{output['ename']}")
        else:
            kinds.update(f"{kind}:{mime}" for mime in output.get("data", {}))
    return kinds


def _structure(cell: nbformat.NotebookNode) -> set[str]:
    """`output_kinds`, less the printed text of a cell that shows how a rank fails: what a rank
    printed just before it was killed arrives or not, as the kill races the stream (seen in
    10_when_things_go_wrong); the error and its type are the structure there."""
    kinds = output_kinds(cell)
    if RAISES in cell.metadata.get("tags", []):
        kinds.discard("stream:stdout")
    return kinds


def cell_numbers(cell: nbformat.NotebookNode) -> list[float]:
    """Every number of the text a cell shows, each output's lines sorted (ranks interleave),
    stdout before stderr (which of them a rank wrote to first is timing too)."""
    numbers: list[float] = []
    outputs = cell.get("outputs", [])
    streams = sorted((o for o in outputs if o["output_type"] == "stream"), key=lambda o: o["name"])
    for output in streams + [o for o in outputs if o["output_type"] != "stream"]:
        if output["output_type"] == "stream":
            lines = _per_rank(output["text"])
        else:
            lines = output.get("data", {}).get("text/plain", "").splitlines()
        for line in sorted(lines):
            numbers.extend(float(match) for match in _NUMBER.findall(line))
    return numbers


def _per_rank(text: str) -> list[str]:
    """A stream's lines without colour codes, a line merged for several ranks (`[ranks 0-1] x`)
    once per rank: whether the ranks' copies arrived close enough to merge is timing, like their
    interleaving, not a figure."""
    lines = []
    for line in strip_ansi(text).splitlines():
        merged = _MERGED.match(line)
        if merged is None:
            lines.append(line)
            continue
        for part in merged.group(1).split(","):
            low, _, high = part.partition("-")
            ranks = range(int(low), int(high or low) + 1)
            lines += [f"[rank {rank}] {line[merged.end():]}" for rank in ranks]
    return lines


def _stream_merged(cell: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The cell with all chunks of each stream joined (their split is the ranks' timing)."""
    merged: dict[str, str] = {}
    outputs = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            if output["name"] not in merged:
                merged[output["name"]] = ""
                outputs.append(output)
            merged[output["name"]] += output["text"]
        else:
            outputs.append(output)
    copy = nbformat.from_dict({**cell, "outputs": [dict(o) for o in outputs]})
    for output in copy.outputs:
        if output["output_type"] == "stream":
            output["text"] = merged[output["name"]]
    return copy


def compare(saved: nbformat.NotebookNode, fresh: nbformat.NotebookNode, name: str) -> list[str]:
    """What moved between the saved run of a notebook and a fresh one; empty when nothing did."""
    problems = []
    tolerance = saved.metadata.get(KEPT_OUTPUTS, {}).get("figure_tolerance", FIGURE_TOLERANCE)
    if len(saved.cells) != len(fresh.cells):
        return [f"{name}: {len(saved.cells)} cells saved, {len(fresh.cells)} run"]
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(saved.cells, fresh.cells, strict=True))
             if a.cell_type == "code"]
    for index, old, new in pairs:
        where = f"{name} cell {index} ({old.source.splitlines()[0][:60] if old.source else ''!r})"
        was, now = _structure(old), _structure(new)
        if was != now:
            problems.append(f"{where}: output structure {sorted(was)} saved, {sorted(now)} now")
            continue
        if FIGURES not in old.metadata.get("tags", []):
            continue
        was, now = cell_numbers(_stream_merged(old)), cell_numbers(_stream_merged(new))
        if len(was) != len(now):
            problems.append(f"{where}: {len(was)} figures saved, {len(now)} now")
            continue
        moved = [(a, b) for a, b in zip(was, now, strict=True)
                 if abs(a - b) > tolerance * max(abs(a), abs(b)) + _ABSOLUTE]
        if moved:
            shown = ", ".join(f"{a:g} -> {b:g}" for a, b in moved[:5])
            problems.append(f"{where}: {len(moved)} figure(s) moved beyond {tolerance:.0%}: {shown}")
    return problems


def missing_outputs(nb: nbformat.NotebookNode, name: str) -> list[str]:
    """A notebook stored without its outputs, or with some cells never run."""
    if KEPT_OUTPUTS not in nb.metadata:
        return [f"{name}: saved without outputs; run {SAVE_COMMAND} {name}"]
    never_ran = [i for i, cell in enumerate(nb.cells)
                 if cell.cell_type == "code" and cell.execution_count is None]
    return [f"{name}: cell(s) {never_ran} have no saved run; run {SAVE_COMMAND} {name}"] if never_ran else []


def save(path: Path, workdir: Path) -> float:
    """Execute one tutorial top to bottom and store it with its outputs; returns the seconds taken."""
    nb, seconds = run_notebook(path, workdir)  # read from `path`: its metadata comes along
    check_tagged_cells_raised(nb, path.stem)
    save_with_outputs(nb, path, SAVE_COMMAND + " " + path.stem)
    return seconds


def main(names: list[str]) -> int:
    import os
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(NOTEBOOKS[0].parent.parent / ".torch_extensions"))
    chosen = [p for p in NOTEBOOKS if p.stem not in SAVED_ELSEWHERE
              and (not names or any(p.stem.startswith(n) for n in names))]
    if not chosen:
        print(f"no tutorial matches {names}", file=sys.stderr)
        return 2
    for path in chosen:
        with tempfile.TemporaryDirectory(prefix=f"nbdist-{path.stem}-") as workdir:
            print(f"{path.stem}: running ...", flush=True)
            print(f"{path.stem}: saved with its outputs ({save(path, Path(workdir)):.0f} s)", flush=True)
        quoted = figure_problems(nbformat.read(path, as_version=4), path.stem)
        for problem in quoted:  # tests/test_tutorial_figures.py fails on these until the prose follows
            print(f"  the prose no longer matches: {problem}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
