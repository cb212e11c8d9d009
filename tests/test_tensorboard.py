"""`Cluster(tensorboard=DIR)` / `%dist_start --tensorboard DIR`: every rank's `nbdist.log` values
land in one run directory as per-rank scalars, read back with TensorBoard's own event reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nbdist.errors import NbdistError

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator", reason="needs the test extra")

TRAIN = """
import nbdist
for step in range(40):
    nbdist.log(step=step, loss=100.0 * rank + step, lr=0.1)
"""


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = event_accumulator.EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_every_rank_value_is_in_one_run_directory(cluster_factory: Any, tmp_path: Path) -> None:
    cluster = cluster_factory(2, tensorboard=tmp_path)
    run_dir = cluster.tensorboard.run_dir
    assert run_dir.parent == tmp_path.resolve()
    cluster.run(TRAIN, timeout=60).raise_for_errors()
    cluster.run(TRAIN.replace("range(40)", "range(40, 50)"), timeout=60).raise_for_errors()
    scalars = _scalars(run_dir)
    assert sorted(scalars) == ["loss/rank0", "loss/rank1", "lr/rank0", "lr/rank1"]
    for rank in (0, 1):
        assert scalars[f"loss/rank{rank}"] == [(s, 100.0 * rank + s) for s in range(50)]
    assert [p.parent for p in tmp_path.rglob("events.out.tfevents.*")] == [run_dir]
    # stop closes the file; a cluster started again writes on into the same run
    cluster.stop()
    cluster.start()
    cluster.run(TRAIN.replace("range(40)", "range(50, 52)"), timeout=60).raise_for_errors()
    assert [s for s, _ in _scalars(run_dir)["loss/rank1"]][-3:] == [49, 50, 51]
    # a rank that dies keeps what it had sent: the kernel wrote it as it arrived
    dying = ("import os, time, nbdist\nfor s in range(60, 70): nbdist.log(step=s, loss=-1.0)\n"
             "time.sleep(1.0)\nif rank == 1: os._exit(3)\ntime.sleep(1.0)")
    result = cluster.run(dying, timeout=60)
    assert result.errors and 1 in result.errors, result.errors
    assert [s for s, _ in _scalars(run_dir)["loss/rank1"]][-10:] == list(range(60, 70))


def test_a_bad_directory_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from nbdist import Cluster

    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(NbdistError, match="--tensorboard.*is a file"):
        Cluster(n=1, tensorboard=afile)
    with pytest.raises(NbdistError, match="--tensorboard"):
        Cluster(n=1, tensorboard=3)  # type: ignore[arg-type]


def test_dist_start_tensorboard_in_a_real_kernel(real_kernel: Any, tmp_path: Path) -> None:
    reply = real_kernel.run("%load_ext nbdist\n%dist_start -n 2 --tensorboard runs")
    assert reply["status"] == "ok", real_kernel.text()[-2000:]
    assert "TensorBoard scalars go to" in real_kernel.text()
    reply = real_kernel.run("%%distributed\n" + TRAIN)
    assert reply["status"] == "ok", real_kernel.text()[-2000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    scalars = _scalars(run_dir)
    assert [v for _, v in scalars["loss/rank1"]] == [100.0 + s for s in range(40)]
    assert len(scalars["lr/rank0"]) == 40
