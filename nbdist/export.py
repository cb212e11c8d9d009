"""Turn a notebook's ``%%distributed`` cells into one script that ``torchrun`` runs the same way.

Plain functions, no IPython: the ``%dist_export`` magic hands in the cell history (or a .ipynb
path) and writes what :func:`export_script` returns.
"""

from __future__ import annotations

import ast
import json
import shlex
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nbdist.errors import NbdistError
from nbdist.ranks import parse_ranks

SKIP_TAGS = frozenset({"raises-exception", "nbdist-no-export"})
"""Notebook cell tags whose cells are left out of an export (failures on purpose, demos)."""

MAGIC = "%%distributed"


@dataclass
class DistributedCell:
    """One ``%%distributed`` cell as the ranks ran it."""

    source: str
    """The cell body, without the magic line."""

    ranks: list[int] | None = None
    """``--ranks``: the ranks that ran it (None: all)."""

    options: list[str] = field(default_factory=list)
    """The magic's other options, kept as a comment (``--timeout``, ``--rank0``, ``--setup``)."""

    label: str = ""
    """Where it came from, e.g. ``In[7]`` or ``cell 12``."""


def distributed_cells(sources: Iterable[tuple[str, str]], world_size: int | None = None) -> list[DistributedCell]:
    """Pick the distributed cells from ``(label, raw source)`` pairs in execution order.

    Cells after ``%autodist on`` count as distributed until ``%autodist off`` (as in the notebook).
    ``world_size`` resolves ``--ranks`` ranges; without it ranks are read as plain numbers.
    """
    cells: list[DistributedCell] = []
    autodist = False
    for label, raw in sources:
        text = raw.strip("\n")
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        if first.startswith("%autodist"):
            autodist = first.split()[-1].lower() == "on"
            continue
        if first.startswith(MAGIC) and (len(first) == len(MAGIC) or first[len(MAGIC)].isspace()):
            head, _, body = text.lstrip().partition("\n")
            cells.append(_parse_magic_line(head[len(MAGIC):], body, label, world_size))
        elif autodist and first and not first.startswith(("%", "!")):
            cells.append(DistributedCell(source=text, label=label))
    return cells


def _parse_magic_line(line: str, body: str, label: str, world_size: int | None) -> DistributedCell:
    words = shlex.split(line)
    ranks: list[int] | None = None
    options: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--ranks"):
            value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else "")
            i += 0 if "=" in word else 1
            ranks = parse_ranks(value, world_size if world_size is not None else 1 << 16)
        else:
            options.append(word)
        i += 1
    return DistributedCell(source=body, ranks=ranks, options=options, label=label)


def cells_from_history(raw_history: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, source)`` pairs from IPython's raw input history (index = execution count)."""
    return [(f"In[{i}]", src) for i, src in enumerate(raw_history) if i > 0 and src.strip()]


def cells_from_notebook(path: str | Path) -> list[tuple[str, str]]:
    """``(label, source)`` pairs of a .ipynb's code cells in document order, minus skipped tags."""
    with open(path, encoding="utf-8") as f:
        notebook = json.load(f)
    out = []
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        if SKIP_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        source = cell.get("source", "")
        out.append((f"cell {index}", "".join(source) if isinstance(source, list) else source))
    return out


_PREAMBLE = '''\
#!/usr/bin/env python
"""{title}

Exported by nbdist's %dist_export from the notebook's %%distributed cells, in the order they ran.
Run it with one process per rank, e.g.:

    torchrun --nproc-per-node {nproc} {filename}

Every process gets what a notebook rank had: rank, world_size, local_rank, device, dist, torch.
"""

import atexit
import os

import torch
import torch.distributed as dist

try:
    import nbdist  # nbdist.log() is a no-op outside a notebook cluster
except ImportError:  # the script runs without nbdist installed too
    import types

    nbdist = types.SimpleNamespace(log=lambda *args, **kwargs: None)


def _setup_rank():
    """What nbdist's bootstrap does for a notebook rank, from torchrun's environment."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # share the cores between the ranks of this host, as nbdist does
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if "MASTER_ADDR" not in os.environ:  # plain `python FILE`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            device_id=device if backend == "nccl" else None)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return rank, world_size, local_rank, device


def display(*values):
    """IPython's display() in a notebook; plain printing here."""
    for value in values:
        _show(value)


def _show(value):
    """A notebook shows a cell's last expression; the script prints it with the rank."""
    if value is not None:
        print(f"[rank {{rank}}] {{value!r}}", flush=True)


rank, world_size, local_rank, device = _setup_rank()
'''


def export_script(cells: Sequence[DistributedCell], title: str = "Training script",
                  filename: str = "train.py", nproc: int = 2) -> str:
    """The script: process-group setup, then each cell in order (IPython-only lines commented)."""
    if not cells:
        raise NbdistError(
            "no %%distributed cells to export: run some distributed cells first "
            "(or pass the notebook's .ipynb path)"
        )
    parts = [_PREAMBLE.format(title=title, nproc=nproc, filename=filename)]
    for cell in cells:
        header = f"# --- {cell.label or 'cell'}: %%distributed {' '.join(cell.options)}".rstrip()
        if cell.ranks is not None:
            header += f" (ranks {', '.join(map(str, cell.ranks))} only)"
        body = _script_body(cell.source)
        if cell.ranks is not None:
            body = f"if rank in {tuple(cell.ranks)!r}:\n" + textwrap.indent(body or "pass", "    ")
        parts.append(f"\n{header} ---\n{body}\n")
    parts.append(
        "\nif dist.is_initialized():\n    dist.barrier()  # every rank reaches the end before the group goes\n"
    )
    return "".join(parts)


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
    if isinstance(last, ast.Expr) and last.col_offset == 0 and not body.endswith(";"):
        if not _is_call_of(last.value, {"print", "display"}):
            body_lines = body.splitlines()
            start, end = last.lineno - 1, (last.end_lineno or last.lineno)
            expr = "\n".join(body_lines[start:end])
            body_lines[start:end] = [f"_show({expr})"]
            body = "\n".join(body_lines)
    return body


def _is_call_of(node: ast.expr, names: set[str]) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names


def write_script(path: str | Path, cells: Sequence[DistributedCell], title: str | None = None,
                 nproc: int = 2) -> Path:
    """Write the exported script to ``path`` (executable); returns the path."""
    target = Path(path)
    text = export_script(cells, title=title or f"{target.stem}: exported from a notebook",
                         filename=target.name, nproc=nproc)
    target.write_text(text, encoding="utf-8")
    target.chmod(0o755)
    return target
