"""--share-gpu: ranks that outnumber the GPUs share them, NCCL between them, each rank its own
NCCL host (docs/NCCL.md). The rank map, the environment each rank gets and the error without a
GPU run here; the NCCL worlds of 2 and 4 ranks on one GPU are the ``gpu`` tests below.

    .venv/bin/python -m pytest -q tests/test_share_gpu.py           # CPU
    .venv/bin/python -m pytest -q -m gpu tests/test_share_gpu.py    # on a GPU
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from IPython.core.error import UsageError

from nbdist import Cluster
from nbdist.cluster.arguments import SHARE_GPU_VARIABLE, share_gpu_chosen
from nbdist.cluster.rank_setup import local_gpu_count, require_gpu_to_share, sharing_note
from nbdist.cluster.ranks import EngineInfo, build_rank_map, choose_backend
from nbdist.errors import ClusterStartError, NbdistError
from nbdist.notebook import magics
from nbdist.notebook.options import start_config
from nbdist.worker.pinning import (
    device_index_hint,
    local_rank_notes,
    shared_gpu_environment,
    socket_interfaces,
)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
no_gpu_here = pytest.mark.skipif(local_gpu_count() != 0, reason="this machine has a GPU")


def _engines(n: int, gpus: int, host: str = "h") -> list[EngineInfo]:
    return [EngineInfo(i, host, i, gpu_count=gpus) for i in range(n)]


def test_ranks_beyond_the_gpus_share_them_round_robin():
    one_gpu = build_rank_map(_engines(2, 1), "nccl", share_gpu=True)
    assert [(s.local_rank, s.device, s.shares_gpu) for s in one_gpu] == [
        (0, "cuda:0", True), (1, "cuda:0", True)]
    three_on_two = build_rank_map(_engines(3, 2), "nccl", share_gpu=True)
    assert [(s.gpus, s.shares_gpu) for s in three_on_two] == [
        ((0,), True), ((1,), False), ((0,), True)]
    # enough GPUs: each rank its own, as without the flag (and NCCL's own transports)
    fits = build_rank_map(_engines(2, 2), "nccl", share_gpu=True)
    assert [(s.gpus, s.shares_gpu) for s in fits] == [((0,), False), ((1,), False)]
    # a rank of two GPUs on a one-GPU host computes twice on cuda:0, alone there
    two_per_rank = build_rank_map(_engines(1, 1), "nccl", gpus_per_rank=2, share_gpu=True)
    assert [(s.gpus, s.shares_gpu) for s in two_per_rank] == [((0, 0), False)]
    with pytest.raises(NbdistError, match=r"needs 2 GPUs, but 1 are visible.*--share-gpu"):
        build_rank_map(_engines(2, 1), "nccl")


def test_sharing_ranks_are_nccl_said_once_and_need_a_gpu_on_every_host():
    specs = build_rank_map(_engines(4, 1), choose_backend("auto", [1] * 4, 1), share_gpu=True)
    assert {s.backend for s in specs} == {"nccl"} and {s.device for s in specs} == {"cuda:0"}
    assert sharing_note(specs) == ("4 ranks share cuda:0 (--share-gpu), NCCL between them over "
                                   "loopback sockets: for learning and testing, not speed")
    assert sharing_note(build_rank_map(_engines(2, 2), "nccl", share_gpu=True)) is None
    require_gpu_to_share({"a": 1, "b": 2})
    with pytest.raises(ClusterStartError, match="--share-gpu .* and b has none that CUDA sees"):
        require_gpu_to_share({"a": 1, "b": 0})


def test_each_sharing_rank_is_an_nccl_host_of_its_own():
    ranks = build_rank_map(_engines(2, 1), "nccl", share_gpu=True)
    envs = [shared_gpu_environment(s, {}, "box", "boot-1")[0] for s in ranks]
    assert [e["NCCL_HOSTID"] for e in envs] == ["boxboot-1.nbdist-rank0", "boxboot-1.nbdist-rank1"]
    assert all(e["NCCL_NET"] == "Socket" for e in envs)
    assert {s.device for s in ranks} == {"cuda:0"}  # the same device index on every rank
    # a site's own host id (containers that share a hostname) stays, made per rank
    site = {"NCCL_HOSTID": "node7", "NCCL_NET": "IB"}
    wanted, notes = shared_gpu_environment(ranks[1], site, "box", "boot-1")
    assert wanted == {"NCCL_HOSTID": "node7.nbdist-rank1"}
    assert notes == ["NCCL_NET=IB is yours and kept (ranks sharing a GPU would use Socket: see "
                     "docs/NCCL.md)"]


def test_local_rank_that_is_not_the_gpu_index_is_said():
    shared = build_rank_map(_engines(2, 1), "nccl", share_gpu=True)
    assert local_rank_notes(shared[0]) == []
    assert "torch.cuda.set_device(LOCAL_RANK)" in local_rank_notes(shared[1])[0]
    assert local_rank_notes(build_rank_map(_engines(2, 2), "nccl")[1]) == []
    on_rank1 = {"NBDIST_DEVICE": "cuda:0", "LOCAL_RANK": "1"}
    error = "CUDA error: invalid device ordinal\nCUDA kernel errors might be ..."
    hint = device_index_hint(error, on_rank1)
    assert hint is not None and "computes on cuda:0" in hint and "LOCAL_RANK is 1" in hint
    assert device_index_hint(error, {"NBDIST_DEVICE": "cuda:1", "LOCAL_RANK": "1"}) is None
    assert device_index_hint("out of memory", on_rank1) is None


def test_a_sites_socket_interface_is_kept():
    wanted, notes = socket_interfaces({"NCCL_SOCKET_IFNAME": "ib0"}, "eth0")
    assert wanted == {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}
    assert notes == ["NCCL_SOCKET_IFNAME=ib0 is yours and kept (nbdist would set eth0: see "
                     "docs/MULTI_NODE.md)"]
    assert socket_interfaces({"GLOO_SOCKET_IFNAME": "lo"}, "lo")[1] == []


def test_the_default_comes_from_the_notebooks_environment(monkeypatch):
    monkeypatch.delenv(SHARE_GPU_VARIABLE, raising=False)
    assert share_gpu_chosen(None) is False and share_gpu_chosen(True) is True
    monkeypatch.setenv(SHARE_GPU_VARIABLE, "1")
    assert share_gpu_chosen(None) is True and share_gpu_chosen(False) is False
    assert start_config(None, False).start.share_gpu is None  # left to the variable
    assert start_config(None, False, share_gpu=True).start.share_gpu is True
    with pytest.raises(NbdistError, match="share_gpu 'yes': must be True or False"):
        Cluster(n=2, share_gpu="yes")


def _start_fails_at_once(start) -> str:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.perf_counter()
    with pytest.raises((NbdistError, UsageError)) as failure:
        start()
    assert time.perf_counter() - started < 15  # nvidia-smi at most: no engine was waited for
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    return str(failure.value)


@no_gpu_here
def test_without_a_gpu_share_gpu_is_one_clear_error_before_any_engine(ip, monkeypatch):
    message = _start_fails_at_once(lambda: Cluster(n=2, share_gpu=True).start())
    assert message == ("--share-gpu (share_gpu=True) puts the ranks on a GPU, and this machine "
                       "has none that CUDA sees: start without it for CPU ranks (gloo).")
    message = _start_fails_at_once(lambda: ip.run_line_magic("dist_start", "-n 2 --share-gpu"))
    assert message.startswith("%dist_start failed: --share-gpu (share_gpu=True) puts the ranks")
    assert magics.current_cluster() is None
    monkeypatch.setenv(SHARE_GPU_VARIABLE, "1")  # .ci/gpu-check's way, here without a GPU
    assert "--share-gpu" in _start_fails_at_once(lambda: Cluster(n=2).start())


def test_a_kernel_started_with_the_variable_shares_by_default():
    code = ("from nbdist import Cluster\nfrom nbdist.notebook.options import start_config\n"
            "print(Cluster(n=2).share_gpu, Cluster(n=2, share_gpu=False).share_gpu, "
            "Cluster(n=2, config=start_config(None, False)).share_gpu)")
    env = {**os.environ, SHARE_GPU_VARIABLE: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["True", "False", "True"]


# ---- on a GPU: NCCL worlds that share one ---------------------------------------------------

# the engines see one GPU whatever the machine has: the ranks share it on a multi-GPU host too
ONE_GPU = {"environment": {"CUDA_VISIBLE_DEVICES": os.environ.get(
    "CUDA_VISIBLE_DEVICES", "0").split(",")[0]}}
CHECK = ("import os\nt = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(t)\n"
         "(float(t), str(t.device), dist.get_backend(), os.environ['NCCL_HOSTID'], "
         "os.environ['LOCAL_RANK'], type(dist.group.WORLD._get_backend(t.device)).__name__)")


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [2, 4])
def test_ranks_sharing_one_gpu_all_reduce_over_nccl(n, fast_config, capsys):
    from nbdist.worker.process_group import torch_backend

    cluster = Cluster(n=n, share_gpu=True, config=fast_config,
                      launcher_options=ONE_GPU).start(progress=print)
    try:
        assert "for learning and testing, not speed" in capsys.readouterr().out
        assert cluster.backend == "nccl" and {p.device for p in cluster.ranks} == {"cuda:0"}
        result = cluster.run(CHECK, timeout=300).raise_for_errors()
        values = [eval(result.value_text(r)) for r in range(n)]  # noqa: S307 (our own repr)
        total = float(n * (n + 1) // 2)
        assert {v[:3] for v in values} == {(total, "cuda:0", torch_backend("nccl"))}
        assert len({v[3] for v in values}) == n  # a host of its own each
        assert [v[4] for v in values] == [str(r) for r in range(n)]
        assert {v[5] for v in values} == {"ProcessGroupNCCL"}  # what a CUDA tensor's goes to
        for hook in ("dist.barrier()", "dist.broadcast(torch.ones(3, device=device), 0)"):
            cluster.run(hook, timeout=120).raise_for_errors()
        # rank 1's LOCAL_RANK is no GPU here: said at start, and torch's error says which is
        assert any("torch.cuda.set_device(LOCAL_RANK)" in note for note in cluster.ranks[1].notes)
        wrong = cluster.run("torch.cuda.set_device(int(os.environ['LOCAL_RANK']))", ranks=[1],
                            timeout=60)
        assert "this rank computes on cuda:0" in wrong.errors[1].traceback, wrong.failure_message()
        cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)", timeout=120)
    finally:
        cluster.stop()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")
def test_sharing_ranks_memory_limit_is_per_rank_and_nvml_names_each_process(fast_config):
    cluster = Cluster(n=2, share_gpu=True, memory_limit="1GiB", config=fast_config,
                      launcher_options=ONE_GPU).start()
    try:
        fits = "x = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)\nint(x.numel())"
        cluster.run(fits, timeout=120).raise_for_errors()  # 0.5 GiB each, 1 GiB on the GPU
        over = cluster.run("y = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)",
                           ranks=[1], timeout=120)
        assert over.errors[1].headline().startswith(
            "rank 1 ran out of memory: it is limited to 1.00 GiB"), over.failure_message()
        pytest.importorskip("pynvml")
        sample = ("import os, threading, pynvml\n"
                  "from nbdist.worker.rank_memory import MemorySampler, _open_nvml\n"
                  "s = MemorySampler(device)\nout = {}\n"
                  "t = threading.Thread(target=lambda: out.update(s.sample(0)))\n"
                  "t.start(); t.join()\nnvml, handle = _open_nvml(device)\n"
                  "listed = os.getpid() in [p.pid for p in "
                  "nvml.nvmlDeviceGetComputeRunningProcesses(handle)]\n"
                  "(listed, (out.get('nvml_process') or 0) > 512 * 2**20)")
        seen = cluster.run(sample, timeout=120).raise_for_errors().grouped_values()
        if seen == [([0, 1], "(False, False)")]:
            pytest.skip("NVML lists these processes under other PIDs (a PID namespace)")
        assert seen == [([0, 1], "(True, True)")]  # each rank's own, its 0.5 GiB in it
    finally:
        cluster.stop()
