"""What an exported script is made of: the ``%%distributed`` cells and ``%dist_push`` values of a
session, in the order they ran, read from ``(label, source)`` pairs and a :class:`SessionLog`."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from nbdist.cluster.ranks import parse_ranks
from nbdist.errors import NbdistError
from nbdist.export.session_log import PushedValue, SessionLog

MAGIC = "%%distributed"

_UNKNOWN_WORLD_SIZE = 1 << 16
"""Upper bound for ``--ranks`` when the world size is not known: ranks read as plain numbers."""


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


@dataclass
class Push:
    """One cell's ``%dist_push``: what every rank received, in order."""

    values: list[PushedValue]
    label: str = ""


Step = DistributedCell | Push
"""What a script is made of, in the order the notebook ran it."""


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
        if _is_magic_line(first):
            cell = _magic_cell(text, label, world_size, log)
        elif autodist and first and not first.startswith(("%", "!")):
            cell = DistributedCell(source=text, label=label)
        if cell is not None:
            cell.failed = log.failures.get(label, "")
            steps.append(cell)
    return steps


def placeholders(steps: Sequence[Step]) -> list[PushedValue]:
    """Pushed values the script could not write out (each raises where it was pushed)."""
    return [v for s in steps if isinstance(s, Push) for v in s.values if v.source is None]


def failed_cells(steps: Sequence[Step]) -> list[DistributedCell]:
    """Cells that failed in the notebook (written commented out)."""
    return [s for s in steps if isinstance(s, DistributedCell) and s.failed]


def _is_magic_line(first: str) -> bool:
    return first.startswith(MAGIC) and (len(first) == len(MAGIC) or first[len(MAGIC)].isspace())


def _magic_cell(text: str, label: str, world_size: int | None, log: SessionLog) -> DistributedCell:
    head, _, body = text.lstrip().partition("\n")
    try:
        return _parse_magic_line(head[len(MAGIC):], body, label, world_size)
    except (NbdistError, ValueError):
        if label not in log.failures:
            raise
        # e.g. --ranks 5 on 2 ranks: it failed in the notebook, it is only a comment here
        return DistributedCell(source=body, options=[head[len(MAGIC):].strip()], label=label)


def _parse_magic_line(line: str, body: str, label: str, world_size: int | None) -> DistributedCell:
    words = shlex.split(line)
    ranks: list[int] | None = None
    options: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--ranks"):
            if "=" in word:
                value = word.split("=", 1)[1]
            else:
                value = words[i + 1] if i + 1 < len(words) else ""
                i += 1
            known = world_size if world_size is not None else _UNKNOWN_WORLD_SIZE
            ranks = parse_ranks(value, known)
        else:
            options.append(word)
        i += 1
    return DistributedCell(source=body, ranks=ranks, options=options, label=label)
