"""NCCL faults on a GPU (marked ``gpu``; two ranks on two GPUs, or both sharing a machine's one):
the flight recorder's report of a collective one rank skips, the dump on timeout in the rank's
private directory, and engines (with a model on every rank) that outlive a collective timeout
and an interrupted kernel.

    .venv/bin/python -m pytest -q -m gpu tests/test_flight_recorder_cuda.py
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from nbdist import Cluster
from tests.gpu_ranks import two_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]

MODEL = ("net = torch.nn.Linear(64, 64, device=device)\n"
         "with torch.no_grad():\n    net.weight.fill_(rank + 1)\n")
WEIGHT = "float(net.weight[0, 0])"


def assert_model_kept_and_group_works(cluster: Cluster, pids: list[int]) -> None:
    assert [p.pid for p in cluster.ranks] == pids
    assert all(p.state == "alive" for p in cluster.ranks)
    kept = cluster.run(WEIGHT, timeout=60).raise_for_errors()
    assert kept.grouped_values() == [([0], "1.0"), ([1], "2.0")]
    check = cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)\nfloat(t)",
                        timeout=120)
    if not check.ok:  # an aborted group fails its next collective once; nbdist rebuilds it
        check = cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)\nfloat(t)",
                            timeout=120)
    assert check.raise_for_errors().grouped_values() == [([0, 1], "2.0")]


@pytest.fixture
def nccl2(fast_config):
    cluster = two_ranks(fast_config.replace(nccl_process_group_timeout=5.0))
    try:
        cluster.run(MODEL).raise_for_errors()
        yield cluster
    finally:
        cluster.stop()


def test_an_nccl_collective_one_rank_skips_is_named_and_released(nccl2: Cluster):
    pids = [p.pid for p in nccl2.ranks]
    code = ("t = torch.ones(256, device=device)\nif rank == 0:\n    dist.all_reduce(t)\n"
            "    torch.cuda.synchronize()\n")
    started = time.perf_counter()
    result = nccl2.run(code, timeout=3)
    assert result.timed_out and time.perf_counter() - started < 3 + 15
    first = result.report[0]
    assert first.startswith("rank 0 waits in all_reduce #"), result.report
    assert "[256] Float" in first and "rank 1 never entered it: it finished the cell" in first
    assert not any("killed" in a for a in result.actions), result.actions
    assert_model_kept_and_group_works(nccl2, pids)


def test_a_timed_out_nccl_collective_raises_in_the_cell_and_dumps_privately(nccl2: Cluster):
    # the watchdog (5 s timeout) aborts the group 4 x 2 s later and raises nothing: rank 0's
    # synchronize() returns, and nbdist fails its cell from the group's error state, then
    # interrupts rank 1, still running, as after any fault
    pids = [p.pid for p in nccl2.ranks]
    code = ("import time\nt = torch.ones(8, device=device)\nif rank == 0:\n"
            "    dist.all_reduce(t)\n    torch.cuda.synchronize()\nelse:\n    time.sleep(30)\n")
    started = time.perf_counter()
    result = nccl2.run(code, timeout=120)
    elapsed = time.perf_counter() - started
    assert 0 in result.errors and elapsed < 5 + 8 + 12, (elapsed, result.failure_message())
    assert result.errors[0].ename == "NCCLCollectiveFailed", result.failure_message()
    assert "timed out" in result.errors[0].evalue and 0 not in result.results
    dump = nccl2.run("import glob, os\nprefix = os.environ['TORCH_FR_DUMP_TEMP_FILE']\n"
                     "(oct(os.stat(os.path.dirname(prefix)).st_mode & 0o777), "
                     "sorted(os.path.basename(f) for f in glob.glob(prefix + '*')))",
                     ranks=[0], timeout=30).raise_for_errors()
    assert dump.value_text(0) == "('0o700', ['nccl_trace_rank_0'])", dump.value_text(0)
    assert_model_kept_and_group_works(nccl2, pids)


def test_an_interrupt_during_a_cuda_kernel_keeps_the_engine_and_the_models(nccl2: Cluster):
    pids = [p.pid for p in nccl2.ranks]
    code = ("a = torch.randn(4096, 4096, device=device)\nif rank == 0:\n"
            "    while True:\n        a = a @ a\n        a = a / a.norm()\n")
    timer = threading.Timer(2.0, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        result = nccl2.run(code, timeout=120)
    finally:
        timer.cancel()
    assert result.interrupted and result.errors[0].kind == "interrupted"
    assert result.errors[0].where.startswith("cell line"), result.errors[0].where
    assert_model_kept_and_group_works(nccl2, pids)
