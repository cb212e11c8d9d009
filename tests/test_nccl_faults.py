"""The logic behind NCCL's silent failures, on CPU with real gloo engines where it can run there:
the groups' counts checked after every cell (sub-groups, point-to-point), what survives a
re-formed group (DDP models nbdist.prepare made wrapped again, the rest named), the bounded
abort, both names of the flight recorder's variables, and the ladder's wait for a rank that
waits on its GPU. The NCCL halves: tests/test_nccl_faults_cuda.py (gpu)."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from nbdist import Cluster, torch_support
from nbdist.cells.group_health import ahead_errors, nccl_errors, out_of_step
from nbdist.cells.whereabouts import desynchronised, waiting_on_device
from nbdist.worker import process_group, release
from nbdist.worker.flight_recorder import EnteredCollective

CHECK = "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nfloat(t)"


# -- the flight recorder's variables under both names ------------------------------------------
def test_the_flight_recorder_names_the_running_torch_reads_reach_every_rank(
        cluster2: Cluster) -> None:
    # torch 2.6-2.8 read only TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE;
    # later releases warn "deprecated" in every rank's log when the older names are set
    got = cluster2.run(
        "import os\n[os.environ.get(n) for n in ('TORCH_FR_BUFFER_SIZE', "
        "'TORCH_NCCL_TRACE_BUFFER_SIZE', 'TORCH_FR_DUMP_TEMP_FILE', "
        "'TORCH_NCCL_DEBUG_INFO_TEMP_FILE')]", timeout=30).raise_for_errors()
    older = not torch_support.has("flight-recorder-fr-names")
    for rank in (0, 1):
        new_size, old_size, new_file, old_file = eval(got.value_text(rank))  # a list of str
        assert new_size == "256" and old_size == ("256" if older else None)
        assert new_file.endswith(f"flight-recorder-rank{rank}/nccl_trace_rank_"), new_file
        assert old_file == (new_file if older else None)


def test_a_flight_recorder_name_the_user_set_keeps_both_unset(tmp_path) -> None:
    wanted = {process_group.BUFFER_VARIABLES: "256"}
    assert process_group._user_wins(wanted, {}, "FAULTS.md") == (
        {"TORCH_FR_BUFFER_SIZE": "256", "TORCH_NCCL_TRACE_BUFFER_SIZE": "256"}, [])
    to_set, notes = process_group._user_wins(wanted, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"},
                                             "FAULTS.md")
    assert to_set == {} and notes[0].startswith("TORCH_NCCL_TRACE_BUFFER_SIZE=10 is yours")
    assert process_group.dump_environment(
        {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/x_"}, 0, str(tmp_path)) == {}
    named = process_group.dump_environment({}, 3, str(tmp_path))
    assert set(named) == set(process_group.flight_recorder_names(
        process_group.DUMP_FILE_VARIABLES)) and len(set(named.values())) == 1


# -- every cell: the groups' counts, sub-groups and point-to-point -----------------------------
def test_a_sub_group_collective_one_rank_queued_is_found(cluster_factory, fast_config) -> None:
    # an async_op collective returns at once, as every NCCL collective does: rank 0 ends the
    # cell "ok" a collective ahead on the sub-group, which only the counts say
    cluster = cluster_factory(3, config=fast_config.replace(cell_end_collective_wait=0.0))
    cluster.run("sub = dist.new_group([0, 1])\nt = torch.ones(1)").raise_for_errors()
    result = cluster.run("if rank == 0:\n    work = dist.all_reduce(t, group=sub, "
                         "async_op=True)\nelif rank == 1:\n    raise ValueError('rank 1 stops')\n",
                         timeout=60)
    assert sorted(result.errors) == [1], result.failure_message()
    said = [a for a in result.actions if "queued different numbers of cpu collectives in group"
            in a]
    assert said and "(rank 0: 1, rank 1: 0)" in said[0] and "rebuilt" in said[0], result.actions
    assert "sub (process group (dist.new_group))" in said[0], said
    # a pipeline's uneven transfers: gloo counts them in the world's sequence numbers (1, 2, 1),
    # and every transfer is matched, so an ok cell on gloo is left alone
    chain = cluster.run("if rank < 2:\n    dist.send(t, rank + 1)\n"
                        "if rank > 0:\n    dist.recv(t, rank - 1)\n", timeout=60)
    assert chain.ok and not chain.actions, (chain.failure_message(), chain.actions)
    assert cluster.run(CHECK, timeout=60).raise_for_errors().grouped_values() == [
        ([0, 1, 2], "6.0")]


def test_point_to_point_transfers_are_counted_by_both_ends(cluster2: Cluster) -> None:
    result = cluster2.run("t = torch.ones(2)\nif rank == 0:\n    dist.send(t, 1)\n"
                          "    dist.send(t, dst=1)\nelse:\n    dist.recv(t, 0)\n"
                          "    dist.recv(t, src=0)\n", timeout=60)
    assert result.ok and not result.actions, (result.failure_message(), result.actions)
    health = {r: cluster2.telemetry.last_payload[r]["health"] for r in (0, 1)}
    assert health[0]["p2p"] == health[1]["p2p"] == {"p2p 0->1": 2}, health
    assert out_of_step(health, [0, 1]) == ""


def test_unmatched_transfers_and_sub_group_counts_are_named() -> None:
    sent_twice = {0: {"p2p": {"p2p 0->1": 2}}, 1: {"p2p": {"p2p 0->1": 1}}}
    assert desynchronised(sent_twice) == (
        "rank 0 sent 2 tensor(s) to rank 1 with dist.send; it received 1 with dist.recv")
    never_received = {0: {"p2p": {"p2p 0->1": 1}}, 1: {"p2p": {}}}
    assert "it received 0" in desynchronised(never_received)
    any_source = {0: {"p2p": {"p2p 0->1": 1}}, 1: {"p2p": {"p2p *->1": 1}}}
    assert desynchronised(any_source) == ""
    assert desynchronised({1: {"p2p": {"p2p 0->1": 1}}}) == ""  # rank 0 did not report
    mesh = {0: {"sequence": {"cuda": 4, "cuda@group mesh_tp (ranks 0, 1)": 3}},
            1: {"sequence": {"cuda": 4, "cuda@group mesh_tp (ranks 0, 1)": 2}},
            2: {"sequence": {"cuda": 4, "cuda@group mesh_tp (ranks 2, 3)": 7}}}
    assert desynchronised(mesh) == ("the ranks queued different numbers of cuda collectives in "
                                    "group mesh_tp (ranks 0, 1) (rank 0: 3, rank 1: 2)")
    assert out_of_step({0: mesh[0]}, [0, 1]) == ""  # a rank without a report: no verdict


def test_an_nccl_failure_fails_the_rank_and_names_the_collective() -> None:
    since = 100.0
    health = {
        0: {"nccl_failed": {"default group": {"error": "TIMEOUT",
                                              "collective": "all_reduce #3 of the default group"}}},
        1: {"nccl_failed": {}, "nccl_aborted_at": 101.0},
        2: {"nccl_failed": {}, "nccl_aborted_at": 99.0},
    }
    errors = nccl_errors(health, since)
    assert sorted(errors) == [0, 1]
    assert errors[0].kind == "root" and errors[0].evalue.startswith(
        "all_reduce #3 of the default group timed out: NCCL's watchdog aborted")
    assert "no value is returned" in errors[0].evalue
    assert errors[1].kind == "collective" and "nbdist aborted" in errors[1].evalue


def test_a_rank_ahead_on_an_nccl_group_fails_with_no_value() -> None:
    # NCCL returned at once from a collective its peer never reached: it can never complete
    health = {0: {"sequence": {"cpu": 2, "cuda": 5, "cuda@group 1 (ranks 0, 1)": 1}},
              1: {"sequence": {"cpu": 2, "cuda": 4, "cuda@group 1 (ranks 0, 1)": 3}}}
    errors = ahead_errors(health)
    assert sorted(errors) == [0, 1]
    assert errors[0].evalue.startswith("it queued NCCL collective #5 of the default group, "
                                       "which rank(s) 1 never reached"), errors[0].evalue
    assert "collective #2-#3 of the group 1 (ranks 0, 1)" in errors[1].evalue, errors[1].evalue
    assert errors[0].kind == "collective" and "no value is returned" in errors[0].evalue
    assert ahead_errors({0: {"sequence": {"cpu": 3}}, 1: {"sequence": {"cpu": 2}}}) == {}


# -- abort and re-form -------------------------------------------------------------------------
def test_a_reformed_group_rewraps_prepared_ddp_and_names_the_rest(cluster_factory) -> None:
    cluster = cluster_factory(2)
    cluster.run(
        "import nbdist\n"
        "prepared = nbdist.prepare(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1))\n"
        "model, opt = prepared\n"
        "plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "sub = dist.new_group([0, 1])\nt = torch.ones(1)\n").raise_for_errors()
    result = cluster.run("if rank == 1:\n    raise ValueError('rank 1 fails')\n"
                         "dist.all_reduce(t)\n", timeout=60)
    assert sorted(result.errors) == [0, 1]
    rebuilt = result.actions[-1]
    assert "rebuilt" in rebuilt and "every rank keeps its variables" in rebuilt, result.actions
    assert "DDP model(s) model, prepared wrapped again on the new group" in rebuilt, rebuilt
    assert ("these fail if used: plain (DDP model), sub (process group (dist.new_group))"
            in rebuilt), rebuilt
    step = cluster.run("loss = model(torch.ones(1, 4) * (rank + 1)).sum()\nloss.backward()\n"
                       "opt.step()\n(prepared.model is model, float(model.module.weight.grad"
                       ".sum()))", timeout=60).raise_for_errors()
    # each rank alone: 16 (rank 0) and 32 (rank 1); averaged over the new group: 24 on both
    assert step.grouped_values() == [([0, 1], "(True, 24.0)")]


def test_an_nccl_abort_that_hangs_costs_its_thread_not_the_caller(monkeypatch) -> None:
    from torch.distributed import distributed_c10d

    release_abort = threading.Event()
    monkeypatch.setattr(distributed_c10d, "_abort_process_group",
                        lambda *a: release_abort.wait(30))
    started = time.perf_counter()
    try:
        assert release.abort_nccl(0.2) is False
        assert time.perf_counter() - started < 0.2 + 1.0 + 0.5
    finally:
        release_abort.set()
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda *a: None)
    assert release.abort_nccl(0.2) is True
    for thread in threading.enumerate():
        if thread.name == "nbdist-nccl-abort":
            thread.join(5)


# -- the ladder: a rank that waits on its GPU is waited for ------------------------------------
def _cluster_seen(readings: dict[int, list[EnteredCollective]], backend: str = "nccl") -> object:
    payloads = {r: {"where": {"collective": None, "flight": flight}}
                for r, flight in readings.items()}
    return types.SimpleNamespace(backend=backend,
                                 telemetry=types.SimpleNamespace(last_payload=payloads))


def _entry(seq: int, completed: bool) -> EnteredCollective:
    return EnteredCollective(group="default group", seq=seq, op="all_reduce", sizes=((4,),),
                             dtypes=("Float",), completed=completed, since=0.0, ranks=(0, 1))


def test_a_rank_waits_on_its_gpu_unless_a_peer_never_entered_its_collective() -> None:
    # rank 0's all_reduce #5 is in flight behind queued kernels; rank 1 entered it too
    both_in = _cluster_seen({0: [_entry(5, False)], 1: [_entry(5, False)]})
    assert waiting_on_device(both_in, 0)
    # rank 1's last was #4: rank 0 waits on a peer, and the ladder must release it
    peer_absent = _cluster_seen({0: [_entry(5, False)], 1: [_entry(4, True)]})
    assert not waiting_on_device(peer_absent, 0)
    # nothing in flight: a sync behind the rank's own kernels (x.item())
    assert waiting_on_device(_cluster_seen({0: [_entry(5, True)], 1: []}), 0)
    # no reading of the recorder yet: not known, so not waited for
    assert not waiting_on_device(_cluster_seen({0: [], 1: []}), 0)
    # gloo ranks run no kernels: SIGINT reaches Python, the ladder does not wait
    assert not waiting_on_device(_cluster_seen({0: []}, backend="gloo"), 0)


def test_reading_the_groups_health_costs_microseconds(tmp_path) -> None:
    from nbdist.worker import group_health

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.distributed.new_group([0])
        started = time.perf_counter()
        for _ in range(100):
            health = group_health.health()
        per_call = (time.perf_counter() - started) / 100
    finally:
        torch.distributed.destroy_process_group()
    assert health is not None and health["sequence"]["cpu"] == 0 and health["nccl_failed"] == {}
    assert per_call < 0.002, per_call  # a no-op cell's own round trip is milliseconds


def test_an_nccl_rank_reads_both_recorders_apart(tmp_path, monkeypatch) -> None:
    # NCCL's own recorder (`_dump_nccl_trace`) exists only in a CUDA build: it stands in here as
    # a second read of gloo's, in the same format, to check how the two are merged and labelled
    import pickle

    from torch._C import _distributed_c10d as c10d

    from nbdist import torch_support
    from nbdist.worker import flight_recorder

    if not torch_support.has("flight-recorder"):
        pytest.skip("nbdist reads the flight recorder from torch 2.13")
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    monkeypatch.setattr(process_group, "GENERATION_STARTED", 0.0)
    try:
        torch.distributed.all_reduce(torch.ones(3))
        monkeypatch.setattr(flight_recorder, "_nccl_dump", lambda *_: pickle.loads(
            c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False,
                                onlyActive=False)))
        entries = flight_recorder.entries()
        progress = flight_recorder.progress()
    finally:
        torch.distributed.destroy_process_group()
    groups = sorted({e.group for e in entries})
    assert groups == ["default group", "default group (CPU tensors)"], entries
    assert [e.since for e in entries] == sorted(e.since for e in entries)
    assert {name.endswith(" (CPU tensors)") for name in progress} == {True, False}, progress
