"""The cross-rank profiler: merge/classify logic on hand-made captures, then real ranks (gloo)
under `Cluster.run(profile=...)`, `%%distributed --profile` and `with nbdist.profile()`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from nbdist.errors import DistributedCellError
from nbdist.notebook import magics
from nbdist.profiler import build_report
from nbdist.profiler.timeline import build_timeline, rank_calls

STRAGGLER_CELL = """
import time, torch, torch.distributed as dist
t = torch.ones(1000)
for _ in range(3):
    if rank == 1:
        time.sleep(0.4)
    dist.all_reduce(t)
"""


# ---------------------------------------------------------------- hand-made captures
def _event(name: str, ts: float, dur: float, tid: int = 1, top: bool = True) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "tid": tid, "cat": "cpu_op", "top": top}


def _capture(rank: int, events: list[dict], start: float = 0.0, end: float = 1000.0) -> dict:
    return {"rank": rank, "host": "h", "start_us": start, "end_us": end, "events": events,
            "top_operators": [{"name": "aten::mm", "count": 1, "self_cpu_us": 100.0,
                               "self_device_us": 0.0}]}


def _explicit(rank_arrival: float, end: float, group: str = "0") -> list[dict]:
    """A blocking all_reduce as the ranks record it: the labelled range, its c10d op (launch)
    and gloo's worker-thread event."""
    return [_event(f"nbdist.collective:all_reduce|{group}", rank_arrival, end - rank_arrival),
            _event("c10d::allreduce_", rank_arrival + 1, 2, top=False),
            {**_event("gloo:all_reduce", rank_arrival + 3, end - rank_arrival - 3, tid=7)}]


def test_wait_is_time_before_the_last_rank_arrived() -> None:
    rank0 = [_event("aten::mm", 0, 1000), *_explicit(1000, 5000)]
    rank1 = [_event("aten::mm", 0, 4800), *_explicit(4800, 5000)]
    timeline = build_timeline([_capture(1, rank1, end=10_000), _capture(0, rank0, end=10_000)])
    (collective,) = timeline.collectives
    assert (collective.name, collective.group, collective.seq) == ("all_reduce", "0", 1)
    assert collective.last_rank == 1
    assert collective.waits == {0: 3800.0, 1: 0.0}
    row0 = timeline.row(0)
    assert row0.totals == {"compute": 1000.0, "wait": 3800.0, "communication": 200.0,
                           "idle": 5000.0}
    assert sum(row0.totals.values()) == 10_000.0  # the kinds split the window exactly
    report = build_report([_capture(0, rank0), _capture(1, rank1)])
    assert report.straggler == 1
    assert report.summary.top_operators[0] == {"name": "aten::mm", "count": 2,
                                               "self_cpu_us": 200.0, "self_device_us": 0.0}
    assert "straggler: rank 1" in report.table()


def test_groups_are_matched_separately_and_async_work_ends_with_the_backend() -> None:
    # rank 0 calls group "a" then "b"; rank 1 calls "b" then "a": order alone would mismatch
    rank0 = [*_explicit(0, 100, "a"), *_explicit(200, 300, "b")]
    rank1 = [*_explicit(50, 100, "b"), *_explicit(250, 300, "a")]
    timeline = build_timeline([_capture(0, rank0), _capture(1, rank1)])
    by_group = {c.group: c for c in timeline.collectives}
    assert by_group["a"].arrivals == {0: 0, 1: 250} and by_group["a"].last_rank == 1
    assert by_group["b"].arrivals == {0: 200, 1: 50} and by_group["b"].last_rank == 0
    # torch's own collective (DDP's bucket all-reduce): a c10d op whose work ends on gloo's thread
    implicit = [_event("c10d::allreduce_", 10, 5), _event("gloo:all_reduce", 16, 300, tid=7)]
    (call,) = rank_calls(implicit)
    assert (call.group, call.arrival, call.end) == ("implicit", 10, 316)


def test_a_range_around_a_collective_is_not_compute_but_its_children_are() -> None:
    # FSDP::all_gather: a copy-in (compute), the gather's launch, then blocked until it is done
    events = [_event("FSDP::all_gather", 0, 5000),
              _event("aten::copy_", 100, 400, top=False),
              _event("c10d::_allgather_base_", 600, 50, top=False),
              _event("gloo:all_gather", 660, 4300, tid=7),
              _event("aten::mm", 5000, 1000)]
    row = build_timeline([_capture(0, events, end=6000)]).row(0)
    assert row.totals["compute"] == 1400.0  # the copy and the matmul, not the whole range
    assert row.totals["communication"] == 4960.0 - 600.0  # launch to gloo's end
    assert [kind for _, _, kind in row.segments] == [
        "idle", "compute", "idle", "communication", "idle", "compute"]


def test_no_straggler_below_a_millisecond_and_a_one_rank_collective_waits_nothing() -> None:
    rank0, rank1 = _explicit(100, 200), _explicit(100.5, 200)
    report = build_report([_capture(0, rank0), _capture(1, rank1)])
    assert report.straggler is None
    assert "no straggler" in report.table()
    solo = build_timeline([_capture(0, _explicit(0, 50))])
    assert solo.collectives[0].waits == {0: 0.0}


def test_trace_file_has_one_process_per_rank(tmp_path: Path) -> None:
    rank0 = [_event("aten::mm", 0, 100), *_explicit(100, 500)]
    rank1 = [_event("aten::mm", 0, 480), *_explicit(480, 500)]
    path = tmp_path / "t.json"
    build_report([_capture(0, rank0), _capture(1, rank1)], trace_path=path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0 (h)", 1: "rank 1 (h)"}
    assert all(isinstance(e["tid"], int) for e in events)
    waits = [e for e in events if e.get("name") == "wait"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in waits] == [(0, 100, 380)]


# ---------------------------------------------------------------- real ranks
def test_straggler_and_wait_on_real_ranks(cluster2, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    result = cluster2.run(STRAGGLER_CELL, profile=str(path))
    result.raise_for_errors()
    report = cluster2.last_profile
    assert report is not None and report.straggler == 1, report.table()
    assert report.wait_us(0) == pytest.approx(1.2e6, rel=0.2), report.table()
    assert report.wait_us(1) < 0.1e6, report.table()
    assert report.summary.straggler.last_in == 3

    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(processes) == [0, 1] and processes[1].startswith("rank 1")
    collectives = [e for e in events if e.get("cat") == "collective"]
    assert sorted((e["pid"], e["args"]["seq"]) for e in collectives) == [
        (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert all(e["name"].startswith("all_reduce #") for e in collectives)
    # clocks aligned: each all_reduce finished on rank 0 (rank 0's clock) just after rank 1
    # arrived (rank 1's clock), never before it: measured 0.7-8 ms after, here
    arrivals = {e["args"]["seq"]: e["ts"] for e in collectives if e["pid"] == 1}
    finished = {e["args"]["seq"]: e["ts"] + e["dur"] for e in collectives if e["pid"] == 0}
    for seq, arrival in arrivals.items():
        assert -1_000 < finished[seq] - arrival < 50_000, (seq, finished[seq], arrival)
    # rank 0's wait spans (its nbdist row) end at rank 1's arrivals, each about 0.4 s long
    wait_spans = sorted((e for e in events if e.get("name") == "wait" and e["pid"] == 0),
                        key=lambda e: e["ts"])
    assert len(wait_spans) == 3
    for span, arrival in zip(wait_spans, sorted(arrivals.values()), strict=True):
        assert abs(span["ts"] + span["dur"] - arrival) < 1_000
        assert span["dur"] == pytest.approx(0.4e6, rel=0.2)


def _no_profiler_running(cluster) -> None:
    cluster.run(
        "import torch, torch.distributed as dist\n"
        "from nbdist.worker import collectives, profiling\n"
        "_profiling_state = (profiling.is_active(), torch.autograd.profiler._is_profiler_enabled,"
        " collectives.TRACKER.profiling)").raise_for_errors()
    assert cluster.pull("_profiling_state") == {0: (False, False, False), 1: (False, False, False)}


def test_a_failing_cell_reports_its_error_and_leaves_no_profiler(cluster2, ip) -> None:
    result = cluster2.run("import torch.distributed as dist\ndist.barrier()\n"
                          "if rank == 1:\n    raise ValueError('boom on 1')", profile=True)
    assert list(result.errors) == [1] and "boom on 1" in str(result.errors[1])
    assert cluster2.last_profile is not None and not cluster2.last_profile.missing
    _no_profiler_running(cluster2)
    magics._CURRENT = cluster2
    try:
        with pytest.raises(DistributedCellError, match="boom again"):
            ip.run_cell_magic("distributed", "--profile", "raise RuntimeError('boom again')")
    finally:
        magics._CURRENT = None
    _no_profiler_running(cluster2)


def test_magic_profile_option(cluster2, ip, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cell = f"open({str(marker)!r} + str(rank), 'w').close()\nimport torch.distributed as dist\ndist.barrier()"
    magics._CURRENT = cluster2
    try:
        for line, message in [(f"--profile {tmp_path}/missing/t.json", "does not exist"),
                              (f"--profile {tmp_path}", "is a folder")]:
            with pytest.raises(UsageError, match=message):
                ip.run_cell_magic("distributed", line, cell)
        assert not list(tmp_path.glob("ran*")), "the cell ran despite a bad --profile PATH"
        report = ip.run_cell_magic("distributed", f"--profile {tmp_path}/t.json --ranks 0,1", cell)
        assert report is cluster2.last_profile and report.timeline.ranks == [0, 1]
        assert (tmp_path / "t.json").exists() and len(list(tmp_path.glob("ran*"))) == 2
        assert ip.run_cell_magic("distributed", "--profile", "dist.barrier()").trace_path is None
        assert ip.run_cell_magic("distributed", "", "dist.barrier()") is None
    finally:
        magics._CURRENT = None


def test_nbdist_profile_in_rank_code(cluster2, tmp_path: Path) -> None:
    cell = (f"import nbdist, torch.distributed as dist\n"
            f"with nbdist.profile({str(tmp_path / 'own_{rank}.json')!r}):\n"
            f"    dist.all_reduce(torch.ones(4))\n")
    cluster2.run(cell).raise_for_errors()
    for rank in (0, 1):
        own = json.loads((tmp_path / f"own_{rank}.json").read_text())["traceEvents"]
        assert {e["pid"] for e in own if e.get("name") == "process_name"} == {rank}
    report = cluster2.collect_profile(path=str(tmp_path / "merged.json"))
    assert [c.name for c in report.timeline.collectives] == ["all_reduce"]
    assert sorted(report.timeline.collectives[0].arrivals) == [0, 1]


def test_nbdist_profile_outside_nbdist_writes_that_ranks_trace(tmp_path: Path) -> None:
    code = ("import torch, nbdist\n"
            f"with nbdist.profile({str(tmp_path / 'plain.json')!r}):\n"
            "    torch.ones(64) @ torch.ones(64)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path,
                   env={"RANK": "3", "PATH": "/usr/bin:/bin"})
    events = json.loads((tmp_path / "plain.rank3.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::dot" for e in events)
    assert {e["pid"] for e in events} == {3}


def test_a_host_whose_clock_is_off_is_lined_up_by_the_collectives_ends() -> None:
    """Rank 1 on another host whose clock runs 5 ms ahead: without alignment rank 0 would seem to
    wait 5 ms longer at each all_reduce; the ends of 3 all_reduces give the offset back."""
    skew = 5000.0
    rank0, rank1 = [], []
    for step in range(3):
        base = step * 20_000.0
        rank0 += _explicit(base + 1000, base + 9000)
        rank1 += [{**e, "ts": e["ts"] + skew} for e in _explicit(base + 8000, base + 9000)]
    captures = [_capture(0, rank0, end=60_000),
                {**_capture(1, rank1, start=skew, end=60_000 + skew), "host": "other"}]
    report = build_report(captures)
    assert report.timeline.clock_offsets == {"other": pytest.approx(skew)}
    assert [c.waits[0] for c in report.timeline.collectives] == pytest.approx([7000.0] * 3)
    assert "clock of other moved by -5.00 ms" in report.table()


def test_a_rank_that_dies_mid_cell_is_named_missing(cluster_factory) -> None:
    cluster = cluster_factory(2)
    started = time.monotonic()
    result = cluster.run("import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(0.3)",
                         profile=True)
    took = time.monotonic() - started
    assert 1 in result.errors and 0 not in result.errors
    report = cluster.last_profile
    assert report.timeline.ranks == [0] and "exited with code 3" in report.missing[1], report.table()
    assert "rank 1: no profile" in report.table()
    assert took < 15, f"a dead rank held the profile collection up for {took:.1f} s"


def test_an_nccl_collective_arrives_when_its_kernel_starts() -> None:
    """On a GPU the CPU only queues the all-reduce: the rank arrives when the NCCL kernel starts
    on its stream (after the kernels queued before it), and the collective ends with it."""
    def kernel(name: str, ts: float, dur: float) -> dict:
        return {"name": name, "ts": ts, "dur": dur, "tid": "cuda 0:7", "cat": "kernel", "top": False}

    rank0 = [_event("c10d::allreduce_", 100, 20), _event("nccl:all_reduce", 105, 10, top=False),
             kernel("gemm", 50, 3000), kernel("ncclDevKernel_AllReduce_Sum_f32", 3050, 2000)]
    rank1 = [_event("c10d::allreduce_", 4000, 20), _event("nccl:all_reduce", 4005, 10, top=False),
             kernel("ncclDevKernel_AllReduce_Sum_f32", 4030, 1020)]
    (collective,) = build_timeline([_capture(0, rank0, end=6000),
                                    _capture(1, rank1, end=6000)]).collectives
    assert collective.arrivals == {0: 3050, 1: 4030} and collective.ends == {0: 5050, 1: 5050}
    assert collective.waits == {0: 980, 1: 0}
