"""From every rank's flight-recorder reading (per group, the collective it waits in or last
entered): the line a person reads first — who waits in which collective of which group, which
rank never entered it and why, and collectives whose operation or sizes differ across ranks."""

from __future__ import annotations

from nbdist.cluster.ranks import format_ranks
from nbdist.text import format_bytes
from nbdist.worker.flight_recorder import EnteredCollective

Readings = dict[int, list[EnteredCollective]]
"""rank -> per group, the collective it waits in (in flight) or entered last."""


def describe(entry: EnteredCollective, hint: str = "") -> str:
    """``all_reduce #9 of the default group (gradients in backward() at cell line 3, [4160]
    Float, 16.25 KiB)``: the hint (what the rank's stack says), then sizes, dtype, bytes."""
    dtype = ",".join(sorted(set(entry.dtypes)))
    shapes = f"{entry.shapes()} {dtype}, {format_bytes(entry.nbytes())}" if entry.sizes else ""
    detail = ", ".join(part for part in (hint, shapes) if part)
    return entry.title() + (f" ({detail})" if detail else "")


def verdict(readings: Readings, doing: dict[int, str], hints: dict[int, str]) -> list[str]:
    """One line per group some rank waits in; `doing` says what each rank does instead (``it
    finished the cell``), `hints` what a waiting rank's stack says it is in (DDP's backward)."""
    lines: list[str] = []
    for group in sorted({e.group for entries in readings.values() for e in entries}):
        on_group = {rank: e for rank, entries in readings.items() for e in entries
                    if e.group == group}
        waiting = {rank: e for rank, e in on_group.items() if not e.completed}
        if not waiting:
            continue
        seq = max(e.seq for e in waiting.values())
        waiters = sorted(rank for rank, e in waiting.items() if e.seq == seq)
        first = waiting[waiters[0]]
        members = set(first.ranks) or set(readings)
        what = describe(first, hints.get(waiters[0], ""))
        if len({(waiting[r].op, waiting[r].sizes) for r in waiters}) > 1:
            what = f"collective #{seq} of the {first.group}, not the same one (see below)"
        line = (f"rank{'s' if len(waiters) > 1 else ''} {format_ranks(waiters)} "
                f"wait{'' if len(waiters) > 1 else 's'} in {what}")
        missing = [
            f"rank {rank} never entered it: {_absent(on_group.get(rank), doing.get(rank, ''))}"
            for rank in sorted(members - set(waiters))
            if rank not in on_group or on_group[rank].seq < seq
        ]
        lines.append("; ".join([line, *missing]))
        lines.extend(mismatches({rank: on_group[rank] for rank in on_group
                                 if on_group[rank].seq == seq}))
    return lines


def _absent(last: EnteredCollective | None, doing: str) -> str:
    before = f" (its last in that group: {last.op} #{last.seq})" if last else ""
    return (doing or "it is somewhere else") + before


def mismatches(same_seq: dict[int, EnteredCollective]) -> list[str]:
    """Ranks at the same sequence id of one group that passed a different operation or sizes."""
    kinds = {(e.op, e.sizes, e.dtypes) for e in same_seq.values()}
    if len(kinds) < 2:
        return []
    entry = next(iter(same_seq.values()))
    passed = ", ".join(f"rank {rank}: {e.op} {e.shapes() or '(no tensor)'} "
                       f"{','.join(sorted(set(e.dtypes)))}".rstrip()
                       for rank, e in sorted(same_seq.items()))
    return [f"mismatch at collective #{entry.seq} of the {entry.group}: {passed}"]


CHECK_HINT = (
    "a collective whose operation or sizes differ across ranks ends a gloo rank this way "
    "(gloo aborts it from its own thread); with check_collectives (%dist_start "
    "--check-collectives, NbdistConfig.check_collectives) torch compares them before each "
    "collective and every rank raises an error naming the sizes instead")


def death_lines(dead: list[int], readings: Readings, since: float) -> list[str]:
    """What the surviving ranks were in when `dead` died: the collectives of this cell (entered
    after `since`) of groups the dead ranks belong to, with the sizes each survivor passed."""
    lines = []
    for rank, entries in sorted(readings.items()):
        for entry in entries:
            members = set(entry.ranks) or set(dead)
            if rank not in dead and entry.since >= since and members & set(dead):
                lines.append(f"when rank {format_ranks(dead)} died, rank {rank} was in "
                             f"{describe(entry)}")
    return lines
