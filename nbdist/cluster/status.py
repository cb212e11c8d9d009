"""A snapshot of the cluster for `%dist_status` and the start/restart summary (text and HTML),
built from a `ClusterCore` once; it never talks to the ranks itself."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from nbdist.text import render_table

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore

COLUMNS = ("rank", "local", "host", "pid", "device", "backend", "threads", "state")


class RankRow(NamedTuple):
    """One rank, its fields in COLUMNS order."""

    rank: int
    local_rank: int
    host: str
    pid: int
    device: str
    backend: str
    threads: int
    state: str


@dataclass(frozen=True)
class ClusterStatus:
    running: bool
    world_size: int
    backend: str
    generation: int
    controller: str
    rows: tuple[RankRow, ...]
    start_seconds: float
    batch_job: str = ""
    """The engines' batch job in one line (Slurm: id, state, time limit, log), "" if none."""

    @classmethod
    def of(cls, cluster: ClusterCore, batch_job: str = "") -> ClusterStatus:
        rows = tuple(
            RankRow(p.spec.rank, p.spec.local_rank, p.spec.host, p.pid, p.device, p.spec.backend,
                    p.threads, p.state if p.state == "alive" else f"dead ({p.exit_detail})")
            for p in cluster.ranks)
        controller = ("lost" if cluster.controller_lost
                      else "running" if cluster.running else "stopped")
        return cls(cluster.running, cluster.world_size, cluster.backend, cluster.generation,
                   controller, rows, cluster.start_seconds, batch_job)

    def summary_line(self) -> str:
        if not self.running:
            return "nbdist: no cluster running"
        dead = [r.rank for r in self.rows if r.state != "alive"]
        health = f"{len(dead)} dead: ranks {dead}" if dead else "all alive"
        lost = ", controller lost" if self.controller == "lost" else ""
        return (f"nbdist: {self.world_size} rank(s), {self.backend}, process group generation "
                f"{self.generation}, {health}{lost}")

    def table(self) -> str:
        return render_table(COLUMNS, self.rows)

    def __str__(self) -> str:
        job = f"\n{self.batch_job}" if self.batch_job else ""
        return self.summary_line() + job + ("\n" + self.table() if self.rows else "")

    def _repr_pretty_(self, p: object, cycle: bool) -> None:
        p.text(str(self))  # type: ignore[attr-defined]

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in COLUMNS)
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r)
                       + "</tr>" for r in self.rows)
        job = f"<p>{html.escape(self.batch_job)}</p>" if self.batch_job else ""
        return (f"<div><p>{html.escape(self.summary_line())}</p>{job}"
                f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>")
