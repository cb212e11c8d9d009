"""Write the torchrun script: the template (process-group setup, as nbdist's bootstrap does it)
filled in, then each step in the order the notebook ran it."""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from nbdist.errors import NbdistError
from nbdist.export.steps import DistributedCell, Push, Step

_TEMPLATE = "templates/torchrun_script.py"
"""The script's head: a real .py file (so ruff checks it) shipped as package data, read as text;
its directory has no __init__.py, so nothing imports it and the layer checks skip its imports."""

_TEMPLATE_FIELDS = re.compile(r"\{(title|nproc|filename)\}")
"""Placeholders in the template's docstring."""

_THREADS_LINE = "THREADS = None\n"
"""The template's THREADS line, replaced by %dist_start --threads (None stays None)."""

_SHEBANG = "#!/usr/bin/env python\n"
"""The script's first line: the template's own header comment above it is dropped."""

_MAX_LABELS_SHOWN = 4
"""A loop's header names its cells up to this many; more are written as ``first, ..., last``."""

_CELL_BOUNDARY = "_cell_boundary()"
"""Ends every exported cell: the template's barrier (only while a process group exists)."""

_SCRIPT_END = (
    "\nif dist.is_initialized():\n"
    "    dist.barrier()  # every rank reaches the end before the group goes\n"
)


def export_script(steps: Sequence[Step], title: str = "Training script",
                  filename: str = "train.py", nproc: int = 2, threads: int | None = None) -> str:
    """The script: process-group setup, then each step in the order the notebook ran it.

    IPython-only lines are commented out; a cell run several times in a row becomes a loop;
    a cell that failed in the notebook is kept as a comment; a pushed value the script cannot
    spell out raises NotImplementedError where it was pushed."""
    if not any(isinstance(step, DistributedCell) for step in steps):
        raise NbdistError(
            "no %%distributed cells to export: run some distributed cells first "
            "(or pass the notebook's .ipynb path)"
        )
    parts = [script_head(title=title, nproc=nproc, filename=filename, threads=threads)]
    for group in _group_repeats(steps):
        step = group[0]
        if isinstance(step, Push):
            parts.append(_push_block(step))
        else:
            parts.append(_cell_block(step, [s.label for s in group]))
    parts.append(_SCRIPT_END)
    return "".join(parts)


def write_script(path: str | Path, steps: Sequence[Step], title: str | None = None,
                 nproc: int = 2, threads: int | None = None) -> Path:
    """Write the exported script to ``path`` (executable); returns the path."""
    target = Path(path)
    text = export_script(steps, title=title or f"{target.stem}: exported from a notebook",
                         filename=target.name, nproc=nproc, threads=threads)
    target.write_text(text, encoding="utf-8")
    target.chmod(0o755)
    return target


def script_head(title: str, nproc: int, filename: str, threads: int | None) -> str:
    """The template filled in: docstring, imports, rank setup, to ``rank, ... = _setup_rank()``."""
    template = resources.files("nbdist.export").joinpath(_TEMPLATE).read_text(encoding="utf-8")
    head = template[template.index(_SHEBANG):]
    if head.count(_THREADS_LINE) != 1:  # the template was edited: fail here, not in torchrun
        raise RuntimeError(f"nbdist/export/{_TEMPLATE} must hold the line {_THREADS_LINE!r} once")
    head = head.replace(_THREADS_LINE, f"THREADS = {threads!r}\n")
    fields = {"title": title, "nproc": str(nproc), "filename": filename}
    # one pass, so a title that itself says {nproc} stays as written
    return _TEMPLATE_FIELDS.sub(lambda match: fields[match.group(1)], head)


def _group_repeats(steps: Sequence[Step]) -> list[list[Step]]:
    """Consecutive runs of the same cell (same source and options, none failed) together."""
    groups: list[list[Step]] = []
    for step in steps:
        last = groups[-1][-1] if groups else None
        if (isinstance(step, DistributedCell) and isinstance(last, DistributedCell)
                and not step.failed and not last.failed and step.source == last.source
                and step.ranks == last.ranks and step.options == last.options):
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def _cell_block(cell: DistributedCell, labels: list[str]) -> str:
    if len(labels) <= _MAX_LABELS_SHOWN:
        where = ", ".join(labels)
    else:
        where = f"{labels[0]}, ..., {labels[-1]}"
    header = f"# --- {where or 'cell'}: %%distributed {' '.join(cell.options)}".rstrip()
    if cell.ranks is not None:
        header += f" (ranks {', '.join(map(str, cell.ranks))} only)"
    body = _script_body(cell.source)
    if cell.ranks is not None:
        body = f"if rank in {tuple(cell.ranks)!r}:\n" + textwrap.indent(body or "pass", "    ")
    if cell.failed:
        note = (f"# left out: this cell failed in the notebook ({cell.failed});\n"
                "# whatever it did on the ranks before it failed is not reproduced here.\n")
        return f"\n{header} ---\n{note}" + textwrap.indent(body, "# ", lambda line: True) + "\n"
    # In the notebook every rank finished a cell before any started the next (rank 0 writes a
    # file in one cell, the others read it in the next); a script's ranks run free: a barrier
    # at each cell boundary keeps the notebook's order
    body = f"{body or 'pass'}\n{_CELL_BOUNDARY}"
    if len(labels) > 1:
        body = (f"for _nbdist_run in range({len(labels)}):  # the notebook ran this cell "
                f"{len(labels)} times in a row\n" + textwrap.indent(body, "    "))
    return f"\n{header} ---\n{body}\n"


def _push_block(push: Push) -> str:
    names = " ".join(v.name for v in push.values)
    lines = [f"\n# --- {push.label or 'cell'}: %dist_push {names} ---"]
    for value in push.values:
        if value.source is not None:
            lines.append(f"{value.name} = {value.source}")
            continue
        message = f"{value.name} was pushed from the notebook ({value.description}); define it here"
        example = (f", e.g. {value.name} = torch.load(\"{value.name}.pt\").to(device)"
                   if "Tensor of shape" in value.description else "")
        lines += [
            f"# `{value.name}` was pushed from the notebook ({value.description}): "
            "the script cannot write it out.",
            f"# Define it here{example}, and delete the raise.",
            f"raise NotImplementedError({message!r})",
        ]
    return "\n".join(lines) + "\n"


def _script_body(source: str) -> str:
    """Comment out IPython-only lines; print a trailing expression the way a notebook shows it."""
    lines = []
    for line in textwrap.dedent(source).splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            indent = line[: len(line) - len(stripped)]
            lines.append(f"{indent}pass  # nbdist export: IPython-only line skipped: {stripped}")
        else:
            lines.append(line)
    body = "\n".join(lines).rstrip()
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return body  # let Python report it where the user can see the line
    last = tree.body[-1] if tree.body else None
    if (isinstance(last, ast.Expr) and last.col_offset == 0 and not _ends_with_semicolon(body, last)
            and not _is_call_of(last.value, {"print", "display"})):
        body_lines = body.splitlines()
        start, end = last.lineno - 1, (last.end_lineno or last.lineno)
        expr = ast.get_source_segment(body, last.value) or ""
        # what follows the expression on its last line (a comment) stays after the call
        after = body_lines[end - 1][last.end_col_offset or 0:]
        body_lines[start:end] = [f"_show({expr}){after}"]
        body = "\n".join(body_lines)
    return body


def _ends_with_semicolon(body: str, last: ast.stmt) -> bool:
    """`x;` hides a notebook cell's value; a comment after it does not change that."""
    line = body.splitlines()[(last.end_lineno or last.lineno) - 1]
    return line[last.end_col_offset or 0:].lstrip().startswith(";")


def _is_call_of(node: ast.expr, names: set[str]) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
