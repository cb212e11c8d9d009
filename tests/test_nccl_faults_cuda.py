"""NCCL's silent failures on one GPU (marked ``gpu``; skipped without CUDA), each in an NCCL world
of one rank: a collective the watchdog times out fails its cell with the collective named and no
value; NCCL's own flight recorder is read; an abort is bounded and the re-formed group works,
its DDP model wrapped again; the stop button during a long GPU sync waits for the GPU instead of
aborting the group or killing the engine. The CPU logic: tests/test_nccl_faults.py.

    .venv/bin/python -m pytest -q -m gpu tests/test_nccl_faults_cuda.py
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from nbdist import Cluster
from nbdist.cells.survivors import after_reform
from nbdist.dashboard.widget import Dashboard

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")

# `cycles(s)`: how many cycles `torch.cuda._sleep` spins for about `s` seconds on this GPU
CALIBRATE = """
def cycles(seconds):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); torch.cuda._sleep(10**8); end.record(); end.synchronize()
    return int(10**8 * seconds * 1000 / start.elapsed_time(end))
"""
ALL_REDUCE = "t = torch.ones(1, device=device) * 5\ndist.all_reduce(t)\nfloat(t)"


@pytest.fixture(scope="module")  # one cluster for the module: each test leaves it working
def nccl1(fast_config):
    cluster = Cluster(n=1, backend="nccl",
                      config=fast_config.replace(nccl_process_group_timeout=3.0)).start()
    try:
        assert cluster.backend == "nccl"
        cluster.run(CALIBRATE).raise_for_errors()
        yield cluster
    finally:
        cluster.stop()


def test_a_timed_out_nccl_collective_fails_its_cell_naming_it(nccl1: Cluster):
    # the all_reduce waits 8 s behind the sleep: the watchdog times it out at 3 s, aborts the
    # communicators 4 x 2 s later and raises in no thread; `.item()` returns once the GPU is done
    code = ("t = torch.ones(4, device=device)\ntorch.cuda._sleep(cycles(8))\n"
            "dist.all_reduce(t)\nt.sum().item()\n")
    result = nccl1.run(code, timeout=120)
    error = result.errors[0]
    assert error.ename == "NCCLCollectiveFailed", result.failure_message()
    assert error.evalue.startswith("all_reduce #") and "of the default group timed out" in \
        error.evalue, error.evalue
    assert 0 not in result.results  # never a value computed from it
    assert any("rebuilt" in a for a in result.actions), result.actions
    assert nccl1.run(ALL_REDUCE, timeout=60).raise_for_errors().value_text(0) == "5.0"


def test_nccl_entries_come_from_nccl_s_own_flight_recorder(nccl1: Cluster):
    nccl1.run("t = torch.ones(16, device=device)\ndist.all_reduce(t)\n"
              "c = torch.ones(3)\ndist.all_reduce(c)\ntorch.cuda.synchronize()\n",
              timeout=60).raise_for_errors()
    entries = nccl1.call("collectives.recent", 8, timeout=30).results[0]
    on_gpu = [e for e in entries if e.group == "default group" and e.sizes == ((16,),)]
    assert on_gpu and on_gpu[-1].op == "all_reduce" and on_gpu[-1].completed, entries
    on_cpu = [e for e in entries if e.group == "default group (CPU tensors)"]
    assert on_cpu and on_cpu[-1].sizes == ((3,),), entries


def test_abort_is_bounded_and_the_reformed_group_trains_on(nccl1: Cluster):
    nccl1.run("import nbdist\nmodel, opt = nbdist.prepare(torch.nn.Linear(8, 8, device=device),"
              " lambda p: torch.optim.SGD(p, lr=0.1))\n").raise_for_errors()
    grace = nccl1.config.faults.teardown_grace
    started = time.perf_counter()
    assert nccl1.teardown_process_group([0], timeout=grace + 5) == [0]
    assert time.perf_counter() - started < grace + 5
    nccl1.rebuild_process_group()
    said = after_reform(nccl1)
    assert "DDP model(s) model wrapped again on the new group" in said, said
    step = nccl1.run("loss = model(torch.ones(2, 8, device=device)).sum()\nloss.backward()\n"
                     "opt.step()\n" + ALL_REDUCE, timeout=60)
    assert step.raise_for_errors().value_text(0) == "5.0"


def test_the_stop_button_during_a_long_gpu_sync_waits_for_the_gpu(nccl1: Cluster):
    pids, generation = [p.pid for p in nccl1.ranks], nccl1.generation
    code = ("torch.cuda._sleep(cycles(8))\nx = torch.ones(1, device=device)\nx.item()\n")
    timer = threading.Timer(1.5, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        result = nccl1.run(code, timeout=120)
    finally:
        timer.cancel()
    assert result.interrupted and result.errors[0].kind == "interrupted", result.failure_message()
    assert any("wait on the GPU, not on a peer" in a for a in result.actions), result.actions
    assert not any("killed" in a or "made it fail" in a or "tore down" in a
                   for a in result.actions), result.actions
    assert [p.pid for p in nccl1.ranks] == pids and nccl1.generation == generation
    assert nccl1.run(ALL_REDUCE, timeout=60).raise_for_errors().value_text(0) == "5.0"


class TimingSeen:
    """Every "timing" record of collectives the ranks send."""

    def __init__(self) -> None:
        self.collectives: list[tuple] = []

    def on_telemetry(self, rank: int, payload: dict) -> None:
        self.collectives += [(rank, *c) for c in (payload.get("timing") or {}).get(
            "collectives", [])]

    def on_rank_state(self, rank: int, state: str, detail: str) -> None:
        pass


def test_an_nccl_collective_is_timed_from_its_cuda_events(nccl1: Cluster):
    seen = TimingSeen()
    nccl1.telemetry.subscribe(seen)
    try:
        # each record is read at the next collective (on the main thread, never the telemetry's)
        nccl1.run("t = torch.ones(4, device=device)\nfor _ in range(4):\n"
                  "    dist.all_reduce(t)\n    torch.cuda.synchronize()\n"
                  "import time\ntime.sleep(1.0)\n", timeout=60).raise_for_errors()
    finally:
        nccl1.telemetry.unsubscribe(seen)
    timed = [c for c in seen.collectives if c[4] == "all_reduce"]
    assert len(timed) >= 3 and all(0.0 <= c[5] < 1.0 for c in timed), seen.collectives


@needs_two
def test_a_rank_late_on_its_gpu_is_named_the_straggler(fast_config):
    # rank 1's GPU runs 0.2 s longer each step; its Python returns at once, so only the CUDA
    # events of the all-reduce show that rank 0 waits for it
    cluster = Cluster(n=2, backend="nccl", config=fast_config).start()
    dashboard = Dashboard(cluster.world_size)
    cluster.telemetry.subscribe(dashboard)
    try:
        cluster.run(CALIBRATE).raise_for_errors()
        cluster.run(
            "import nbdist\nt = torch.ones(1024, device=device)\nlate = cycles(0.2)\n"
            "for step in range(16):\n    if rank == 1:\n        torch.cuda._sleep(late)\n"
            "    dist.all_reduce(t)\n    torch.cuda.synchronize()\n    nbdist.log(step=step)\n",
            timeout=120).raise_for_errors()
    finally:
        cluster.telemetry.unsubscribe(dashboard)
        dashboard.close()
        cluster.stop()
    assert dashboard.view["stragglers"]["flagged"] == 1, dashboard.view.get("stragglers")
