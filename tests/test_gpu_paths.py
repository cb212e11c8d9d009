"""The logic of nbdist's CUDA and NCCL paths that runs without a GPU: pure functions over probe
data, and gloo where the same rule holds (mixed backend strings, collective sequence numbers).
tests/test_gpu.py proves the same paths on a CUDA machine."""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import stat
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
from torch.distributed.distributed_c10d import Backend, BackendConfig

from nbdist import Cluster, torch_support
from nbdist.cells.whereabouts import desynchronised
from nbdist.cluster.rank_setup import cores_of_their_own
from nbdist.cluster.ranks import (
    EngineInfo,
    RankSpec,
    build_rank_map,
    default_threads,
    validate_backend,
)
from nbdist.errors import NbdistError
from nbdist.protocol.frames import pack, unpack
from nbdist.protocol.handshake import ProbeReply
from nbdist.strategies import deepspeed as deepspeed_strategy
from nbdist.strategies._common import RANK_DEVICE_VAR, StrategyOptionError, rank_device
from nbdist.worker import metrics
from nbdist.worker.agent import TelemetryAgent
from nbdist.worker.bootstrap import launcher_local_id
from nbdist.worker.process_group import (
    NCCL_ENVIRONMENT,
    dump_environment,
    nccl_environment,
    torch_backend,
)
from nbdist.worker.rank_memory import nvml_uuids, physical_index
from nbdist.worker.release import uses_nccl


# -- 1. the NCCL world group has a CPU backend ---------------------------------------------------
def test_an_nccl_rank_gets_gloo_for_cpu_tensors() -> None:
    assert BackendConfig(Backend("nccl")).get_device_backend_map() == {"cuda": "nccl"}  # the bug
    mapped = BackendConfig(Backend(torch_backend("nccl"))).get_device_backend_map()
    assert mapped == {"cpu": "gloo", "cuda": "nccl"}
    assert torch_backend("gloo") == "gloo"
    assert uses_nccl("nccl") and uses_nccl("cpu:gloo,cuda:nccl")
    assert not uses_nccl("gloo") and not uses_nccl("cpu:gloo,cuda:gloo")


# -- 2. collectives queued unequally: the group is rebuilt ---------------------------------------
def test_desynchronised_names_the_counts() -> None:
    same = {0: {"sequence": {"cpu": 4, "cuda": 9}}, 1: {"sequence": {"cpu": 4, "cuda": 9}}}
    assert desynchronised(same) == ""
    assert desynchronised({0: {}, 1: {"sequence": {}}}) == ""
    apart = {0: {"sequence": {"cpu": 4, "cuda": 10}}, 1: {"sequence": {"cpu": 4, "cuda": 9}}}
    assert desynchronised(apart) == (
        "the ranks queued different numbers of cuda collectives (rank 0: 10, rank 1: 9)")


@pytest.mark.parametrize("waits", [False, True], ids=["like-nccl", "gloo-waits-at-cell-end"])
def test_a_collective_only_one_rank_queued_is_not_paired_with_the_next(cluster_factory,
                                                                       fast_config,
                                                                       waits: bool) -> None:
    # gloo queues an async_op collective and returns, as NCCL does every collective: rank 0 is
    # "ok" with one queued, rank 1 raised before reaching it. Without the wait at the cell's end
    # (NCCL has none) the ranks' counts of queued collectives differ after the cell; with it
    # (gloo; it needs the flight recorder), rank 0 waits in the collective and is released like
    # any rank blocked on a peer
    config = fast_config if waits else fast_config.replace(cell_end_collective_wait=0.0)
    waits = waits and torch_support.has("flight-recorder")
    cluster = cluster_factory(2, config=config)
    cluster.run("t = torch.ones(1)").raise_for_errors()
    code = ("if rank == 0:\n    work = dist.all_reduce(t, async_op=True)\n"
            "else:\n    raise ValueError('rank 1 stopped before the all_reduce')\n")
    result = cluster.run(code, timeout=60)
    assert sorted(result.errors) == [1]
    said = ("so that rank(s) 0 blocked on them were released" if waits
            else "queued different numbers of cpu collectives (rank 0:")
    assert any(said in a for a in result.actions), result.actions
    assert "rebuilt" in result.actions[-1], result.actions
    check = cluster.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nfloat(t)",
                        timeout=60).raise_for_errors()
    assert check.grouped_values() == [([0, 1], "3.0")]


# -- 3. NCCL's watchdog returns errors; the user's settings win ----------------------------------
def test_nccl_environment_keeps_what_the_user_set() -> None:
    to_set, notes = nccl_environment({})
    assert to_set == NCCL_ENVIRONMENT and notes == []
    assert to_set["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: no process exit
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    to_set, notes = nccl_environment(mine)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in to_set
    assert "TORCH_NCCL_ENABLE_MONITORING" not in to_set  # same value: set, nothing to say
    assert notes == ["TORCH_NCCL_ASYNC_ERROR_HANDLING=3 is yours and kept (nbdist would set 2: "
                     "see docs/NCCL.md)"]


def test_the_dump_on_timeout_goes_to_a_directory_only_the_rank_reads(tmp_path) -> None:
    to_set = dump_environment({}, 3, str(tmp_path))
    prefix = to_set["TORCH_FR_DUMP_TEMP_FILE"]
    assert prefix == str(tmp_path / "flight-recorder-rank3" / "nccl_trace_rank_")
    assert stat.S_IMODE(os.stat(os.path.dirname(prefix)).st_mode) == 0o700
    assert NCCL_ENVIRONMENT["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert NCCL_ENVIRONMENT["TORCH_NCCL_ENABLE_MONITORING"] == "0"  # dump, but never exit
    for mine in ({"TORCH_FR_DUMP_TEMP_FILE": "/x/t_"}, {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t_"}):
        assert dump_environment(mine, 3, str(tmp_path)) == {}  # the user's wins, old name or new


def test_a_remote_ranks_dump_directory_is_its_own_and_goes_with_its_engine() -> None:
    # a rank on another machine has no cluster directory there: a private temporary one, removed
    # when its process exits
    code = ("import os\nfrom nbdist.worker.process_group import dump_environment\n"
            "prefix = dump_environment({}, 0, None)['TORCH_FR_DUMP_TEMP_FILE']\n"
            "print(os.path.dirname(prefix), oct(os.stat(os.path.dirname(prefix)).st_mode & 0o777))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    directory, mode = ran.stdout.split()
    assert os.path.basename(directory).startswith("nbdist-flight-recorder-") and mode == "0o700"
    assert not os.path.exists(directory)


def test_every_rank_dumps_into_the_cluster_directory_and_stop_leaves_nothing(cluster_factory):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "nbdist-flight-recorder-*")))
    cluster = cluster_factory(2)
    workdir = cluster.workdir
    prefixes = cluster.run("import os\nos.environ['TORCH_FR_DUMP_TEMP_FILE']").raise_for_errors()
    for rank in (0, 1):
        prefix = prefixes.value_text(rank).strip("'")
        assert prefix == os.path.join(workdir, f"flight-recorder-rank{rank}", "nccl_trace_rank_")
        assert stat.S_IMODE(os.stat(os.path.dirname(prefix)).st_mode) == 0o700
    cluster.stop()
    assert not os.path.exists(workdir)
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "nbdist-flight-recorder-*")))
    assert after <= before, sorted(after - before)


# -- 5. per-task GPUs (Slurm --gpus-per-task, cgroups, MIG) and launcher order -------------------
def _engine(eid: int, uuids: tuple[str, ...], local_id: int | None = None) -> EngineInfo:
    return EngineInfo(eid, "node1", 100 + eid, len(uuids), uuids, local_id)


def test_engines_that_each_see_their_own_gpu_use_it() -> None:
    engines = [_engine(eid, (f"GPU-{eid}",)) for eid in range(4)]
    specs = build_rank_map(engines, "nccl", 1)
    assert [s.gpus for s in specs] == [(0,)] * 4  # each its own index 0, not "needs 4 GPUs"
    shared = [_engine(eid, ("GPU-a", "GPU-b")) for eid in range(2)]
    assert [s.gpus for s in build_rank_map(shared, "nccl", 1)] == [(0,), (1,)]
    with pytest.raises(NbdistError, match="fewer than --gpus-per-rank 2"):
        build_rank_map(engines, "nccl", 2)
    overlapping = [_engine(0, ("GPU-a", "GPU-b")), _engine(1, ("GPU-b", "GPU-c"))]
    with pytest.raises(NbdistError, match="overlapping"):
        build_rank_map(overlapping, "nccl", 1)


def test_ranks_follow_the_launchers_local_ids() -> None:
    engines = [_engine(0, ("GPU-a", "GPU-b"), 1), _engine(1, ("GPU-a", "GPU-b"), 0)]
    specs = build_rank_map(engines, "nccl", 1)
    assert [(s.engine_id, s.local_rank, s.gpus) for s in specs] == [(1, 0, (0,)), (0, 1, (1,))]
    assert launcher_local_id({"SLURM_LOCALID": "3"}) == 3
    assert launcher_local_id({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1
    assert launcher_local_id({}) is None


# -- 6./7. GPUs per rank, the pinned device, and the impossible combination ----------------------
def test_nccl_without_gpus_per_rank_is_refused_up_front() -> None:
    with pytest.raises(NbdistError, match="--gpus-per-rank 0"):
        validate_backend("nccl", 0)
    with pytest.raises(NbdistError, match="--gpus-per-rank 0"):
        Cluster(n=2, backend="nccl", gpus_per_rank=0)  # before any process starts
    two = [_engine(0, ("a", "b", "c", "d")), _engine(1, ("a", "b", "c", "d"))]
    assert [s.gpus for s in build_rank_map(two, "nccl", 2)] == [(0, 1), (2, 3)]


def test_strategies_compute_on_the_pinned_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANK_DEVICE_VAR, "cpu")
    assert rank_device() == torch.device("cpu")
    monkeypatch.setenv(RANK_DEVICE_VAR, "cuda:3")  # a name only: nothing touches CUDA here
    assert rank_device() == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert deepspeed_strategy.device_args(zero_stage=2).device_rank == 3
    with pytest.raises(StrategyOptionError, match="cuda:LOCAL_RANK"):
        deepspeed_strategy.device_args(zero_stage=3)
    monkeypatch.setenv(RANK_DEVICE_VAR, "cpu")
    assert deepspeed_strategy.device_args(zero_stage=3) is None


# -- 9. a logged value that is not ready waits for the next publish ------------------------------
class _Later(metrics.PendingValue):
    __slots__ = ("done", "number")

    def __init__(self, number: float) -> None:
        self.done = threading.Event()
        self.number = number

    def ready(self) -> bool:
        return self.done.is_set()

    def value(self) -> float:
        return self.number


@pytest.fixture
def metrics_agent():
    agent = TelemetryAgent(0, 0.5, lambda _payload: None)
    metrics.install_metrics(agent)
    yield agent
    metrics.uninstall_metrics(agent)


def test_drain_never_waits_for_a_pending_value(metrics_agent) -> None:
    later = _Later(0.25)
    metrics.log(step=0, loss=1.0)
    metrics.log(step=1, loss=later)
    metrics.log(step=2, loss=0.5)
    first = metrics.drain()
    assert first["step"] == [0.0] and first["values"]["loss"] == [1.0]
    assert metrics.drain() is None  # still pending: kept, in order, nothing blocked
    later.done.set()
    metrics.log(step=3, loss=0.125)
    rest = metrics.drain()
    assert rest["step"] == [1.0, 2.0, 3.0] and rest["values"]["loss"] == [0.25, 0.5, 0.125]


# -- 10. the smaller ones ------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Holder:
    tensor: torch.Tensor


def test_pushed_values_have_every_tensor_moved() -> None:
    model = torch.nn.Linear(2, 2)
    sparse = torch.eye(3).to_sparse()
    value = {"pair": Pair(torch.ones(1), [Holder(torch.zeros(3))]), "model": model, "n": 1,
             "big": torch.ones(100_000), "sparse": sparse, "empty": torch.zeros(2, 0)}
    # the meta device stands in for "another device" on a machine without one
    moved = unpack(pack(value), device="meta")
    assert type(moved["pair"]).__name__ == "Pair" and moved["pair"].x.device.type == "meta"
    assert moved["pair"].y[0].tensor.device.type == "meta"
    assert moved["big"].device.type == "meta" and moved["sparse"].device.type == "meta"
    assert not torch._utils._sparse_tensors_to_validate  # not left for the next torch.load
    assert moved["empty"].shape == (2, 0)
    weight = moved["model"].weight
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert weight.device.type == "meta" and model.weight.device.type == "cpu"
    back = unpack(pack(value))  # no device: the CPU, as the notebook receives a pulled value
    assert torch.equal(back["sparse"].to_dense(), torch.eye(3)) and back["model"].weight.is_leaf


def test_a_pulled_value_of_a_class_only_the_ranks_define_is_refused_at_once(
        cluster2: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections
    import sys
    import time

    cluster2.run("import collections\nPair = collections.namedtuple('Pair', 'x y')\n"
                 "pair = Pair(torch.ones(1), {'w': torch.zeros(2)})").raise_for_errors()
    started = time.perf_counter()
    with pytest.raises(NbdistError, match=r"pull 'pair' from rank 0: .*holds Pair, defined in a "
                                          r"cell on the ranks, which the notebook does not define"):
        cluster2.pull("pair")
    assert time.perf_counter() - started < 10  # ipyparallel used to drop the reply: 120 s, no cause
    # the same definition in the notebook (its __main__) is what the pickle is rebuilt with
    monkeypatch.setattr(sys.modules["__main__"], "Pair",
                        collections.namedtuple("Pair", "x y", module="__main__"), raising=False)
    pulled = cluster2.pull("pair")
    assert pulled[1].x.tolist() == [1.0] and pulled[1].y["w"].tolist() == [0.0, 0.0]


def test_nvml_finds_mig_instances_and_never_guesses_gpu_0() -> None:
    assert nvml_uuids("6f7e-aa") == ["GPU-6f7e-aa", "MIG-6f7e-aa"]
    assert nvml_uuids("MIG-6f7e-aa") == ["MIG-6f7e-aa"]
    assert physical_index(1, "2,3") == 3 and physical_index(0, None) == 0
    assert physical_index(0, "MIG-6f7e-aa") is None
    assert physical_index(0, "GPU-1234") is None


def test_slurm_task_threads_are_not_divided_again() -> None:
    assert default_threads(8, 4) == 2
    assert default_threads(8, 4, own_cores=True) == 8
    specs = [RankSpec(r, r, 2, 2, "n1", r, "gloo") for r in range(2)]
    own = {0: ProbeReply(cpu_affinity=(0, 1)), 1: ProbeReply(cpu_affinity=(2, 3))}
    shared = {0: ProbeReply(cpu_affinity=(0, 1, 2, 3)), 1: ProbeReply(cpu_affinity=(0, 1, 2, 3))}
    assert cores_of_their_own(specs, own) == {"n1": True}
    assert cores_of_their_own(specs, shared) == {"n1": False}


def test_this_process_is_left_as_it_was() -> None:
    assert RANK_DEVICE_VAR not in os.environ
