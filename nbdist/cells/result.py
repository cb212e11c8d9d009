"""What a distributed cell produced, per rank: output, values, errors, and what nbdist did."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nbdist.cells.output_log import read_log
from nbdist.cluster.ranks import format_ranks
from nbdist.errors import DistributedCellError
from nbdist.text import strip_ansi


@dataclass
class RankError:
    """One rank's failure. ``kind``: root (raised in user code), collective (released from a
    collective because a peer failed), interrupted, dead, lost (controller gone)."""

    rank: int
    kind: str
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    where: str = ""
    out_of_memory: str = ""
    """The memory limit this rank ran out of ("1.00 GiB by --memory-limit ..."), if it did."""

    def headline(self, who: str = "") -> str:
        """One line: what happened to this rank (`who` names it instead, e.g. "ranks 0-7")."""
        who = who or f"rank {self.rank}"
        if self.out_of_memory:
            how = f"died ({self.evalue})" if self.kind == "dead" else f"{self.ename}: {self.evalue}"
            return f"{who} ran out of memory: it is limited to {self.out_of_memory}; {how}"
        if self.kind == "dead":
            return f"{who} died: {self.evalue}"
        if self.kind == "collective":
            return f"{who}: was waiting in {self.where} (released when its peer failed)"
        if self.kind == "interrupted":
            return f"{who}: interrupted{f' at {self.where}' if self.where else ''}"
        if self.kind == "lost":
            return f"{who}: no answer (controller lost)"
        return f"{who} raised {self.ename}: {self.evalue}"

    def same_failure(self) -> tuple[str, ...]:
        """What two ranks share when they failed the same way: everything but the rank, the
        cell's number in the traceback (a rank that ran a cell the others did not counts one
        more) and objects' addresses."""
        return (self.kind, self.ename, _ADDRESS.sub("0x", self.evalue), self.where,
                self.out_of_memory,
                _ADDRESS.sub("0x", _CELL_NUMBER.sub("In[]", strip_ansi(self.traceback))))


_CELL_NUMBER = re.compile(r"\bIn\[\d+\]")
_ADDRESS = re.compile(r"\b0x[0-9a-f]{6,}\b")
"""An object's address in a message (`<... object at 0x7f60fc653370>`): each rank has its own."""


@dataclass
class CellResult:
    """Per-rank outcome of one distributed cell (returned by ``Cluster.run``)."""

    code: str
    ranks: list[int]
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    displays: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    errors: dict[int, RankError] = field(default_factory=dict)
    report: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    timed_out: bool = False
    interrupted: bool = False
    report_shown: bool = False  # the report was already streamed under the cell as it was made
    outputs: dict[int, str] = field(default_factory=dict)
    """Each rank's stdout and stderr as they came, for ranks whose output fit the cell."""
    output_dir: str = ""
    """Where the rest is: a file per rank whose output was longer (in the cluster's work
    directory)."""

    @property
    def ok(self) -> bool:
        return not self.errors

    def output(self, rank: int) -> str:
        """Everything `rank` printed in this cell, stdout and stderr as they came, also past what
        the notebook showed ("" once the cluster stopped or 20 cells with output later)."""
        return self.outputs[rank] if rank in self.outputs else read_log(self.output_dir, rank)

    def value_text(self, rank: int) -> str | None:
        """The text/plain form of the rank's last expression, or None."""
        bundle = self.results.get(rank)
        if not bundle:
            return None
        return str(bundle.get("data", {}).get("text/plain", ""))

    def grouped_values(self) -> list[tuple[list[int], str]]:
        """Identical values grouped: [([0, 1, 2, 3], 'tensor([6.])')]."""
        groups: dict[str, list[int]] = {}
        for rank in self.ranks:
            text = self.value_text(rank)
            if text is not None:
                groups.setdefault(text, []).append(rank)
        return [(ranks, text) for text, ranks in groups.items()]

    def root_causes(self) -> list[RankError]:
        roots = [e for e in self.errors.values() if e.kind in ("root", "dead")]
        if roots:
            return sorted(roots, key=lambda e: e.rank)
        return sorted(self.errors.values(), key=lambda e: e.rank)

    def failure_message(self, color: bool = False) -> str:
        """Root causes first, each with its traceback; ranks that failed the same way share one
        headline and one traceback (`ranks 0-63 raised NameError: ...`, at 2 ranks as at 64).
        Plain text unless `color`: the ranks' tracebacks then keep IPython's colour codes, for a
        notebook to show."""
        lines: list[str] = []
        summary = f"distributed cell failed on rank(s) {format_ranks(sorted(self.errors))}"
        if self.timed_out:
            summary = "distributed cell hit its deadline"
        elif self.interrupted:
            summary = "distributed cell interrupted"
        lines.append(summary)
        shown = set()
        for ranks, err in _alike(e for e in self.root_causes()
                                 if e.kind not in ("interrupted", "collective")):
            shown.update(ranks)
            lines += ["", f"── {err.headline(_who(ranks))} ──"]
            if err.traceback:
                lines.append((err.traceback if color else strip_ansi(err.traceback)).rstrip())
        others = [e for r, e in sorted(self.errors.items()) if r not in shown]
        if others or self.report:
            lines.append("")
        # shown by headline only: ranks whose headlines match share one
        lines += [err.headline(_who(ranks))
                  for ranks, err in _alike(others, lambda e: (e.headline("_"),))]
        if self.report_shown and self.report:
            lines.append("(where each rank was at the deadline: see the report above)")
        else:
            lines.extend(self.report)
        if self.actions:
            lines.append("")
            lines.extend(f"nbdist: {a}" for a in self.actions)
        return "\n".join(lines)

    def raise_for_errors(self) -> CellResult:
        if self.errors:
            raise DistributedCellError(self.failure_message(), self,
                                       rendered=self.failure_message(color=True))
        return self

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"errors on {format_ranks(sorted(self.errors))}"
        return f"<CellResult ranks {format_ranks(self.ranks)}: {state}, {self.elapsed:.3f} s>"


def _alike(errors: Iterable[RankError],
           key: Callable[[RankError], tuple[str, ...]] = RankError.same_failure,
           ) -> list[tuple[list[int], RankError]]:
    """Errors grouped by `key`, in the order of each group's first rank: ranks that failed alike
    share one headline and one traceback (each rank's own stays in `CellResult.errors`)."""
    groups: dict[tuple[str, ...], tuple[list[int], RankError]] = {}
    for err in errors:
        groups.setdefault(key(err), ([], err))[0].append(err.rank)
    return sorted(groups.values(), key=lambda group: group[0][0])


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
