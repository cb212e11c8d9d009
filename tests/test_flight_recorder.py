"""Hang and failure reports read from torch's flight recorder, with real engines on gloo: the
collective every rank waits in or never entered (DDP's backward, FSDP2's gathers, a sub-group),
the error line at the cell's own line, and a sub-group hang released without a kill."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import time

import pytest

from nbdist import Cluster, torch_support
from nbdist.worker import process_group
from tests.sinks import RecordingSink

HAS_RECORDER = torch_support.has("flight-recorder")
needs_recorder = pytest.mark.skipif(
    not HAS_RECORDER,
    reason="nbdist reads the flight recorder from torch 2.13 (older: its own tracking)")

DEADLINE = 3.0


def run_to_deadline(cluster: Cluster, code: str,
                    deadline: float = DEADLINE) -> tuple[object, float]:
    """Run `code` to its deadline; returns the result and the seconds from the deadline to the
    report's first line."""
    sink = RecordingSink()
    shown: list[float] = []
    on_status = sink.on_status

    def timed(text: str) -> None:
        shown.append(time.perf_counter())
        on_status(text)

    sink.on_status = timed  # type: ignore[method-assign]
    started = time.perf_counter()
    result = cluster.run(code, timeout=deadline, sink=sink)
    assert result.timed_out, result.report
    return result, shown[0] - started - deadline


def assert_all_alive_and_working(cluster: Cluster, pids: list[int]) -> None:
    assert [p.pid for p in cluster.ranks] == pids
    assert all(p.state == "alive" for p in cluster.ranks)
    value = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()", timeout=30)
    assert value.raise_for_errors().grouped_values() == [([0, 1], "2.0")]


@needs_recorder
def test_ddp_rank_skipping_backward_is_named(cluster2: Cluster):
    cluster2.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp = DDP(torch.nn.Linear(64, 64))\n"
        "kept = rank\n"
    ).raise_for_errors()
    pids = [p.pid for p in cluster2.ranks]
    code = "loss = ddp(torch.randn(8, 64)).sum()\nif rank == 0:\n    loss.backward()\n"
    result, seconds = run_to_deadline(cluster2, code)
    first = result.report[0]
    assert first.startswith("rank 0 waits in all_reduce #"), result.report
    assert "of the default group (gradients in backward() at cell line 3, [4160] Float" in first
    assert "rank 1 never entered it: it finished the cell" in first
    assert seconds < 2.0, f"report {seconds:.2f} s after the deadline"
    assert result.errors[0].where == "cell line 3", result.errors[0].where
    assert "cell line 3" in result.failure_message()
    assert "979" not in result.failure_message().splitlines()[2]
    assert_all_alive_and_working(cluster2, pids)
    assert cluster2.pull("kept") == {0: 0, 1: 1}
    cluster2.run("del ddp").raise_for_errors()


@needs_recorder
@pytest.mark.parametrize("late", [0.0, 0.35])
def test_a_short_deadline_still_names_the_collective(cluster2: Cluster, late: float):
    # rank 0 enters the all_reduce at once, or 0.15 s before a 0.5 s deadline: either way its
    # telemetry had no reading of it yet; asked at the deadline, it answers from its own thread
    code = f"import time\nt = torch.ones(3)\nif rank == 0:\n    time.sleep({late})\n" \
           "    dist.all_reduce(t)\n"
    result, seconds = run_to_deadline(cluster2, code, deadline=0.5)
    first = result.report[0]
    assert re.fullmatch(r"rank 0 waits in all_reduce #\d+ of the default group \(at cell line 5, "
                        r"\[3\] Float, 12 B\); rank 1 never entered it: it finished the cell "
                        r"\(its last in that group: \w+ #\d+\)", first), result.report
    assert seconds < 2.0, f"report {seconds:.2f} s after the deadline"
    assert not any("killed" in a for a in result.actions), result.actions


def test_sub_group_skip_is_released_without_a_kill(cluster2: Cluster):
    cluster2.run("kept = rank * 10\ng = dist.new_group([0, 1])").raise_for_errors()
    pids = [p.pid for p in cluster2.ranks]
    code = "x = torch.ones(3)\nif rank == 0:\n    dist.all_reduce(x, group=g)\n"
    result, seconds = run_to_deadline(cluster2, code)
    first = result.report[0]
    if HAS_RECORDER:
        assert first.startswith("rank 0 waits in all_reduce #1 of the group "), result.report
        assert "(ranks 0, 1)" in first and "[3] Float" in first
        assert "rank 1 never entered it: it finished the cell" in first
    assert seconds < 2.0, f"report {seconds:.2f} s after the deadline"
    assert not any("killed" in a for a in result.actions), result.actions
    assert any("made it fail" in a for a in result.actions), result.actions
    assert_all_alive_and_working(cluster2, pids)
    assert cluster2.pull("kept") == {0: 0, 1: 10}


@needs_recorder
def test_different_collectives_at_one_sequence_id_are_named(cluster2: Cluster):
    code = "if rank == 0:\n    dist.all_reduce(torch.ones(4))\nelse:\n    dist.barrier()\n"
    result, seconds = run_to_deadline(cluster2, code)
    text = "\n".join(result.report)
    assert re.fullmatch(r"ranks 0-1 wait in collective #\d+ of the default group, not the "
                        r"same one \(see below\)", result.report[0]), result.report
    assert re.search(r"mismatch at collective #\d+ of the default group: "
                     r"rank 0: all_reduce \[4\] Float, rank 1: barrier", text), text
    assert seconds < 2.0, f"report {seconds:.2f} s after the deadline"
    if any(p.state != "alive" for p in cluster2.ranks):
        cluster2.restart()


@needs_recorder
def test_a_rank_killed_by_mismatched_sizes_is_named_with_the_sizes(cluster2: Cluster):
    code = "t = torch.ones(10 if rank == 0 else 20)\ndist.all_reduce(t)\n"
    result = cluster2.run(code, timeout=30)
    dead = [r for r, e in result.errors.items() if e.kind == "dead"]
    assert len(dead) == 1, result.failure_message()
    survivor = 1 - dead[0]
    size = 10 if survivor == 0 else 20
    message = result.failure_message()
    assert (f"when rank {dead[0]} died, rank {survivor} was in all_reduce #" in message
            and f"of the default group ([{size}] Float" in message), message
    assert "--check-collectives" in message
    cluster2.restart()


TENSOR_PARALLEL = (
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "from torch.distributed.tensor.parallel import (\n"
    "    ColwiseParallel, RowwiseParallel, parallelize_module)\n"
    "mesh = init_device_mesh('cpu', (2,))\n"
    "torch.manual_seed(0)\n"
    "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n"
    "net = parallelize_module(net, mesh, {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
    "kept = rank * 10\n")
"""A 2-rank tensor-parallel MLP on a 1-D DeviceMesh: its RowwiseParallel layer all-reduces the
partial outputs with DTensor's functional all_reduce, which returns before it ran."""

UNEVEN_BATCHES = "x = torch.ones(2 if rank == 0 else 3, 8)\ny = net(x)\n"
"""Each rank feeds its own batch size: the layer's all_reduce gets [2, 4] and [3, 4]."""


@needs_recorder
def test_a_tensor_parallel_layer_fed_different_sizes_is_named_in_its_own_cell(cluster2: Cluster):
    # the all_reduce returns at once and the cell ends "ok" on both ranks; gloo then aborts the
    # rank whose buffer is smaller from its own thread. Each rank waits at the cell's end for
    # what it left in flight, so the death is reported here, not by the next cell
    cluster2.run(TENSOR_PARALLEL).raise_for_errors()
    result = cluster2.run(UNEVEN_BATCHES, timeout=30)
    dead = [r for r, e in result.errors.items() if e.kind == "dead"]
    assert len(dead) == 1 and len(result.errors) == 1, result.failure_message()
    survivor = 1 - dead[0]
    message = result.failure_message()
    assert re.search(rf"when rank {dead[0]} died, rank {survivor} was in all_reduce #\d+ of "
                     rf"the default group \(\[{3 if survivor else 2}, 4\] Float", message), message
    assert "--check-collectives" in message
    assert "Received data size doesn't match expected size" in message  # gloo's own reason
    assert cluster2.replace_dead() == dead
    kept = cluster2.run("kept", ranks=[survivor], timeout=30).raise_for_errors()
    assert kept.value_text(survivor) == str(survivor * 10)  # the survivor's state is kept
    cluster2.run("del net, mesh", ranks=[survivor]).raise_for_errors()


def test_check_collectives_keeps_every_rank_alive_and_names_the_sizes(cluster_factory,
                                                                       fast_config):
    cluster = cluster_factory(2, config=fast_config.replace(check_collectives=True))
    said = any("DistributedDataParallel crashes" in note for note in cluster.ranks[0].notes)
    assert said == (not process_group.ddp_survives()), cluster.ranks[0].notes
    cluster.run("kept = rank").raise_for_errors()
    pids = [p.pid for p in cluster.ranks]
    code = "t = torch.ones(10 if rank == 0 else 20)\ndist.all_reduce(t)\n"
    result = cluster.run(code, timeout=30)
    assert sorted(e.rank for e in result.root_causes()) == [0, 1], result.failure_message()
    for err in result.errors.values():
        assert "Detected mismatch between collectives" in err.evalue
        assert re.search(r"Tensor shapes: (10vs 20|20vs 10)", err.evalue), err.evalue
    assert "--check-collectives" not in result.failure_message()
    assert_all_alive_and_working(cluster, pids)
    assert cluster.pull("kept") == {0: 0, 1: 1}
    # the same in a tensor-parallel layer, whose all_reduce is checked before it is queued
    cluster.run(TENSOR_PARALLEL).raise_for_errors()
    result = cluster.run(UNEVEN_BATCHES, timeout=30)
    assert sorted(e.rank for e in result.root_causes()) == [0, 1], result.failure_message()
    for err in result.errors.values():
        assert "Detected mismatch between collectives" in err.evalue
        assert re.search(r"Tensor shapes: (2 4vs 3 4|3 4vs 2 4)", err.evalue), err.evalue
    assert_all_alive_and_working(cluster, pids)
    trained = cluster.run("y = net(torch.ones(2, 8))\n(kept, tuple(y.shape))", timeout=30)
    assert trained.raise_for_errors().grouped_values() == [([0], "(0, (2, 4))"),
                                                           ([1], "(10, (2, 4))")]


@needs_recorder
@pytest.mark.fsdp2
def test_fsdp2_rank_skipping_a_forward_is_named(cluster2: Cluster):
    cluster2.run(
        "from torch.distributed.fsdp import fully_shard\n"
        "net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))\n"
        "fully_shard(net)\n"
        "net(torch.ones(2, 16)).sum().backward()\n"
    ).raise_for_errors()
    pids = [p.pid for p in cluster2.ranks]
    code = "x = torch.ones(2, 16)\nif rank == 0:\n    y = net(x)\n"
    result, seconds = run_to_deadline(cluster2, code)
    first = result.report[0]
    assert first.startswith("rank 0 waits in "), result.report
    assert "of the default group (at cell line 3" in first, first
    assert "rank 1 never entered it: it finished the cell" in first
    assert seconds < 2.0, f"report {seconds:.2f} s after the deadline"
    assert result.errors[0].where == "cell line 3", result.errors[0].where
    assert_all_alive_and_working(cluster2, pids)
    cluster2.run("del net").raise_for_errors()


@needs_recorder
def test_recent_collectives_side_by_side_and_the_trace_torchs_analyser_reads(cluster2: Cluster,
                                                                              tmp_path):
    cluster2.run("dist.all_reduce(torch.ones(5))\ndist.broadcast(torch.ones(7), src=0)\n"
                 ).raise_for_errors()
    table = repr(cluster2.collectives(limit=4))
    lines = table.splitlines()
    assert lines[0].split() == ["group", "#", "rank", "0", "rank", "1"], table
    assert re.search(r"default group\s+\d+\s+all_reduce \[5\]\s+all_reduce \[5\]", table), table
    assert re.search(r"default group\s+\d+\s+broadcast \[7\]\s+broadcast \[7\]", table), table
    paths = cluster2.save_collectives_trace(tmp_path / "trace", stacks=False)
    assert [os.path.basename(p) for p in paths] == ["nbdist_fr_rank0", "nbdist_fr_rank1"]
    analysed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
         str(tmp_path / "trace"), "--prefix", "nbdist_fr_rank", "-o", str(tmp_path / "db")],
        capture_output=True, text=True, timeout=120)
    assert analysed.returncode == 0, analysed.stderr[-2000:]
    with open(tmp_path / "db", "rb") as db_file:
        _types, db = pickle.load(db_file)
    matched = {(c.collective_name, tuple(map(tuple, c.input_sizes)), c.pass_check)
               for c in db.collectives}
    assert ("nccl:all_reduce", ((5,),), True) in matched or ("gloo:all_reduce", ((5,),), True) \
        in matched, matched
    assert [(g.desc, g.size) for g in db.groups] == [("default group", 2)], db.groups


def test_recent_collectives_without_the_flight_recorder(fast_config, assert_all_gone):
    """torch before 2.13, or the buffer turned off: the table comes from what the cells called
    (tutorial 10 showed a UsageError there instead, on torch 2.11)."""
    config = fast_config.replace(flight_recorder_entries=0)
    cluster = Cluster(n=2, config=config).start()
    try:
        cluster.run("dist.all_reduce(torch.ones(5))\ng = dist.new_group([0, 1])\n"
                    "dist.broadcast(torch.ones(7, dtype=torch.int64), src=0, group=g)\n"
                    ).raise_for_errors()
        table = repr(cluster.collectives(limit=4))
        # seq 1 of the default group is nbdist's own check of the new group, as in the recorder
        assert re.search(r"default group\s+2\s+all_reduce \[5\]\s+all_reduce \[5\]", table), table
        assert re.search(r"group \(ranks 0, 1\)\s+1\s+broadcast \[7\]\s+broadcast \[7\]",
                         table), table
        cluster.run("if rank == 0:\n    dist.all_reduce(torch.ones(3))", timeout=3)
        table = repr(cluster.collectives(limit=4))  # the group was rebuilt: its record restarts
        assert "all_reduce [5]" not in table, table
    finally:
        assert_all_gone(cluster.stop())


def test_a_ddp_model_on_a_group_the_cell_destroyed_fails_fast_instead_of_hanging(
        cluster2: Cluster):
    # a pasted script's destroy_process_group(): nbdist re-forms the world, but a DDP model built
    # before still holds the old group, connected; its next backward must not wait forever
    cluster2.run("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                 "old = DDP(torch.nn.Linear(8, 8))\nkept = rank\n").raise_for_errors()
    destroyed = cluster2.run("dist.destroy_process_group()", timeout=30)
    assert any("re-formed" in a for a in destroyed.actions), destroyed.actions
    pids = [p.pid for p in cluster2.ranks]
    code = "loss = old(torch.ones(2, 8)).sum()\nif rank == 0:\n    loss.backward()\n"
    started = time.perf_counter()
    result = cluster2.run(code, timeout=DEADLINE)
    assert time.perf_counter() - started < DEADLINE + 8
    assert not any("killed" in a for a in result.actions), result.actions
    assert 0 in result.errors, result.failure_message()
    assert_all_alive_and_working(cluster2, pids)
    assert cluster2.pull("kept") == {0: 0, 1: 1}
    cluster2.run("del old").raise_for_errors()
