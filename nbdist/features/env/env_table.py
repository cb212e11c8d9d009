"""What `%dist_env` shows: one `RankEnv` per rank (what its `env.collect` answers) and the
`EnvTable` of them, with each cell that differs from the other ranks marked."""

from __future__ import annotations

import html
import re
from collections import Counter
from dataclasses import dataclass, field

from nbdist.text import render_table

PER_RANK_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "NBDIST_DEVICE", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_TASK_PID",
    "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",  # nbdist's, one per rank
})
"""Variables that differ between ranks by design: never reported as a difference."""

SECRET = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL", re.IGNORECASE)
MAX_VAR_COLUMNS = 12  # differing variables beyond these are named below the table
MARK = "*"
COLUMNS = ("rank", "host", "python", "torch", "cuda", "nccl", "devices")


@dataclass(frozen=True, slots=True)
class RankEnv:
    rank: int
    host: str
    pid: int
    python: str
    torch: str
    cuda: str  # "" on a CPU build
    nccl: str  # "" without CUDA or NCCL
    devices: str
    environ: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvTable:
    """Every answering rank's environment; `failures`: rank -> why it did not answer."""

    ranks: list[RankEnv]
    failures: dict[int, str] = field(default_factory=dict)

    @property
    def differing(self) -> list[str]:
        """The environment variables whose value (or presence) is not the same on every rank."""
        names = {name for env in self.ranks for name in env.environ} - PER_RANK_VARS
        return sorted(n for n in names if len({env.environ.get(n) for env in self.ranks}) > 1)

    def rows(self) -> tuple[list[str], list[list[tuple[str, bool]]]]:
        """The header and, per rank, each cell's text and whether it differs from the value
        most ranks have, or no value has most ranks (rank and host are never marked)."""
        shown = self.differing[:MAX_VAR_COLUMNS]
        header = [*COLUMNS[2:], *shown]
        values = [[getattr(env, c) for c in COLUMNS[2:]] + [_shown(n, env.environ.get(n))
                                                             for n in shown]
                  for env in self.ranks]
        usual = [_majority(column) for column in zip(*values, strict=True)]
        rows = [[(str(env.rank), False), (env.host, False)]
                + [(v, v != usual[i]) for i, v in enumerate(row)]
                for env, row in zip(self.ranks, values, strict=True)]
        return [*COLUMNS[:2], *header], rows

    def notes(self) -> list[str]:
        more = self.differing[MAX_VAR_COLUMNS:]
        lines = [f"rank {r}: no answer ({why})" for r, why in sorted(self.failures.items())]
        if more:
            lines.append(f"also different: {', '.join(more)}")
        if not self.differing and self.ranks:
            lines.append("every rank has the same environment variables")
        return lines

    def __str__(self) -> str:
        header, rows = self.rows()
        text = render_table(header, [[v + (MARK if marked else "") for v, marked in row]
                                     for row in rows], rule=True)
        legend = f"{MARK} differs from the other ranks"
        return "\n".join([text, legend, *self.notes()])

    def _repr_pretty_(self, p: object, cycle: bool) -> None:
        p.text(str(self))  # type: ignore[attr-defined]

    def _repr_html_(self) -> str:
        header, rows = self.rows()
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        mark = ' style="background:#ffe08a" title="differs from the other ranks"'
        body = "".join("<tr>" + "".join(f"<td{mark if marked else ''}>{html.escape(v)}</td>"
                                        for v, marked in row) + "</tr>" for row in rows)
        notes = "".join(f"<p>{html.escape(line)}</p>" for line in self.notes())
        return (f"<div><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"{notes}</div>")


def _majority(column: tuple[str, ...]) -> str | None:
    """The value more than half the ranks have; None when none has (each cell is then marked)."""
    value, count = Counter(column).most_common(1)[0]
    return value if count * 2 > len(column) else None


def _shown(name: str, value: str | None) -> str:
    if value is None:
        return "(unset)"
    return "(hidden)" if SECRET.search(name) else value
