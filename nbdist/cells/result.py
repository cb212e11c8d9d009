"""What a distributed cell produced, per rank: output, values, errors, and what nbdist did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbdist.cluster.ranks import format_ranks
from nbdist.errors import DistributedCellError


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

    def headline(self) -> str:
        if self.out_of_memory:
            how = f"died ({self.evalue})" if self.kind == "dead" else f"{self.ename}: {self.evalue}"
            return (f"rank {self.rank} ran out of memory: it is limited to {self.out_of_memory}; "
                    f"{how}")
        if self.kind == "dead":
            return f"rank {self.rank} died: {self.evalue}"
        if self.kind == "collective":
            return f"rank {self.rank}: was waiting in {self.where} (released when its peer failed)"
        if self.kind == "interrupted":
            return f"rank {self.rank}: interrupted{f' at {self.where}' if self.where else ''}"
        if self.kind == "lost":
            return f"rank {self.rank}: no answer (controller lost)"
        return f"rank {self.rank} raised {self.ename}: {self.evalue}"


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

    @property
    def ok(self) -> bool:
        return not self.errors

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

    def failure_message(self) -> str:
        roots = self.root_causes()
        lines: list[str] = []
        failed = sorted(self.errors)
        summary = f"distributed cell failed on rank(s) {format_ranks(failed)}"
        if self.timed_out:
            summary = "distributed cell hit its deadline"
        elif self.interrupted:
            summary = "distributed cell interrupted"
        lines.append(summary)
        shown = set()
        for err in roots:
            if err.kind in ("interrupted", "collective"):
                continue
            shown.add(err.rank)
            lines.append("")
            lines.append(f"── {err.headline()} ──")
            if err.traceback:
                lines.append(err.traceback.rstrip())
        others = [e for r, e in sorted(self.errors.items()) if r not in shown]
        if others or self.report:
            lines.append("")
        for err in others:
            lines.append(err.headline())
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
            raise DistributedCellError(self.failure_message(), self)
        return self

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"errors on {format_ranks(sorted(self.errors))}"
        return f"<CellResult ranks {format_ranks(self.ranks)}: {state}, {self.elapsed:.3f} s>"
