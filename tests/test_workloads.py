"""Public-example-style distributed PyTorch code, run three ways with equal losses (issue 13):
under torchrun, through %dist_run unchanged, and pasted chunk by chunk into %%distributed cells.
DDP, FSDP2 + DCP save/resume, DeviceMesh tensor and sequence parallel, an RPC parameter server
with DDP trainers on 4 ranks, a minGPT-style Trainer resuming from its snapshot, and Lightning
(a Fabric loop and a Trainer fit, "ddp"; skipped without Lightning) with a typo cell between two
training cells.

    .venv/bin/python -m pytest -q -m realcode tests/test_workloads.py   (~5 min on 2 cores)
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest

from nbdist import Cluster
from tests.workloads import runner

pytestmark = [pytest.mark.realcode, pytest.mark.timeout(900)]

TWO_RANKS = ["ddp.py", "fsdp2_dcp.py", "tensor_parallel.py"]


@pytest.fixture(scope="module")
def two_ranks(fast_config) -> Iterator[Cluster]:
    cluster = Cluster(n=2, threads=1, config=fast_config).start()
    try:
        yield cluster
    finally:
        cluster.stop()


TYPO = "settings = {}\nsettings['lr']"


def run_as_cells(cluster: Cluster, script: Path, out_dir: Path,
                 typo_before: int | None = None) -> None:
    """Every `# %%` chunk as one cell, in order; the options' defaults are the tests' values.
    `typo_before`: a cell with a typo runs before that chunk, and must change nothing."""
    cluster.run(f"import os\nos.environ['NBDIST_WORKLOAD_OUT'] = {str(out_dir)!r}").raise_for_errors()
    for index, chunk in enumerate(runner.split_cells(script)):
        if index == typo_before:
            typo = cluster.run(TYPO)
            assert sorted(typo.errors) == [0, 1] and typo.errors[0].ename == "KeyError"
            assert not typo.actions, f"the group was touched after a typo: {typo.actions}"
        cluster.run(chunk, timeout=300).raise_for_errors()


def three_ways(cluster: Cluster, name: str, tmp_path: Path,
               typo_before: int | None = None) -> dict[str, dict[int, list[float]]]:
    script = runner.workload_path(name)
    outs = {way: tmp_path / way for way in ("torchrun", "dist_run", "cells")}
    for out in outs.values():
        out.mkdir()
    runner.run_torchrun(script, runner.WORKLOADS[name], [], outs["torchrun"], timeout=300)
    cluster.run_script(str(script), ["--out", str(outs["dist_run"])], timeout=300).raise_for_errors()
    run_as_cells(cluster, script, outs["cells"], typo_before)
    return {way: runner.read_losses(out) for way, out in outs.items()}


@pytest.mark.parametrize("name", TWO_RANKS)
def test_losses_equal_torchrun_three_ways(two_ranks: Cluster, name: str, tmp_path: Path) -> None:
    losses = three_ways(two_ranks, name, tmp_path)
    assert losses["torchrun"] and all(losses["torchrun"].values())
    runner.assert_losses_close(losses["torchrun"], losses["dist_run"], rel=1e-5)
    runner.assert_losses_close(losses["torchrun"], losses["cells"], rel=1e-5)
    # the script's own destroy_process_group was honoured and the group re-formed after it
    two_ranks.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2").raise_for_errors()


@pytest.mark.skipif(find_spec("lightning") is None,
                    reason="Lightning is not installed (the frameworks extra)")
@pytest.mark.parametrize("name", ["lightning_fabric.py", "lightning_trainer.py"])
def test_lightning_three_ways_with_a_typo_between_training_cells(
        two_ranks: Cluster, name: str, tmp_path: Path) -> None:
    """The typo runs between the two training chunks: the cells' losses after it still equal
    torchrun's, so training went on with the same model."""
    losses = three_ways(two_ranks, name, tmp_path, typo_before=2)
    assert all(len(per_rank) == 20 for per_rank in losses["torchrun"].values())
    runner.assert_losses_close(losses["torchrun"], losses["dist_run"], rel=1e-5)
    runner.assert_losses_close(losses["torchrun"], losses["cells"], rel=1e-5)


def test_trainer_snapshot_resumes_three_ways(two_ranks: Cluster, tmp_path: Path) -> None:
    script = runner.workload_path("trainer_snapshot.py")
    runs: dict[str, list[dict[int, list[float]]]] = {}
    for way in ("torchrun", "dist_run", "cells"):
        out = tmp_path / way
        out.mkdir()
        runs[way] = []
        for _ in range(2):  # the second run resumes from {out}/snapshot.pt
            if way == "torchrun":
                runner.run_torchrun(script, 2, [], out, timeout=300)
            elif way == "dist_run":
                two_ranks.run_script(str(script), ["--out", str(out)], timeout=300).raise_for_errors()
            else:
                run_as_cells(two_ranks, script, out)
            runs[way].append(runner.read_losses(out))
    for way in ("dist_run", "cells"):
        for first, second in zip(runs["torchrun"], runs[way], strict=True):
            runner.assert_losses_close(first, second, rel=1e-5)
    assert runs["torchrun"][0] != runs["torchrun"][1]  # the second run trained on, not anew


def test_rpc_parameter_server_three_ways(fast_config, tmp_path: Path) -> None:
    """4 ranks. torch keeps one RRef context per process, bound to its first RPC agent, so the
    RPC run needs fresh engines between the two notebook ways: %dist_restart."""
    script = runner.workload_path("rpc_parameter_server.py")
    outs = {way: tmp_path / way for way in ("torchrun", "dist_run", "cells")}
    for out in outs.values():
        out.mkdir()
    runner.run_torchrun(script, 4, [], outs["torchrun"], timeout=300)
    cluster = Cluster(n=4, threads=1, config=fast_config).start()
    try:
        cluster.run_script(str(script), ["--out", str(outs["dist_run"])], timeout=300).raise_for_errors()
        cluster.restart()
        run_as_cells(cluster, script, outs["cells"])
    finally:
        cluster.stop()
    expected = runner.read_losses(outs["torchrun"])
    assert sorted(expected) == [2, 3]  # the trainers
    runner.assert_losses_close(expected, runner.read_losses(outs["dist_run"]), rel=1e-5)
    runner.assert_losses_close(expected, runner.read_losses(outs["cells"]), rel=1e-5)
