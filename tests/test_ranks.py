"""Pure rank-map logic: rank selection, host grouping, GPU ownership, backend choice."""

import pytest

from nbdist.cluster.rank_setup import gpus_or_cpu
from nbdist.cluster.ranks import (
    EngineInfo,
    build_rank_map,
    choose_backend,
    default_threads,
    format_ranks,
    gpu_shortfall,
    parse_ranks,
)
from nbdist.errors import NbdistError, NbdistWarning


def test_parse_ranks_ranges_and_lists():
    assert parse_ranks("0,2-3", 4) == [0, 2, 3]
    assert parse_ranks(" 3 , 1 ", 4) == [1, 3]
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize(
    "text,message",
    [("", "empty"), ("0,x", "not a rank"), ("3-1", "backwards"), ("0,4", "do not exist"), ("-1", "not a rank")],
)
def test_parse_ranks_errors(text, message):
    with pytest.raises(NbdistError, match=message):
        parse_ranks(text, 4)


def test_rank_map_groups_by_host_then_engine_and_is_stable_across_new_engine_ids():
    engines = [EngineInfo(7, "b", 1), EngineInfo(3, "a", 2), EngineInfo(9, "a", 3), EngineInfo(8, "b", 4)]
    specs = build_rank_map(engines, "gloo", host_order=["a", "b"])
    assert [(s.rank, s.host, s.local_rank, s.engine_id) for s in specs] == [
        (0, "a", 0, 3), (1, "a", 1, 9), (2, "b", 0, 7), (3, "b", 1, 8)]
    assert all(s.local_world_size == 2 and s.world_size == 4 for s in specs)
    restarted = [EngineInfo(20 + i, e.host, 0) for i, e in enumerate(engines)]
    # a restart passes the previous ranks' hosts: one entry per rank, so with repeats
    again = build_rank_map(restarted, "gloo", host_order=["a", "a", "b", "b"])
    assert len(again) == 4
    assert [(s.rank, s.host, s.local_rank) for s in again] == [(s.rank, s.host, s.local_rank) for s in specs]


def test_gpus_per_rank_gives_contiguous_gpus():
    engines = [EngineInfo(i, "h", i, gpu_count=4) for i in range(2)]
    specs = build_rank_map(engines, "nccl", gpus_per_rank=2)
    assert [s.gpus for s in specs] == [(0, 1), (2, 3)]
    assert specs[1].device == "cuda:2"
    env = specs[1].env("127.0.0.1", 1234)
    assert env["RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_PORT"] == "1234"


def test_more_gpu_ranks_than_gpus_is_a_clear_error():
    engines = [EngineInfo(i, "h", i, gpu_count=1) for i in range(2)]
    with pytest.raises(NbdistError, match="needs 2 GPUs, but 1 are visible"):
        build_rank_map(engines, "nccl")


def test_more_ranks_than_gpus_left_to_nbdist_runs_on_the_cpu_with_a_warning():
    one_gpu = [EngineInfo(i, "h", i, gpu_count=1, gpu_uuids=("GPU-a",)) for i in range(2)]
    assert gpu_shortfall(one_gpu, 1) == "host h: 2 ranks x 1 GPU(s) per rank, 1 GPU(s) visible"
    with pytest.warns(NbdistWarning, match=r"on the CPU \(gloo\)\. For one rank per GPU start -n 1"):
        assert gpus_or_cpu(one_gpu, "auto", 1) == 0
    assert build_rank_map(one_gpu, choose_backend("auto", [1, 1], 0), 0)[1].device == "cpu"
    assert gpus_or_cpu(one_gpu, "nccl", 1) == 1  # asked for: build_rank_map's error stands
    # enough GPUs, GPUs of their own (Slurm --gpus-per-task), or CPU ranks asked for: unchanged
    assert gpu_shortfall([EngineInfo(i, "h", i, gpu_count=2) for i in range(2)], 1) is None
    own = [EngineInfo(i, "h", i, gpu_count=1, gpu_uuids=(f"GPU-{i}",)) for i in range(2)]
    assert gpu_shortfall(own, 1) is None and gpu_shortfall(one_gpu, 0) is None
    assert gpu_shortfall([EngineInfo(i, "h", i) for i in range(2)], 1) is None  # no GPU at all
    two_hosts = [EngineInfo(0, "a", 0, gpu_count=2), EngineInfo(1, "b", 1, gpu_count=0)]
    assert gpu_shortfall(two_hosts, 1) == "host b: 1 ranks x 1 GPU(s) per rank, 0 GPU(s) visible"


def test_backend_choice():
    assert choose_backend("auto", [0, 0], 1) == "gloo"
    assert choose_backend("auto", [2, 2], 1) == "nccl"
    assert choose_backend("gloo", [2, 2], 1) == "gloo"
    with pytest.raises(NbdistError, match="--backend nccl needs a CUDA GPU"):
        choose_backend("nccl", [0, 0], 1)
    with pytest.raises(NbdistError, match="choose auto"):
        choose_backend("mpi", [0], 1)


def test_default_threads_is_cores_over_local_ranks():
    assert default_threads(8, 4) == 2
    assert default_threads(2, 4) == 1
