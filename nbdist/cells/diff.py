"""Compare one object across ranks (`%dist_diff`, `Cluster.diff`, `nbdist.diff`): fingerprints
per entry from every rank (`nbdist.worker.diffing`), then only the entries that differ are looked
at closely, by fetching them (from the notebook) or by a broadcast (inside a cell)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbdist.cluster.ranks import format_ranks
from nbdist.errors import NbdistError
from nbdist.text import render_table
from nbdist.worker import diffing

FETCH_LIMIT = 4
"""Differing entries whose largest difference is measured; the rest are only named."""

FETCH_MAX_BYTES = 256 * 2**20
"""An entry larger than this is not fetched to the notebook (its difference is left unmeasured)."""


@dataclass
class EntryDiff:
    """One entry that is not the same on every rank: the ranks that agree with the reference
    (rank 0's group, or the majority), the ones that differ, how, and by how much."""

    name: str
    reference: list[int]
    differing: list[int]
    detail: str
    max_abs: float | None = None

    def who(self) -> str:
        ranks = f"rank{'s' if len(self.differing) > 1 else ''} {format_ranks(self.differing)}"
        verb = "differ" if len(self.differing) > 1 else "differs"
        if len(self.reference) == 1:
            return f"{ranks} {verb} from rank {self.reference[0]}"
        return f"{ranks} {verb} from the majority (ranks {format_ranks(self.reference)})"


@dataclass
class DiffReport:
    """What `%dist_diff` found; `str()` is the report."""

    label: str
    ranks: list[int]
    entries: int
    diffs: list[EntryDiff] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.diffs

    @property
    def first(self) -> EntryDiff | None:
        return self.diffs[0] if self.diffs else None

    def text(self, rows: int = 10) -> str:
        compared = f"{self.entries} entr{'y' if self.entries == 1 else 'ies'} compared"
        notes = [f"  ({note})" for note in self.notes]
        if self.equal:
            return "\n".join([f"{self.label}: all ranks equal ({compared}, ranks "
                              f"{format_ranks(self.ranks)})", *notes])
        first = self.diffs[0]
        lines = [f"{self.label}: ranks differ at {len(self.diffs)} of {self.entries} entries",
                 f"first difference: {first.name or '(the value)'}: {first.who()} "
                 f"({first.detail}{_max_text(first.max_abs)})", ""]
        table = [(d.name or "(the value)", format_ranks(d.differing), d.detail,
                  "–" if d.max_abs is None else f"{d.max_abs:.4g}") for d in self.diffs[:rows]]
        lines.append(render_table(["entry", "differing ranks", "how", "max |difference|"], table,
                                  rule=True))
        if len(self.diffs) > rows:
            lines.append(f"... and {len(self.diffs) - rows} more")
        return "\n".join([*lines, *notes])

    __str__ = text

    def __repr__(self) -> str:
        return self.text()


def _max_text(value: float | None) -> str:
    return "" if value is None else f", max |difference| {value:.4g}"


def compare(prints: Mapping[int, Mapping[str, Any]]) -> list[EntryDiff]:
    """{rank: {name: fingerprint}} -> the entries that differ, in the first rank's order."""
    ranks = sorted(prints)
    names: dict[str, None] = {}
    for rank in ranks:
        names.update(dict.fromkeys(prints[rank]))
    diffs = []
    for name in names:
        by_rank = {rank: prints[rank].get(name) for rank in ranks}
        groups: dict[str | None, list[int]] = {}
        for rank, fp in by_rank.items():
            groups.setdefault(None if fp is None else fp["digest"], []).append(rank)
        if len(groups) == 1:
            continue
        # the largest group is the reference; a tie goes to the group holding the lowest rank
        reference = max(groups.values(), key=lambda group: (len(group), -group[0]))
        differing = [r for r in ranks if r not in reference]
        diffs.append(EntryDiff(name, reference, differing,
                               _how(by_rank[reference[0]], [by_rank[r] for r in differing])))
    return diffs


def _how(ref: Mapping[str, Any] | None, others: list[Mapping[str, Any] | None]) -> str:
    if ref is None:
        return "only on these ranks"
    if any(o is None for o in others):
        return "missing there"
    other = next(o for o in others if o is not None)
    if ref["kind"] != other["kind"]:
        return f"{ref['kind']} vs {other['kind']}"
    if ref.get("shape") != other.get("shape"):
        return f"shape {ref.get('shape')} vs {other.get('shape')}"
    if ref.get("dtype") != other.get("dtype"):
        return f"dtype {ref.get('dtype')} vs {other.get('dtype')}"
    if ref["kind"] in ("value", "sharded"):
        return f"{ref['repr']} vs {other['repr']}"
    return "values differ"


def measurable(diff: EntryDiff, prints: Mapping[int, Mapping[str, Any]]) -> bool:
    """A tensor of the same shape on every rank: its largest difference means something."""
    fps = [prints[r].get(diff.name) for r in (*diff.reference[:1], *diff.differing)]
    tensors = all(fp is not None and fp["kind"] == "tensor" for fp in fps)
    return tensors and diff.detail == "values differ"


def diff_ranks(cluster: Any, expr: str, ranks: list[int] | None = None, full: bool = False,
               fetch_limit: int = FETCH_LIMIT) -> DiffReport:
    """`Cluster.diff`: evaluate `expr` on each rank, compare fingerprints, fetch the first few
    differing tensors from the reference rank and the ranks that differ."""
    targets = cluster.targets(ranks)
    if full and len(targets) != cluster.world_size:
        raise NbdistError("%dist_diff --full gathers sharded tensors, a collective: it needs "
                          "every rank (drop --ranks)")
    timeout = cluster.config.start.bootstrap_timeout
    gathered = cluster.call("diff.fingerprint", expr, full, ranks=targets,
                            timeout=timeout)
    if gathered.failures:
        rank = min(gathered.failures)
        raise NbdistError(f"%dist_diff {expr}: rank {rank}: {gathered.failures[rank]}")
    results = gathered.results
    failed = sorted(r for r, fp in results.items() if "error" in fp)
    if failed:
        raise NbdistError(f"%dist_diff {expr}: rank {failed[0]}: {results[failed[0]]['error']}")
    prints = {r: fp["entries"] for r, fp in results.items()}
    diffs = compare(prints)
    wanted = [d for d in diffs if measurable(d, prints) and _small(d, prints)][:fetch_limit]
    _measure_fetched(cluster, wanted, timeout)
    notes = sorted({note for fp in results.values() for note in fp["notes"]})
    skipped = [d.name for d in diffs if measurable(d, prints) and not _small(d, prints)]
    if skipped:
        notes.append(f"not fetched (over {FETCH_MAX_BYTES // 2**20} MiB): {', '.join(skipped[:3])}")
    types = sorted({fp["type"] for fp in results.values()})
    return DiffReport(f"{expr} ({' / '.join(types)})", sorted(results), len(_names(prints)),
                      diffs, notes)


def _names(prints: Mapping[int, Mapping[str, Any]]) -> set[str]:
    return {name for entries in prints.values() for name in entries}


def _small(diff: EntryDiff, prints: Mapping[int, Mapping[str, Any]]) -> bool:
    fp = prints[diff.reference[0]][diff.name]
    numel = 1
    for size in fp["shape"]:
        numel *= size
    return numel * 8 <= FETCH_MAX_BYTES


def _measure_fetched(cluster: Any, wanted: list[EntryDiff], timeout: float) -> None:
    ranks = sorted({r for diff in wanted for r in (diff.reference[0], *diff.differing)})
    names = sorted({diff.name for diff in wanted})  # small entries only: the union costs little
    results = cluster.call("diff.fetch", names, ranks=ranks, timeout=timeout).results
    for diff in wanted:
        ref = results.get(diff.reference[0], {}).get(diff.name)
        others = [results.get(r, {}).get(diff.name) for r in diff.differing]
        if ref is not None and all(o is not None for o in others):
            diff.max_abs = max(_max_abs(ref, other) for other in others)


def _max_abs(a: Any, b: Any) -> float:
    import torch

    if a.numel() == 0:
        return 0.0
    if a.dtype == torch.bool:
        return float((a != b).any())
    kind = torch.complex128 if a.is_complex() else torch.float64
    return float((a.to(kind) - b.to(kind)).abs().max())


def diff(obj: Any, full: bool = False, fetch_limit: int = FETCH_LIMIT) -> DiffReport:
    """`nbdist.diff(model)` inside a `%%distributed` cell, on every rank at once (a collective):
    fingerprints are all-gathered, the first few differing tensors are broadcast from the
    reference rank and each rank measures its own difference. Every rank returns the report."""
    import torch.distributed as dist

    mine = diffing.fingerprint(obj, full=full)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    prints = {r: fp["entries"] for r, fp in enumerate(everyone)}
    diffs = compare(prints)
    for entry in [d for d in diffs if measurable(d, prints)][:fetch_limit]:
        local = diffing.local_entry(entry.name)
        reference = local.clone()
        dist.broadcast(reference, src=entry.reference[0])
        measured: list[Any] = [None] * len(everyone)
        dist.all_gather_object(measured, _max_abs(reference, local))
        entry.max_abs = max(measured[r] for r in entry.differing)
    notes = sorted({note for fp in everyone for note in fp["notes"]})
    return DiffReport(diffing.describe_type(obj), list(prints), len(_names(prints)), diffs, notes)
