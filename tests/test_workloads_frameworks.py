"""Training code written for Hugging Face Trainer, accelerate and DeepSpeed, run unchanged on 2 CPU
ranks: under torchrun, through %dist_run, chunk by chunk as %%distributed cells, and as cells with a
typo cell between the two training cells. The per-rank losses of all four agree within 1e-5.

Needs the frameworks extra (`pip install -e ".[frameworks]"`); each test skips without its
framework. Nothing is downloaded: the models are built from configs, HF_HUB_OFFLINE=1.

    .venv/bin/python -m pytest -q -m realcode tests/test_workloads_frameworks.py   (~2 min, 2 cores)
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbdist import Cluster
from tests.workloads import runner

pytestmark = [pytest.mark.realcode, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
TYPO_CELL = "print(f'loss so far: {lossses[-1]:.4f}')"  # the extra `s` is the typo

#: test id -> (script, its arguments, the packages it imports)
FRAMEWORK_WORKLOADS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "hf_trainer": ("hf_trainer.py", [], ("transformers", "accelerate")),
    "accelerate_loop": ("accelerate_loop.py", [], ("transformers", "accelerate")),
    "deepspeed_zero2": ("deepspeed_zero.py", ["--stage", "2"], ("deepspeed",)),
    "deepspeed_zero3": ("deepspeed_zero.py", ["--stage", "3"], ("deepspeed",)),
}


@pytest.fixture(scope="module")
def two_ranks(fast_config) -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as env:  # the ranks and torchrun's children inherit these
        env.setenv("HF_HUB_OFFLINE", "1")
        # DeepSpeed's ops prebuilt by .ci/prebuild-ops: never built in a test
        env.setenv("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
        cluster = Cluster(n=2, threads=1, config=fast_config).start()
        try:
            yield cluster
        finally:
            cluster.stop()


def run_as_cells(
    cluster: Cluster, script: Path, args: list[str], out_dir: Path, typo: bool
) -> None:
    """Every `# %%` chunk as one cell, the script's arguments in sys.argv; with ``typo`` a cell
    that fails with a NameError on every rank runs between the first and second training cells."""
    cluster.run(
        f"import os, sys\nos.environ['NBDIST_WORKLOAD_OUT'] = {str(out_dir)!r}\n"
        f"sys.argv = {[script.name, *args]!r}"
    ).raise_for_errors()
    chunks = runner.split_cells(script)
    assert len(chunks) == 3, f"{script.name}: setup, training, training + losses file"
    try:
        for index, chunk in enumerate(chunks):
            if typo and index == 2:
                failed = cluster.run(TYPO_CELL)
                assert sorted(failed.errors) == [0, 1], failed
                assert all(e.ename == "NameError" for e in failed.errors.values()), failed
            cluster.run(chunk, timeout=300).raise_for_errors()
    finally:
        cluster.run("sys.argv = ['']").raise_for_errors()


def four_ways(cluster: Cluster, test_id: str, tmp_path: Path) -> dict[str, dict[int, list[float]]]:
    name, args, _packages = FRAMEWORK_WORKLOADS[test_id]
    script = runner.workload_path(name)
    ways = ("torchrun", "dist_run", "cells", "cells_with_typo")
    outs = {way: tmp_path / way for way in ways}
    for out in outs.values():
        out.mkdir()
    runner.run_torchrun(script, 2, args, outs["torchrun"], timeout=300)
    dist_run_args = [*args, "--out", str(outs["dist_run"])]
    cluster.run_script(str(script), dist_run_args, timeout=300).raise_for_errors()
    run_as_cells(cluster, script, args, outs["cells"], typo=False)
    run_as_cells(cluster, script, args, outs["cells_with_typo"], typo=True)
    return {way: runner.read_losses(out) for way, out in outs.items()}


def _installed(test_id: str) -> pytest.MarkDecorator:
    """Skip without the workload's frameworks; find_spec, not importorskip: importing deepspeed
    in pytest would change its environment, and no cluster starts for a skipped test."""
    packages = FRAMEWORK_WORKLOADS[test_id][2]
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f'{", ".join(missing)} not installed: pip install -e ".[frameworks]"')


@pytest.mark.parametrize("test_id", [
    pytest.param(test_id, marks=_installed(test_id)) for test_id in FRAMEWORK_WORKLOADS
])
def test_framework_losses_equal_torchrun_and_survive_a_typo(
    two_ranks: Cluster, test_id: str, tmp_path: Path
) -> None:
    losses = four_ways(two_ranks, test_id, tmp_path)
    expected = losses["torchrun"]
    assert sorted(expected) == [0, 1] and all(len(per_rank) >= 6 for per_rank in expected.values())
    for way in ("dist_run", "cells", "cells_with_typo"):
        runner.assert_losses_close(expected, losses[way], rel=1e-5)
    # the second training cell continued the first one's model: its losses are lower on average
    first, *_ = expected.values()
    half = len(first) // 2
    assert sum(first[half:]) < sum(first[:half]), first
    if test_id == "accelerate_loop":  # accelerator.gather gave each rank both ranks' losses
        for rank in (0, 1):
            evaluation_file = tmp_path / "cells_with_typo" / f"eval-rank{rank}.json"
            evaluation = json.loads(evaluation_file.read_text())
            assert evaluation["gathered_losses"] == [losses["cells_with_typo"][r] for r in (0, 1)]
            assert 0.5 < evaluation["accuracy"] <= 1.0
    # the process group still works after the script's own teardown
    two_ranks.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                  "assert t.item() == 2").raise_for_errors()

