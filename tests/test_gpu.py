"""GPU checks (marked ``gpu``; skipped without CUDA): NCCL process group, device pinning, the memory
sampler against torch.cuda and NVML, fault rows on NCCL, DeepSpeed on GPU.

    .venv/bin/python -m pytest -q -m gpu tests/test_gpu.py

Rows that need two ranks run on two GPUs, or on a one-GPU machine as two ranks sharing it
(--share-gpu, tests/gpu_ranks.py); the other rows run one rank per GPU.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import pytest
import torch

from nbdist import Cluster
from tests.gpu_ranks import at_least_two

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def gpu_cluster(fast_config):
    cluster = Cluster(config=fast_config).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def nccl_pair(gpu_cluster: Cluster, fast_config):
    yield from at_least_two(gpu_cluster, fast_config)


def test_nccl_group_one_rank_per_gpu_pinned(gpu_cluster: Cluster):
    assert gpu_cluster.backend == "nccl"
    assert gpu_cluster.world_size == GPUS
    result = gpu_cluster.run(
        "t = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(t)\n"
        "(str(device), torch.cuda.current_device(), str(dist.get_backend()), float(t))"
    ).raise_for_errors()
    n = GPUS
    for rank in range(n):
        device, current, backend, total = eval(result.value_text(rank))  # noqa: S307 - our own tuple
        assert device == f"cuda:{rank}" and current == rank and backend == "cpu:gloo,cuda:nccl"
        assert total == n * (n + 1) / 2


def test_sampler_matches_torch_cuda_and_nvml(gpu_cluster: Cluster):
    # the full sample (driver, NVML) is the telemetry thread's: taken on a thread here too
    code = (
        "import threading\n"
        "from nbdist.worker.rank_memory import MemorySampler\n"
        "s = MemorySampler(device)\n"
        "torch.cuda.reset_peak_memory_stats(device)  # the user's reset: nbdist never does\n"
        "s.sample(cell=1)\n"
        "big = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)\n"
        "torch.cuda.synchronize()\n"
        "box = []\n"
        "sampler_thread = threading.Thread(target=lambda: box.append(s.sample()))\n"
        "sampler_thread.start(); sampler_thread.join()\n"
        "m = box[0]\n"
        "truth = dict(allocated=torch.cuda.memory_allocated(device),\n"
        "             reserved=torch.cuda.memory_reserved(device),\n"
        "             peak=torch.cuda.max_memory_allocated(device),\n"
        "             capacity=torch.cuda.get_device_properties(device).total_memory)\n"
        "del big\n"
        "(m, truth)"
    )
    result = gpu_cluster.run(code).raise_for_errors()
    for rank in range(GPUS):
        sample, truth = gpu_cluster.pull("m")[rank], gpu_cluster.pull("truth")[rank]
        for key in ("allocated", "reserved", "peak", "capacity"):
            assert sample[key] == truth[key], (key, sample, truth)
        assert sample["allocated"] >= 256 * 2**20
        if importlib.util.find_spec("pynvml") is not None:
            # NVML sees the whole process: the CUDA context plus the caching allocator's pool
            assert sample.get("nvml_used", 0) >= truth["reserved"], sample
    assert result.ok


def test_row5_stop_button_in_a_gpu_training_loop(gpu_cluster: Cluster):
    gpu_cluster.run(
        "model = torch.nn.Linear(1024, 1024, device=device)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\nsteps = 0"
    ).raise_for_errors()
    code = (
        "while True:\n"
        "    loss = model(torch.randn(64, 1024, device=device)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    steps += 1\n"
    )
    timer = threading.Timer(1.5, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.perf_counter()
    result = gpu_cluster.run(code, timeout=60)
    elapsed = time.perf_counter() - started
    timer.join()
    assert result.interrupted and elapsed < 1.5 + 6
    assert all(v > 0 for v in gpu_cluster.pull("steps").values())
    gpu_cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)").raise_for_errors()


def test_row7_cuda_out_of_memory_is_attributed_with_numbers(gpu_cluster: Cluster):
    code = "big = torch.empty(2**50, dtype=torch.uint8, device=device)\n"
    result = gpu_cluster.run(code, timeout=60)
    roots = result.root_causes()
    assert [e.rank for e in roots] == list(range(GPUS))
    assert "OutOfMemoryError" in roots[0].ename or "out of memory" in roots[0].evalue.lower()
    gpu_cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)").raise_for_errors()


def test_row1_rank_raises_while_others_wait_nccl(nccl_pair: Cluster):
    gpu_cluster = nccl_pair
    code = "x = torch.ones(1, device=device)\nif rank == 1:\n    raise ValueError('rank 1 broke')\ndist.all_reduce(x)\n"
    started = time.perf_counter()
    result = gpu_cluster.run(code, timeout=60)
    assert time.perf_counter() - started < 10
    assert [e.rank for e in result.root_causes()] == [1]
    if any(p.state != "alive" for p in gpu_cluster.ranks) or any("restart" in a for a in result.actions):
        gpu_cluster.restart()
    gpu_cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)").raise_for_errors()


def test_row6_stop_while_inside_an_nccl_collective(nccl_pair: Cluster):
    gpu_cluster = nccl_pair
    code = "import time\nif rank == 1:\n    time.sleep(600)\nt = torch.ones(1, device=device)\ndist.all_reduce(t)\ntorch.cuda.synchronize()\n"
    timer = threading.Timer(1.5, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.perf_counter()
    result = gpu_cluster.run(code, timeout=120)
    timer.join()
    assert result.interrupted and time.perf_counter() - started < 1.5 + 10
    gpu_cluster.restart()
    gpu_cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)").raise_for_errors()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="pip install nbdist[deepspeed]")
def test_deepspeed_zero2_trains_on_gpu(gpu_cluster: Cluster):
    code = (
        "import nbdist\n"
        "net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))\n"
        "p = nbdist.prepare(net, lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy='deepspeed', zero_stage=2)\n"
        "x = torch.randn(8, 256, device=device)\n"
        "losses = []\n"
        "for _ in range(5):\n"
        "    loss = p.model(x).pow(2).mean()\n"
        "    p.backward(loss); p.step(); losses.append(float(loss))\n"
        "losses[-1] < losses[0]"
    )
    result = gpu_cluster.run(code, timeout=300).raise_for_errors()
    assert result.grouped_values() == [(list(range(GPUS)), "True")]
