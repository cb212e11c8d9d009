"""The CUDA and NCCL paths on a GPU (marked ``gpu``; skipped without CUDA), one test per finding
of the read of those paths against torch 2.13; tests/test_gpu_paths.py has their CPU logic.

    .venv/bin/python -m pytest -q -m gpu tests/test_gpu_paths_cuda.py
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nbdist import Cluster
from nbdist.worker.process_group import NCCL_ENVIRONMENT
from tests.gpu_ranks import SHARED, at_least_two, two_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU"),
]
ALL_REDUCE = "t = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(t)\nfloat(t)"


def _total(n: int) -> str:
    return str(float(n * (n + 1) // 2))


@pytest.fixture(scope="module")
def nccl_cluster(fast_config):
    cluster = Cluster(config=fast_config).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def nccl_pair(nccl_cluster: Cluster, fast_config):
    """Two ranks or more: one per GPU, or two sharing a machine's one GPU."""
    yield from at_least_two(nccl_cluster, fast_config)


def test_1_cpu_tensors_and_fsdp_work_on_the_nccl_group(nccl_cluster: Cluster):
    n = nccl_cluster.world_size
    cpu = nccl_cluster.run("c = torch.ones(1) * (rank + 1)\ndist.all_reduce(c)\nfloat(c)")
    assert cpu.raise_for_errors().grouped_values() == [(list(range(n)), _total(n))]
    code = (
        "import nbdist\n"
        "net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))\n"
        "p = nbdist.prepare(net, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy='fsdp')\n"
        "loss = p.model(torch.randn(4, 16, device=device)).pow(2).mean()\n"
        "p.backward(loss); p.step()\n"
        "str(next(p.model.parameters()).device) == str(device)"
    )
    result = nccl_cluster.run(code, timeout=300).raise_for_errors()
    assert result.grouped_values() == [(list(range(n)), "True")]


def test_2_a_collective_one_rank_queued_is_not_paired_with_the_next(nccl_pair: Cluster):
    nccl_cluster = nccl_pair
    n = nccl_cluster.world_size
    code = ("t = torch.ones(1, device=device)\nif rank == 0:\n    dist.all_reduce(t)\n"
            "else:\n    raise ValueError('stopped before the all_reduce')\n")
    result = nccl_cluster.run(code, timeout=60)
    # rank 0's cell ended "ok" (NCCL queued the all_reduce and returned); its counts say the
    # all_reduce can never complete, so it fails too, with no value
    assert sorted(result.errors) == list(range(n)) and 0 not in result.results
    assert result.errors[0].kind == "collective" and "never reached" in result.errors[0].evalue
    assert any("queued different numbers of cuda collectives" in a and "rebuilt" in a
               for a in result.actions), result.actions
    assert nccl_cluster.run(ALL_REDUCE).raise_for_errors().grouped_values() == [
        (list(range(n)), _total(n))]


def test_3_the_nccl_environment_is_in_force(nccl_cluster: Cluster):
    names = sorted(NCCL_ENVIRONMENT)
    result = nccl_cluster.run(f"import os\n[os.environ.get(k) for k in {names!r}]")
    expected = [os.environ.get(name, NCCL_ENVIRONMENT[name]) for name in names]
    assert result.raise_for_errors().grouped_values() == [
        (list(range(nccl_cluster.world_size)), repr(expected))]


def test_3_a_timed_out_nccl_collective_does_not_end_the_engines(fast_config):
    cluster = two_ranks(dataclasses.replace(fast_config, nccl_process_group_timeout=5.0))
    try:
        code = ("import time\nt = torch.ones(1, device=device)\nif rank == 1:\n    time.sleep(20)\n"
                "dist.all_reduce(t)\ntorch.cuda.synchronize()\n")
        cluster.run(code, timeout=120)
        assert [p.state for p in cluster.ranks] == ["alive", "alive"]
        check = cluster.run(ALL_REDUCE, timeout=60)
        if not check.ok:  # the aborted group fails one collective; nbdist rebuilds it after
            check = cluster.run(ALL_REDUCE, timeout=60)
        assert check.raise_for_errors().grouped_values() == [([0, 1], "3.0")]
    finally:
        cluster.stop()


def test_4_after_a_hung_barrier_the_nccl_group_is_re_formed(nccl_pair: Cluster):
    nccl_cluster = nccl_pair
    n = nccl_cluster.world_size
    result = nccl_cluster.run("if rank == 0:\n    dist.barrier()\n", timeout=5)
    assert any("rebuilt" in a for a in result.actions), result.actions
    assert all(p.state == "alive" for p in nccl_cluster.ranks)
    after = nccl_cluster.run("dist.get_world_size()").raise_for_errors()
    assert after.grouped_values() == [(list(range(n)), str(n))]
    assert nccl_cluster.run(ALL_REDUCE).raise_for_errors().grouped_values() == [
        (list(range(n)), _total(n))]


def _uuids_seen(visible: str | None) -> list[str]:
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    code = ("import torch\nfrom nbdist.worker.bootstrap import gpu_uuids\n"
            "print(','.join(gpu_uuids(torch.cuda.device_count())))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip().split(",")


def test_5_an_engine_limited_to_one_gpu_reports_that_gpus_uuid():
    every = _uuids_seen(None)
    assert len(every) == GPUS and len(set(every)) == GPUS
    last = _uuids_seen(str(GPUS - 1))
    assert last == [every[-1]]  # renumbered to 0, still the same card: the rank map can tell


def test_6_a_rank_with_two_gpus_runs_ddp_over_both(fast_config):
    # on one GPU (shared) the rank's two GPUs are that one twice: the same code, one device
    cluster = Cluster(n=1, gpus_per_rank=2, share_gpu=SHARED, config=fast_config).start()
    try:
        code = (
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "a, b = gpus\n"
            "class Two(torch.nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.first = torch.nn.Linear(8, 8).to(a)\n"
            "        self.second = torch.nn.Linear(8, 1).to(b)\n"
            "    def forward(self, x):\n"
            "        return self.second(self.first(x.to(a)).to(b))\n"
            "model = DDP(Two())\n"
            "model(torch.randn(4, 8)).sum().backward()\n"
            "[str(g) for g in gpus]"
        )
        result = cluster.run(code, timeout=120).raise_for_errors()
        expected = ["cuda:0", "cuda:0" if SHARED else "cuda:1"]
        assert result.grouped_values() == [([0], repr(expected))]
    finally:
        cluster.stop()


def test_7_cpu_ranks_on_a_gpu_host_stay_on_the_cpu(fast_config):
    cluster = Cluster(n=2, backend="gloo", gpus_per_rank=0, config=fast_config).start()
    try:
        code = ("import nbdist\np = nbdist.prepare(torch.nn.Linear(4, 4), strategy='ddp')\n"
                "(str(device), str(next(p.model.parameters()).device))")
        result = cluster.run(code, timeout=120).raise_for_errors()
        assert result.grouped_values() == [([0, 1], "('cpu', 'cpu')")]
    finally:
        cluster.stop()


def test_7_more_ranks_than_gpus_run_on_the_cpu_unless_nccl_is_asked_for(fast_config):
    from nbdist.errors import NbdistError, NbdistWarning

    with pytest.warns(NbdistWarning, match=f"start -n {GPUS};"):
        cluster = Cluster(n=GPUS + 1, share_gpu=False, config=fast_config).start()
    try:
        assert cluster.backend == "gloo"
        code = ("from deepspeed.accelerator import get_accelerator\n"
                "(str(device), dist.get_backend(), get_accelerator().device_name())")
        result = cluster.run(code, timeout=120)
        # DeepSpeed on a GPU host would take CUDA and set_device(LOCAL_RANK): invalid for rank 1
        assert result.raise_for_errors().grouped_values() == [
            (list(range(GPUS + 1)), "('cpu', 'gloo', 'cpu')")]
    finally:
        cluster.stop()
    with pytest.raises(NbdistError, match=f"but {GPUS} are visible"):
        Cluster(n=GPUS + 1, backend="nccl", share_gpu=False, config=fast_config).start()


def test_8_the_users_peak_counter_spans_cells(nccl_cluster: Cluster):
    nccl_cluster.run("torch.cuda.reset_peak_memory_stats(device)\n"
                     "big = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)\n"
                     "del big").raise_for_errors()
    later = nccl_cluster.run("torch.cuda.max_memory_allocated(device) >= 512 * 2**20")
    assert later.raise_for_errors().grouped_values() == [
        (list(range(nccl_cluster.world_size)), "True")]


def test_9_a_logged_cuda_value_is_read_without_waiting(nccl_cluster: Cluster):
    code = (
        "import time\nfrom nbdist.worker.metrics import _PendingCuda\n"
        "torch.cuda._sleep(int(3e9))  # keeps the stream busy for a second or more\n"
        "pending = _PendingCuda(torch.ones((), device=device))\n"
        "started = time.perf_counter()\nbusy = pending.ready()\n"
        "asked_in = time.perf_counter() - started\n"
        "torch.cuda.synchronize()\n"
        "(busy, asked_in < 0.1, pending.ready(), pending.value())"
    )
    result = nccl_cluster.run(code, timeout=60).raise_for_errors()
    assert result.grouped_values() == [
        (list(range(nccl_cluster.world_size)), "(False, True, True, 1.0)")]


def test_10_pulled_and_consolidated_values_arrive_on_the_cpu(nccl_cluster: Cluster, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    import collections

    from nbdist.strategies.checkpoint import _deepspeed_full_state

    # a notebook that pulls a cell-defined class defines it too (test_gpu_paths: else refused)
    monkeypatch.setattr(sys.modules["__main__"], "Pair",
                        collections.namedtuple("Pair", "x y", module="__main__"), raising=False)

    folder = tmp_path / "ds"
    nccl_cluster.run(
        "import collections, pathlib\nPair = collections.namedtuple('Pair', 'x y')\n"
        "pair = Pair(torch.ones(1, device=device), {'w': torch.zeros(2, device=device)})\n"
        f"folder = pathlib.Path({str(folder)!r})\n"
        "if rank == 0:\n"
        "    folder.mkdir(parents=True)\n"
        "    torch.save({'module': {'w': torch.ones(2, device=device)}},\n"
        "               folder / 'mp_rank_00_model_states.pt')\n"
    ).raise_for_errors()
    pulled = nccl_cluster.pull("pair")[0]
    assert pulled.x.device.type == "cpu" and pulled.y["w"].device.type == "cpu"
    state = _deepspeed_full_state(folder)
    assert state["w"].device.type == "cpu"
    assert not torch.cuda.is_initialized()  # this process is the notebook: no CUDA here


def test_10_nvml_handle_is_this_ranks_own_device(nccl_cluster: Cluster):
    pytest.importorskip("pynvml")
    code = (
        "from nbdist.worker.rank_memory import _open_nvml\n"
        "nvml, handle = _open_nvml(device)\n"
        "uuid = nvml.nvmlDeviceGetUUID(handle)\n"
        "uuid = uuid.decode() if isinstance(uuid, bytes) else uuid\n"
        "uuid.endswith(str(torch.cuda.get_device_properties(device).uuid))"
    )
    result = nccl_cluster.run(code).raise_for_errors()
    assert result.grouped_values() == [(list(range(nccl_cluster.world_size)), "True")]


def test_10_the_gpu_budget_counts_what_its_cap_counts(fast_config):
    cluster = Cluster(n=1, memory_limit="2GiB", config=fast_config).start()
    try:
        code = ("import nbdist\nx = torch.empty(2**28, dtype=torch.uint8, device=device)\n"
                "b = nbdist.memory_budget()\n"
                "(b['in_use'] == torch.cuda.memory_reserved(device),\n"
                " b['allocated'] == torch.cuda.memory_allocated(device))")
        result = cluster.run(code, timeout=120).raise_for_errors()
        assert result.grouped_values() == [([0], "(True, True)")]
    finally:
        cluster.stop()
