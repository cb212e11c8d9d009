"""The supported torch range: the floor refuses older engines at start, a feature that needs a newer
torch than the floor says so in one line at use (nbdist.prepare, and a user's own torch call that
fails the way an old torch fails). The real-engine test means something on both venvs: on the
floor's torch (.ci/floor-suite) it sees the one-line error, on a newer one FSDP2 trains on CPU."""

from __future__ import annotations

import pytest
import torch

from nbdist import Cluster, torch_support
from nbdist.torch_support import TorchTooOldError

HAS_FSDP2_CPU = torch_support.version_tuple(torch.__version__) >= torch_support.FEATURES[
    "fsdp2-cpu"].minimum


def test_version_tuple_reads_local_and_cuda_builds() -> None:
    assert torch_support.version_tuple("2.6.0+cu124") == (2, 6)
    assert torch_support.version_tuple("2.13.0+cpu") == (2, 13)
    assert torch_support.version_tuple("2.10.0a0+git1234") == (2, 10)
    with pytest.raises(ValueError, match="not a torch version"):
        torch_support.version_tuple("nightly")


def test_require_names_the_feature_and_both_versions() -> None:
    with pytest.raises(TorchTooOldError) as raised:
        torch_support.require("fsdp2-cpu", "2.6.0+cu124")
    assert str(raised.value) == ("FSDP2 (fully_shard) on CPU needs torch >= 2.7; "
                                 "this rank has 2.6.0+cu124.")
    torch_support.require("fsdp2-cpu", "2.7.1")  # new enough: no error


def test_hint_only_for_the_known_symptom_on_an_old_torch() -> None:
    symptom = ("AttributeError", "'Stream' object has no attribute 'record_event'")
    assert torch_support.hint(*symptom, "2.6.0") == (
        "FSDP2 (fully_shard) on CPU needs torch >= 2.7; this rank has 2.6.0.")
    assert torch_support.hint(*symptom, "2.13.0") is None
    assert torch_support.hint("AttributeError", "'list' object has no attribute 'x'", "2.6.0") is None


def test_floor_problem_lists_each_engine_that_is_too_old() -> None:
    assert torch_support.floor_problem({0: "2.6.0", 1: "2.13.0+cpu"}) is None
    problem = torch_support.floor_problem({0: "2.5.1", 1: "2.13.0", 2: "2.4.0+cu121"})
    assert problem == ("nbdist needs torch >= 2.6: engine 0 has 2.5.1, engine 2 has 2.4.0+cu121. "
                       "Install a newer torch in the engines' environment.")


def test_fsdp2_on_cpu_trains_or_says_which_torch_it_needs(cluster2: Cluster) -> None:
    setup = """
import torch.nn as nn
import nbdist
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
"""
    cluster2.run(setup).raise_for_errors()
    prepared = cluster2.run(
        "p = nbdist.prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), 'fsdp')\n"
        "p.backward(p.model(torch.ones(4, 8)).sum()); p.step(); 'trained'"
    )
    raw = cluster2.run(
        "from torch.distributed.fsdp import fully_shard\n"
        "m = fully_shard(nn.Linear(8, 8)); m(torch.ones(2, 8)).sum().backward(); 'trained'"
    )
    if HAS_FSDP2_CPU:
        assert prepared.grouped_values() == [([0, 1], "'trained'")], prepared.failure_message()
        assert raw.grouped_values() == [([0, 1], "'trained'")], raw.failure_message()
        return
    needed = f"FSDP2 (fully_shard) on CPU needs torch >= 2.7; this rank has {torch.__version__}."
    assert sorted(prepared.errors) == [0, 1]
    assert {e.ename for e in prepared.errors.values()} == {"TorchTooOldError"}
    assert {e.evalue for e in prepared.errors.values()} == {needed}
    assert sorted(raw.errors) == [0, 1]
    assert all(needed in e.traceback for e in raw.errors.values())
    after = cluster2.run("t = torch.ones(1); dist.all_reduce(t); t.item()")
    assert after.grouped_values() == [([0, 1], "2.0")]
