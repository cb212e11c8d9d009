"""A real 2- and 4-rank CPU cluster: collectives, state, subsets, push/pull, output, errors."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from nbdist import Cluster, DistributedCellError
from nbdist.errors import ClusterNotRunningError, NbdistError
from tests.sinks import RecordingSink


def test_all_reduce_and_torchrun_environment(cluster2: Cluster):
    result = cluster2.run(
        "import os\n"
        "t = torch.tensor([float(rank + 1)])\n"
        "dist.all_reduce(t)\n"
        "env = {k: os.environ[k] for k in ('RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','MASTER_ADDR','MASTER_PORT')}\n"
        "threads = torch.get_num_threads()\n"
        "t"
    ).raise_for_errors()
    assert result.grouped_values() == [([0, 1], "tensor([3.])")]
    envs = cluster2.pull("env")
    for r in (0, 1):
        assert envs[r]["RANK"] == str(r) and envs[r]["LOCAL_RANK"] == str(r)
        assert envs[r]["WORLD_SIZE"] == "2" and envs[r]["LOCAL_WORLD_SIZE"] == "2"
        assert envs[r]["MASTER_ADDR"] == "127.0.0.1"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    expected_threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert cluster2.pull("threads") == {0: expected_threads, 1: expected_threads}


def test_names_defined_before_first_cell(cluster2: Cluster):
    result = cluster2.run(
        "import nbdist\n(rank, world_size, local_rank, str(device), dist.get_backend(), "
        "torch.__name__, nbdist.__version__ != '')"
    ).raise_for_errors()
    assert result.value_text(0) == "(0, 2, 0, 'cpu', 'gloo', 'torch', True)"
    assert result.value_text(1) == "(1, 2, 1, 'cpu', 'gloo', 'torch', True)"


def test_state_persists_across_cells(cluster2: Cluster):
    cluster2.run("counter = rank * 10").raise_for_errors()
    cluster2.run("counter += 1").raise_for_errors()
    assert cluster2.pull("counter") == {0: 1, 1: 11}


def test_rank_subsets(cluster4: Cluster):
    result = cluster4.run("marker = rank\nrank", ranks=[0, 2, 3]).raise_for_errors()
    assert result.ranks == [0, 2, 3]
    assert [g for g in result.grouped_values()] == [([0], "0"), ([2], "2"), ([3], "3")]
    with pytest.raises(NbdistError, match="not defined on this rank"):
        cluster4.pull("marker", ranks=[1])


def test_four_rank_all_reduce_and_subset_collective(cluster4: Cluster):
    result = cluster4.run("t = torch.ones(4) * rank\ndist.all_reduce(t)\nt.tolist()").raise_for_errors()
    assert result.grouped_values() == [([0, 1, 2, 3], "[6.0, 6.0, 6.0, 6.0]")]


def test_push_pull_round_trip_tensors_and_objects(cluster2: Cluster):
    weights = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    cluster2.push({"weights": weights, "config": {"lr": 0.1, "layers": [1, 2]}})
    result = cluster2.run("(weights.device.type, weights.sum().item(), config['layers'])")
    assert result.grouped_values() == [([0, 1], "('cpu', 15.0, [1, 2])")]
    cluster2.run("weights = weights * (rank + 1)").raise_for_errors()
    pulled = cluster2.pull("weights")
    assert torch.equal(pulled[0], weights) and torch.equal(pulled[1], weights * 2)
    # in rank order, as %dist_pull shows it, whichever rank answered first (rank 0 sends 100 MB)
    cluster2.run("big = torch.zeros(25_000_000 if rank == 0 else 1)").raise_for_errors()
    assert list(cluster2.pull("big")) == [0, 1]
    cluster2.run("del big").raise_for_errors()
    assert cluster2.pull("config")[1] == {"lr": 0.1, "layers": [1, 2]}


def test_large_tensors_travel_as_their_own_frames_uncopied_and_exact(cluster2: Cluster):
    """A big CPU tensor is a frame of its own, sent from and rebuilt on its memory (no pickle
    copy); every dtype, a Parameter and requires_grad survive."""
    from nbdist.protocol.frames import pack, unpack

    big = torch.arange(100_000, dtype=torch.float32)
    frames = pack({"big": big})
    assert len(frames) == 2 and np.frombuffer(frames[1], np.uint8).ctypes.data == big.data_ptr()
    received = bytearray(frames[1])  # what a zmq frame received without a copy exposes
    rebuilt = unpack([frames[0], memoryview(received)])["big"]
    assert torch.equal(rebuilt, big)
    assert rebuilt.data_ptr() == np.frombuffer(received, np.uint8).ctypes.data
    values = {
        "bf16": torch.randn(300, 300).to(torch.bfloat16),
        "ints": torch.arange(40_000, dtype=torch.int64).reshape(200, 200)[:, ::2],  # not contiguous
        "param": torch.nn.Parameter(torch.randn(200, 200)),
        "frozen": torch.randn(200, 200).requires_grad_(True),
        "small": torch.ones(3),
    }
    cluster2.push(values)
    cluster2.run(
        "same = [bf16.dtype, ints.shape, ints.is_contiguous(), type(param).__name__,"
        " param.requires_grad, frozen.requires_grad, small.tolist()]"
    ).raise_for_errors()
    assert cluster2.pull("same")[1] == [torch.bfloat16, torch.Size([200, 100]), True, "Parameter",
                                        True, True, [1.0, 1.0, 1.0]]
    pulled = cluster2.pull("bf16")
    assert all(torch.equal(t, values["bf16"]) for t in pulled.values())
    back = cluster2.pull("ints")[0]
    assert torch.equal(back, values["ints"]) and back.is_contiguous()
    back[0, 0] = -1  # the notebook's copy is its own, writable
    assert cluster2.pull("ints")[0][0, 0] == 0


def test_stdout_and_stderr_complete_and_labelled(cluster2: Cluster):
    sink = RecordingSink()
    code = (
        "import sys\n"
        "for i in range(200):\n"
        "    print(f'out {rank} {i}')\n"
        "    print(f'err {rank} {i}', file=sys.stderr)\n"
    )
    result = cluster2.run(code, sink=sink).raise_for_errors()
    for r in (0, 1):
        assert result.stdout[r] == "".join(f"out {r} {i}\n" for i in range(200))
        assert result.stderr[r] == "".join(f"err {r} {i}\n" for i in range(200))
        streamed = "".join(t for rank, name, t in sink.events if rank == r and name == "stdout")
        assert streamed == result.stdout[r]


def test_rich_display_reaches_the_notebook(cluster2: Cluster):
    sink = RecordingSink()
    cluster2.run("from IPython.display import HTML, display\ndisplay(HTML(f'<b>rank {rank}</b>'))",
                 sink=sink).raise_for_errors()
    shown = {r: c["data"]["text/html"] for r, kind, c in sink.events if kind == "display"}
    assert shown == {0: "<b>rank 0</b>", 1: "<b>rank 1</b>"}


def test_exception_names_rank_with_user_traceback(cluster2: Cluster):
    result = cluster2.run("def f():\n    raise ValueError('bad value on ' + str(rank))\nif rank == 1:\n    f()")
    assert sorted(result.errors) == [1]
    err = result.errors[1]
    assert err.kind == "root" and err.ename == "ValueError" and "bad value on 1" in err.evalue
    assert "line 4" in err.traceback and "ipyparallel" not in err.traceback
    with pytest.raises(DistributedCellError, match="rank 1 raised ValueError: bad value on 1"):
        result.raise_for_errors()


def test_timeout_argument_is_checked(cluster2: Cluster):
    with pytest.raises(NbdistError, match="must be a finite number of seconds, more than 0"):
        cluster2.run("pass", timeout=0)


def test_not_running_cluster_says_so():
    cluster = Cluster(n=2)
    with pytest.raises(ClusterNotRunningError, match="%dist_start"):
        cluster.run("pass")


def test_bad_constructor_arguments():
    with pytest.raises(NbdistError, match="must be a whole number, 1 or more"):
        Cluster(n=0)
    with pytest.raises(NbdistError, match="choose auto"):
        Cluster(n=2, backend="mpi")


def test_nccl_without_gpu_fails_fast_and_leaves_nothing(cluster_factory):
    with pytest.raises(NbdistError, match="--backend nccl needs a CUDA GPU"):
        cluster_factory(2, backend="nccl")


def test_private_directory_and_loopback(cluster2: Cluster):
    mode = stat.S_IMODE(os.stat(cluster2.workdir).st_mode)
    assert mode == 0o700
    security = os.path.join(cluster2.workdir, "profile", "security")
    connection_files = [f for f in os.listdir(security) if f.endswith(".json")]
    assert connection_files
    for name in connection_files:
        path = os.path.join(security, name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
