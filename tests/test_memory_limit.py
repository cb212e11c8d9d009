"""`--memory-limit` / `Cluster(memory_limit=...)`: a real per-rank budget (RLIMIT_DATA on CPU, a
CUDA memory fraction on GPU), applied inside each rank only; a rank that exceeds it is named with
the limit, its peers are released, and the next collective (or %dist_restart) works."""

from __future__ import annotations

import resource

import psutil
import pytest
import torch
from IPython.core.error import UsageError

from nbdist import Cluster
from nbdist.cells.out_of_memory import is_out_of_memory
from nbdist.cells.result import RankError
from nbdist.config import memory_limit_bytes
from nbdist.errors import DistributedCellError, NbdistError
from nbdist.notebook import magics

LIMIT = 256 * 2**20
ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
READ_BACK = (
    "import resource\n"
    "from nbdist.worker.rank_memory import STATE\n"
    "(resource.getrlimit(resource.RLIMIT_DATA)[0], STATE['baseline'], STATE['limit'])"
)
# a real allocation failure that kills the process: operator new throws std::bad_alloc through
# ctypes' C frames, nothing catches it, and the C++ runtime aborts (as in a C++ thread of torch)
BAD_ALLOC_KILL = (
    "import ctypes\n"
    "if rank == 1:\n"
    "    ctypes.CDLL('libstdc++.so.6')._Znwm(ctypes.c_size_t(2 * {limit}))\n"
    "dist.barrier()\n"
)


def _data_limit(pid: int) -> str:
    """The soft 'Max data size' of a process, as /proc/<pid>/limits shows it."""
    with open(f"/proc/{pid}/limits") as limits:
        line = next(ln for ln in limits if ln.startswith("Max data size"))
    return line.split()[3]


def _collective_works(cluster: Cluster) -> None:
    result = cluster.run(ALL_REDUCE, timeout=30).raise_for_errors()
    assert result.grouped_values() == [([0, 1], "2.0")]


# --- the option, checked before anything starts -------------------------------------------------

@pytest.mark.parametrize("value,size", [
    (LIMIT, LIMIT), ("512MiB", 512 * 2**20), ("1GiB", 2**30), ("2GB", 2 * 10**9),
    ("1.5 GiB", 3 * 2**29), ("300mb", 300 * 10**6), (None, None),
])
def test_sizes_are_read_as_bytes(value, size):
    assert memory_limit_bytes(value) == size


@pytest.mark.parametrize("value,message", [
    ("1 GiBs", "not a size"), ("lots", "not a size"), ("-1GiB", "not a size"), (0, "at least"),
    ("1MiB", "at least 64.0 MiB"), (True, "give a size"), (1.5e9, "give a size"),
])
def test_bad_sizes_are_refused_before_anything_starts(value, message):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(NbdistError, match=message):
        Cluster(n=2, memory_limit=value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_an_oom_is_told_from_other_errors():
    oom = RankError(rank=1, kind="root", ename="RuntimeError",
                    evalue="DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes")
    assert is_out_of_memory(oom)
    assert is_out_of_memory(RankError(rank=0, kind="root", ename="MemoryError"))
    assert is_out_of_memory(RankError(rank=0, kind="root", ename="OutOfMemoryError",
                                      evalue="CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RankError(rank=0, kind="root", ename="ValueError", evalue="bad"))
    dead = RankError(rank=1, kind="dead", ename="RankDied", evalue="signal 6 (SIGABRT)")
    assert not is_out_of_memory(dead, "Fatal Python error: Aborted")
    assert is_out_of_memory(dead, "terminate called after throwing an instance of 'std::bad_alloc'")
    assert is_out_of_memory(dead, "libgomp: Thread creation failed: Resource temporarily unavailable")


def test_intra_op_threads_are_not_charged_to_a_small_budget(fast_config, assert_all_gone):
    """OpenMP starts its threads on first use and each stack counts as data: before they were
    started ahead of the limit, a first parallel op under a small budget ended the rank with
    "libgomp: Thread creation failed" (seen with 8 threads per rank on a 16-core GPU host)."""
    # 16 threads: 15 stacks of 8 MiB are more than the smallest budget
    cluster = Cluster(n=1, threads=16, config=fast_config, memory_limit="64MiB").start()
    try:
        code = "x = torch.ones(2**19)\nx.add_(1)\n(torch.get_num_threads(), float(x.sum()))"
        result = cluster.run(code, timeout=60).raise_for_errors()
        assert result.grouped_values() == [([0], "(16, 1048576.0)")]
    finally:
        assert_all_gone(cluster.stop())


# --- real ranks under a 256 MiB budget ------------------------------------------------------------

@pytest.fixture(scope="module")
def limited(fast_config, assert_all_gone):
    cluster = Cluster(n=2, config=fast_config, memory_limit="256MiB").start()
    try:
        yield cluster
    finally:
        assert_all_gone(cluster.stop())


def test_the_limit_is_applied_in_every_rank_and_nowhere_else(limited):
    values = limited.run(READ_BACK).raise_for_errors().results
    for rank in (0, 1):
        soft, baseline, limit = eval(values[rank]["data"]["text/plain"])
        assert limit == LIMIT and soft == baseline + LIMIT
        # the baseline is torch + IPython + the engine + gloo: a few hundred MiB of data mappings
        assert 50 * 2**20 < baseline < 2**30
        assert _data_limit(limited.ranks[rank].pid) == str(soft)
    # the notebook (this process), the controller and the engines' nannies are not limited
    assert resource.getrlimit(resource.RLIMIT_DATA)[0] == resource.RLIM_INFINITY
    assert _data_limit(limited._processes.controller[0]) == "unlimited"
    for proc in limited.ranks:
        assert _data_limit(psutil.Process(proc.pid).ppid()) == "unlimited"


@pytest.mark.parametrize("allocation,ename", [
    ("torch.empty(2 * {limit}, dtype=torch.uint8)", "RuntimeError"),  # DefaultCPUAllocator
    ("bytearray(2 * {limit})", "MemoryError"),
])
def test_a_rank_over_its_limit_is_named_and_its_peer_released(limited, allocation, ename):
    code = f"if rank == 1:\n    big = {allocation.format(limit=LIMIT)}\ndist.all_reduce(torch.ones(1))\n"
    result = limited.run(code, timeout=60)
    roots = result.root_causes()
    assert [e.rank for e in roots] == [1] and roots[0].ename == ename
    headline = roots[0].headline()
    assert headline.startswith("rank 1 ran out of memory: it is limited to 256 MiB by --memory-limit")
    assert result.errors[0].kind == "collective"  # rank 0 was released from its all_reduce
    message = result.failure_message()
    assert "rank 1 ran out of memory" in message and "--memory-limit" in message
    assert all(p.state == "alive" for p in limited.ranks)
    _collective_works(limited)


def test_a_model_that_fits_trains_normally(limited):
    # 1M parameters: 16 MiB of fp32 params, grads and AdamW state, far inside 256 MiB
    code = (
        "import nbdist\nfrom torch import nn\n"
        "torch.manual_seed(0)\n"
        "p = nbdist.prepare(nn.Linear(1024, 1024), lambda ps: torch.optim.AdamW(ps), strategy='ddp')\n"
        "for _ in range(3):\n"
        "    p.backward(p.model(torch.randn(16, 1024)).pow(2).mean())\n"
        "    p.optimizer.step()\n"
        "    p.optimizer.zero_grad()\n"
        "from nbdist.worker.rank_memory import memory_budget\n"
        "memory_budget()['in_use'] < memory_budget()['limit']\n"
    )
    result = limited.run(code, timeout=120).raise_for_errors()
    assert [text for _ranks, text in result.grouped_values()] == ["True"]


def test_a_rank_killed_by_a_failed_allocation_is_named_and_restart_keeps_the_limit(limited):
    old_pids = {p.pid for p in limited.ranks}
    result = limited.run(BAD_ALLOC_KILL.format(limit=LIMIT), timeout=60)
    err = result.errors[1]
    assert err.kind == "dead" and "SIGABRT" in err.evalue
    assert err.headline().startswith("rank 1 ran out of memory: it is limited to 256 MiB")
    assert "std::bad_alloc" in err.traceback
    assert any("%dist_restart" in action for action in result.actions)
    limited.restart()
    assert not old_pids & {p.pid for p in limited.ranks}
    values = limited.run(READ_BACK).raise_for_errors().results
    assert all(eval(values[r]["data"]["text/plain"])[2] == LIMIT for r in (0, 1))
    _collective_works(limited)


# --- through the magic --------------------------------------------------------------------------

def test_the_magic_refuses_a_bad_size(ip):
    with pytest.raises(UsageError, match="--memory-limit.*not a size"):
        ip.run_line_magic("dist_start", "-n 2 --memory-limit lots")
    assert magics.current_cluster() is None or not magics.current_cluster().running


def test_the_magic_limits_ranks_reports_oom_and_restarts(ip, capsys):
    marker = object()
    ip.user_ns["notebook_marker"] = marker
    ip.run_line_magic("dist_start", "-n 2 --memory-limit 256MiB")
    code = f"if rank == 1:\n    big = torch.empty(2 * {LIMIT}, dtype=torch.uint8)\ndist.barrier()\n"
    with pytest.raises(DistributedCellError) as raised:
        ip.run_cell_magic("distributed", "", code)
    assert "rank 1 ran out of memory: it is limited to 256 MiB by --memory-limit" in str(raised.value)
    assert ip.user_ns["notebook_marker"] is marker  # the kernel and its namespace are untouched
    ip.run_line_magic("dist_restart", "")
    ip.run_cell_magic("distributed", "", READ_BACK)
    ip.run_cell_magic("distributed", "", ALL_REDUCE)
    out = capsys.readouterr().out
    assert "2.0" in out and str(LIMIT) in out
    assert resource.getrlimit(resource.RLIMIT_DATA)[0] == resource.RLIM_INFINITY


# --- GPU: the same option caps torch's CUDA allocator --------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_the_limit_caps_cuda_memory(fast_config, assert_all_gone):
    cluster = Cluster(n=1, config=fast_config, memory_limit="1GiB").start()
    try:
        read = "from nbdist.worker.rank_memory import STATE\nSTATE['mechanism'], STATE['limit']"
        values = cluster.run(read).raise_for_errors().results
        assert eval(values[0]["data"]["text/plain"]) == ("cuda memory fraction", 2**30)
        result = cluster.run("big = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)")
        err = result.root_causes()[0]
        assert err.headline().startswith("rank 0 ran out of memory: it is limited to 1.00 GiB")
        cluster.run("ok = torch.empty(2**28, dtype=torch.uint8, device=device)").raise_for_errors()
    finally:
        assert_all_gone(cluster.stop())
