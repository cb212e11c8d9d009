"""Cells on ranks on other hosts beside the same cells on local ranks, side by side in one run.

    sudo .venv/bin/python -m tests.benchmarks.bench_remote_cells            # print the figures
    sudo .venv/bin/python -m tests.benchmarks.bench_remote_cells --write    # and update RESULTS.md

Two hosts x 2 ranks (tests/netns_hosts.py: network namespaces on this machine, engines started
over ssh, the cell channel CurveZMQ-encrypted as across any hosts) and 4 local ranks, both
clusters up at once. Each round times no-op cells, then 1,000-float all_reduce cells, one cell on
each cluster in turn (remote, local, local, remote, ...). Figures: per cluster the median over
every timed cell, and the median over rounds of the ratio remote / local (the
engines share this machine's cores either way, so the ratio is the cost of the network path and
its encryption). Target: remote within 1.3x local. Needs root (network namespaces).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

from nbdist import Cluster
from nbdist.cluster.launchers import MultiHostWarning
from tests.benchmarks.common import ALL_REDUCE, NOOP, write_section
from tests.netns_hosts import hosts_network, ssh_launcher_options, why_not

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "benchmarks" / "RESULTS.md"
SECTION = "## Remote ranks: cells on 2 hosts x 2 ranks beside 4 local ranks"
ROUNDS = 12
CELLS = 30
TARGET = 1.3


def _time_cell(cluster: Cluster, code: str) -> float:
    started = time.perf_counter()
    cluster.run(code).raise_for_errors()
    return time.perf_counter() - started


def _round(remote: Cluster, local: Cluster, code: str, cells: int) -> dict[str, list[float]]:
    """`cells` cells on each cluster, interleaved remote, local, local, remote, ... so that
    whatever else loads the machine weighs on both alike."""
    for cluster in (remote, local):
        for _ in range(3):
            cluster.run(code).raise_for_errors()
    times: dict[str, list[float]] = {"remote": [], "local": []}
    for index in range(cells):
        pair = (("remote", remote), ("local", local))
        for side, cluster in pair if index % 2 == 0 else pair[::-1]:
            times[side].append(_time_cell(cluster, code))
    return times


def measure(rounds: int = ROUNDS, cells: int = CELLS) -> dict[str, object]:
    loads = [os.getloadavg()[0]]
    with hosts_network() as network, warnings.catch_warnings():
        warnings.simplefilter("ignore", MultiHostWarning)  # the point of this run
        remote_cluster = Cluster(n=4, threads=1, launcher="ssh",
                                 launcher_options=ssh_launcher_options(network))
        with remote_cluster as remote, Cluster(n=4, threads=1) as local:
            assert not any(p.local for p in remote.ranks) and all(p.local for p in local.ranks)
            samples: dict[str, list[float]] = {}
            ratios: dict[str, list[float]] = {"noop": [], "all_reduce": []}
            for _ in range(rounds):
                for name, code in (("noop", NOOP), ("all_reduce", ALL_REDUCE)):
                    times = _round(remote, local, code, cells)
                    for side, values in times.items():
                        samples.setdefault(f"{side}_{name}", []).extend(values)
                    ratios[name].append(statistics.median(times["remote"])
                                        / statistics.median(times["local"]))
                loads.append(os.getloadavg()[0])
            out_ratios = {k: [round(r, 3) for r in v] for k, v in ratios.items()}
    out: dict[str, object] = {key: statistics.median(v) * 1e3 for key, v in samples.items()}
    out.update({f"ratio_{k}": statistics.median(v) for k, v in ratios.items()})
    out.update(loads=loads, rounds=rounds, cells=cells, per_round=out_ratios)
    return out


def render(out: dict[str, object], seconds: float) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = ", ".join(f"{x:.1f}" for x in out["loads"])  # type: ignore[attr-defined]
    rows = []
    for name, label in (("noop", "no-op cell"), ("all_reduce", "1,000-float all_reduce cell")):
        ratio = float(out[f"ratio_{name}"])  # type: ignore[arg-type]
        rows.append(f"| {label} | {out[f'remote_{name}']:.1f} ms | {out[f'local_{name}']:.1f} ms "
                    f"| {ratio:.2f} | ≤ {TARGET}: {'met' if ratio <= TARGET else 'NOT met'} |")
    return "\n".join([
        SECTION, "",
        f"Measured {when} by `.venv/bin/python -m tests.benchmarks.bench_remote_cells --write` "
        f"({seconds / 60:.1f} min); machine: {platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"{platform.platform()}; load average (1 min) before and after each round: {loads}.",
        "",
        "Remote: 4 gloo ranks on two network-namespace hosts (2 each), engines started by "
        "ipyparallel's SSH launcher, cells over the CurveZMQ-encrypted cell channel. Local: 4 gloo "
        "ranks forked on this machine, cells over the same channel on loopback. Both clusters up "
        f"at once, 1 thread per rank; {out['rounds']} rounds of {out['cells']} timed cells per "
        "figure and cluster (after 3 untimed), one cell on each in turn; medians over all cells, "
        "and the median of the per-round ratios.",
        "",
        f"Per-round ratios, no-op: {_listed(out['per_round'], 'noop')}; all_reduce: "
        f"{_listed(out['per_round'], 'all_reduce')}.",
        "",
        "| figure | remote (2 hosts × 2) | local (4) | remote ÷ local | target |",
        "| --- | --- | --- | --- | --- |",
        *rows, "",
    ])


def _listed(per_round: object, name: str) -> str:
    return ", ".join(f"{r:.2f}" for r in per_round[name])  # type: ignore[index]



if __name__ == "__main__":
    reason = why_not()
    if reason:
        sys.exit(f"bench_remote_cells: {reason}")
    started = time.perf_counter()
    section = render(measure(), time.perf_counter() - started)
    print(section)
    if "--write" in sys.argv:
        write_section(RESULTS, SECTION, section)
