"""Line up the clocks of ranks on different hosts. Each capture is stamped with its host's wall
clock; hosts can disagree by a few ms. A blocking all-reduce, all-gather or barrier finishes on
every rank at about the same instant, so the median difference of those ends, host against rank
0's host, is that host's offset (to within the network's latency)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from nbdist.profiler.timeline import rank_calls

MIN_SAMPLES = 3
"""Matched collectives needed before a host's clock is moved."""
MIN_OFFSET_US = 200.0
"""Below this, hosts are taken to agree (the ends themselves differ by about this much)."""
_SYMMETRIC = ("all_reduce", "allreduce", "all_gather", "allgather", "barrier", "reduce_scatter",
              "all_to_all", "alltoall")


def host_offsets(captures: Sequence[dict[str, Any]]) -> dict[str, float]:
    """µs to subtract from each host's times so they read like rank 0's host (0 for that one)."""
    hosts = {int(c["rank"]): str(c.get("host", "")) for c in captures}
    if len(set(hosts.values())) < 2:
        return {}
    reference = hosts[min(hosts)]
    ends: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for capture in captures:
        for call in rank_calls(capture["events"]):
            if any(mark in call.name for mark in _SYMMETRIC):
                ends[(call.group, call.seq)][hosts[int(capture["rank"])]].append(call.end)
    differences: dict[str, list[float]] = defaultdict(list)
    for by_host in ends.values():
        if reference not in by_host:
            continue
        mine = statistics.median(by_host[reference])
        for host, values in by_host.items():
            if host != reference:
                differences[host].append(statistics.median(values) - mine)
    offsets = {reference: 0.0}
    for host, values in differences.items():
        offset = statistics.median(values) if len(values) >= MIN_SAMPLES else 0.0
        offsets[host] = offset if abs(offset) >= MIN_OFFSET_US else 0.0
    return offsets


def align_clocks(
    captures: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The captures on one clock (copies where a host moved), and each host's offset in µs."""
    offsets = host_offsets(captures)
    aligned = []
    for capture in captures:
        shift = offsets.get(str(capture.get("host", "")), 0.0)
        if not shift:
            aligned.append(capture)
            continue
        aligned.append({**capture, "start_us": capture["start_us"] - shift,
                        "end_us": capture["end_us"] - shift,
                        "events": [{**e, "ts": e["ts"] - shift} for e in capture["events"]]})
    return aligned, {host: offset for host, offset in offsets.items() if offset}
