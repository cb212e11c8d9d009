"""Turn a notebook's ``%%distributed`` cells into one script that ``torchrun`` runs the same way.

Plain functions, no IPython: the ``%dist_export`` magic hands in the cell history (or a .ipynb
path) plus a :class:`SessionLog` of what the history does not hold (pushed values, failed cells).
"""

from __future__ import annotations

import ast
import json
import math
import shlex
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbdist.errors import NbdistError
from nbdist.cluster.ranks import parse_ranks

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

    failed: str = ""
    """Why it failed in the notebook (empty: it ran). A failed cell is written commented out."""


_LITERAL_LIMIT = 20_000
"""Longest literal (characters) written for a pushed value; longer ones become placeholders."""


@dataclass
class PushedValue:
    """One name that ``%dist_push`` bound on every rank."""

    name: str
    source: str | None
    """Python source that rebuilds the value (None: it has none, e.g. a tensor or a model)."""

    description: str
    """What the value was, for the placeholder, e.g. ``a Tensor of shape (3, 4), torch.float32``."""

    @classmethod
    def of(cls, name: str, value: Any) -> PushedValue:
        source = _literal(value)
        if source is not None and len(source) > _LITERAL_LIMIT:
            return cls(name, None, f"{_describe(value)}, too large to write out ({len(source)} characters)")
        return cls(name, source, _describe(value))


@dataclass
class Push:
    """One cell's ``%dist_push``: what every rank received, in order."""

    values: list[PushedValue]
    label: str = ""


Step = DistributedCell | Push
"""What a script is made of, in the order the notebook ran it."""


@dataclass
class SessionLog:
    """What IPython's history does not hold, by cell label (``In[7]``): the values ``%dist_push``
    sent, and the cells that failed. The magics fill it; :func:`script_steps` reads it."""

    pushes: dict[str, list[PushedValue]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    """label -> why the cell failed (a rank raised, timed out, was interrupted...)."""

    pending: list[PushedValue] = field(default_factory=list)
    """Pushes of the cell running now; filed under its label when it finishes."""

    def record_push(self, values: Mapping[str, Any]) -> None:
        """``%dist_push`` succeeded: remember the values as they were sent."""
        self.pending.extend(PushedValue.of(name, value) for name, value in values.items())

    def cell_finished(self, result: Any) -> None:
        """IPython's ``post_run_cell`` event: file the cell's pushes and failure under ``In[n]``.

        Hooked on the event rather than computed in the magics because IPython versions differ
        on when ``execution_count`` moves on; the result carries the cell's own number."""
        info = getattr(result, "info", None)
        count = getattr(result, "execution_count", None)
        if count is None or not getattr(info, "store_history", False):
            return  # not in the history, so the export will not see this cell either
        label = f"In[{count}]"
        if self.pending:
            self.pushes.setdefault(label, []).extend(self.pending)
            self.pending = []
        error = getattr(result, "error_before_exec", None) or getattr(result, "error_in_exec", None)
        if error is not None:
            self.failures[label] = describe_failure(error)

    def clear(self) -> None:
        self.pushes.clear()
        self.failures.clear()
        self.pending.clear()


def describe_failure(error: BaseException) -> str:
    """One line: the first rank's own error for a distributed cell, else the exception."""
    result = getattr(error, "result", None)
    if result is not None and hasattr(result, "root_causes"):
        causes = result.root_causes()
        if causes:
            more = f" (+{len(causes) - 1} more)" if len(causes) > 1 else ""
            return f"{causes[0].headline()}{more}"
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _literal(value: Any, depth: int = 0) -> str | None:
    """Python source for plain data (exact builtin types only), else None."""
    if depth > 20:
        return None
    kind = type(value)
    if value is None or kind in (bool, int, str, bytes):
        return repr(value)
    if kind is float:
        return repr(value) if math.isfinite(value) else f'float("{value}")'
    if kind is complex:
        return repr(value) if math.isfinite(value.real) and math.isfinite(value.imag) else None
    if kind in (list, tuple, set, frozenset):
        items = [_literal(item, depth + 1) for item in value]
        if any(item is None for item in items):
            return None
        inner = ", ".join(item for item in items if item is not None)
        if kind is list:
            return f"[{inner}]"
        if kind is tuple:
            return f"({inner},)" if len(items) == 1 else f"({inner})"
        if not items:
            return f"{kind.__name__}()"
        return f"{{{inner}}}" if kind is set else f"frozenset({{{inner}}})"
    if kind is dict:
        pairs = [(_literal(k, depth + 1), _literal(v, depth + 1)) for k, v in value.items()]
        if any(k is None or v is None for k, v in pairs):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    if kind.__module__ == "torch" and kind.__name__ == "dtype":
        return repr(value)  # torch.float32: the script imports torch
    if kind.__module__ == "torch" and kind.__name__ == "device":
        return f"torch.device({str(value)!r})"
    return None


def _describe(value: Any) -> str:
    kind = type(value)
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        try:
            return f"a {kind.__name__} of shape {tuple(shape)}, {value.dtype}"
        except TypeError:
            pass
    if kind.__module__ == "builtins":
        sized = f" of {len(value)} item(s)" if hasattr(value, "__len__") else ""
        name = f"{kind.__name__}{sized}"
    else:
        name = f"{kind.__module__}.{kind.__qualname__}"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def distributed_cells(sources: Iterable[tuple[str, str]], world_size: int | None = None,
                      log: SessionLog | None = None) -> list[DistributedCell]:
    """The distributed cells of :func:`script_steps`, without the pushes."""
    return [s for s in script_steps(sources, world_size, log) if isinstance(s, DistributedCell)]


def script_steps(sources: Iterable[tuple[str, str]], world_size: int | None = None,
                 log: SessionLog | None = None) -> list[Step]:
    """Distributed cells and pushes from ``(label, raw source)`` pairs in execution order.

    Cells after ``%autodist on`` count as distributed until ``%autodist off`` (as in the notebook).
    ``world_size`` resolves ``--ranks`` ranges; without it ranks are read as plain numbers.
    ``log`` adds what the sources cannot say: pushed values and which cells failed.
    """
    steps: list[Step] = []
    autodist = False
    log = log if log is not None else SessionLog()
    for label, raw in sources:
        text = raw.strip("\n")
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        if label in log.pushes:
            steps.append(Push(values=list(log.pushes[label]), label=label))
        if first.startswith("%autodist"):
            autodist = first.split()[-1].lower() == "on"
            continue
        cell: DistributedCell | None = None
        if first.startswith(MAGIC) and (len(first) == len(MAGIC) or first[len(MAGIC)].isspace()):
            head, _, body = text.lstrip().partition("\n")
            try:
                cell = _parse_magic_line(head[len(MAGIC):], body, label, world_size)
            except (NbdistError, ValueError):
                if label not in log.failures:
                    raise
                # e.g. --ranks 5 on 2 ranks: it failed in the notebook, it is only a comment here
                cell = DistributedCell(source=body, options=[head[len(MAGIC):].strip()], label=label)
        elif autodist and first and not first.startswith(("%", "!")):
            cell = DistributedCell(source=text, label=label)
        if cell is not None:
            cell.failed = log.failures.get(label, "")
            steps.append(cell)
    return steps


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


_PUSH_LINE = "%dist_push"


def notebook_log(path: str | Path) -> SessionLog:
    """A :class:`SessionLog` from a saved .ipynb (labels as :func:`cells_from_notebook` gives them):
    cells whose saved output is an error count as failed; pushed values are known only where
    the line spells a literal (``%dist_push lr=0.1``), the others become placeholders."""
    with open(path, encoding="utf-8") as f:
        notebook = json.load(f)
    log = SessionLog()
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        label = f"cell {index}"
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            evalue = str(errors[0].get("evalue", "")).strip().splitlines()
            log.failures[label] = (f"its saved output is an error: {errors[0].get('ename', '')}"
                                   f"{': ' + evalue[0] if evalue else ''}")[:200]
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        for line in text.splitlines():
            words = line.strip().split(None, 1)
            if len(words) == 2 and words[0] == _PUSH_LINE:
                log.pushes.setdefault(label, []).extend(_pushes_in_line(words[1]))
    return log


def _pushes_in_line(arguments: str) -> list[PushedValue]:
    values = []
    for item in shlex.split(arguments):
        name, has_expr, expr = item.partition("=")
        try:
            values.append(PushedValue.of(name.strip(), ast.literal_eval(expr)) if has_expr
                          else PushedValue(name, None, "value unknown: a saved .ipynb does not hold it"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            values.append(PushedValue(name.strip(), None, f"the value of `{expr}` in the notebook"))
    return values


_PREAMBLE = '''\
#!/usr/bin/env python
"""{title}

Exported by nbdist's %dist_export from the notebook's %%distributed cells and %dist_push
values, in the order they ran.
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

THREADS = {threads!r}
"""Threads per rank: %dist_start --threads in the notebook (None: cores / ranks on this host)."""


def _setup_rank():
    """What nbdist's bootstrap does for a notebook rank, from torchrun's environment."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # threads per rank as nbdist sets them: the notebook's --threads, else this host's cores
    # shared by its ranks (torchrun's own default, OMP_NUM_THREADS=1, would train slower on CPU)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = THREADS or max(1, (cores or 1) // local_world_size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
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
    parts = [_PREAMBLE.format(title=title, nproc=nproc, filename=filename, threads=threads)]
    for group in _group_repeats(steps):
        step = group[0]
        if isinstance(step, Push):
            parts.append(_push_block(step))
        else:
            parts.append(_cell_block(step, [s.label for s in group]))
    parts.append(
        "\nif dist.is_initialized():\n    dist.barrier()  # every rank reaches the end before the group goes\n"
    )
    return "".join(parts)


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
    where = ", ".join(labels) if len(labels) <= 4 else f"{labels[0]}, ..., {labels[-1]}"
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
    if len(labels) > 1:
        body = (f"for _nbdist_run in range({len(labels)}):  # the notebook ran this cell "
                f"{len(labels)} times in a row\n" + textwrap.indent(body or "pass", "    "))
    return f"\n{header} ---\n{body}\n"


def _push_block(push: Push) -> str:
    lines = [f"\n# --- {push.label or 'cell'}: %dist_push {' '.join(v.name for v in push.values)} ---"]
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


def placeholders(steps: Sequence[Step]) -> list[PushedValue]:
    """Pushed values the script could not write out (each raises where it was pushed)."""
    return [v for s in steps if isinstance(s, Push) for v in s.values if v.source is None]


def failed_cells(steps: Sequence[Step]) -> list[DistributedCell]:
    """Cells that failed in the notebook (written commented out)."""
    return [s for s in steps if isinstance(s, DistributedCell) and s.failed]


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


def write_script(path: str | Path, steps: Sequence[Step], title: str | None = None,
                 nproc: int = 2, threads: int | None = None) -> Path:
    """Write the exported script to ``path`` (executable); returns the path."""
    target = Path(path)
    text = export_script(steps, title=title or f"{target.stem}: exported from a notebook",
                         filename=target.name, nproc=nproc, threads=threads)
    target.write_text(text, encoding="utf-8")
    target.chmod(0o755)
    return target
