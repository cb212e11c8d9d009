"""ipyparallel's MPI launcher for real: Debian's Open MPI `mpiexec` starts the engines (with
mpi4py), nbdist turns them into one gloo process group. One host here; across hosts the same
launcher takes `hosts=` / a hostfile (see docs/MULTI_NODE.md).

Needs `mpiexec` and mpi4py (`.ci/extra-suites` installs them); run with ``pytest -m mpi``.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import psutil
import pytest
import torch

from nbdist import Cluster

pytestmark = pytest.mark.mpi

# root in CI containers; 4 ranks on 2 cores; no core pinning (gloo ranks share the cores)
MPI_ARGS = ["--oversubscribe", "--bind-to", "none"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


@pytest.fixture(scope="module")
def mpi_cluster(fast_config, assert_all_gone):
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed (apt-get install openmpi-bin)")
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install mpi4py)")
    cluster = Cluster(n=4, config=fast_config.replace(engine_start_timeout=120.0), launcher="mpi",
                      launcher_options={"mpi_args": MPI_ARGS})
    started = time.perf_counter()
    cluster.start()
    print(f"4 MPI-launched ranks ready in {time.perf_counter() - started:.1f} s")
    try:
        yield cluster
    finally:
        assert_all_gone(cluster.stop())  # stop() returns the PIDs it stopped


def test_mpiexec_started_the_engines_and_they_form_a_group(mpi_cluster: Cluster):
    code = ("from mpi4py import MPI\nmpi = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())\n"
            "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n")
    mpi_cluster.run(code, timeout=60).raise_for_errors()
    mpi = mpi_cluster.pull("mpi")
    assert sorted(m[0] for m in mpi.values()) == [0, 1, 2, 3] and {m[1] for m in mpi.values()} == {4}
    assert mpi_cluster.pull("t") == {r: torch.tensor([10.0]) for r in range(4)}
    # one launcher process (mpiexec) on this machine, the engines below it
    launchers = mpi_cluster.launch_mode.launchers()
    assert len(launchers) == 1 and "mpiexec" in " ".join(psutil.Process(launchers[0].pid).cmdline())
    descendants = {c.pid for c in psutil.Process(launchers[0].pid).children(recursive=True)}
    assert {p.pid for p in mpi_cluster.ranks} <= descendants
    assert mpi_cluster.master_addr == "127.0.0.1"  # one host: everything stays on loopback
    assert {p.spec.local_rank for p in mpi_cluster.ranks} == {0, 1, 2, 3}


def test_a_killed_rank_is_reported_and_restart_relaunches_mpiexec(mpi_cluster: Cluster, assert_all_gone):
    old_pids = {p.pid for p in mpi_cluster.ranks}
    old_launcher = mpi_cluster.launch_mode.launchers()[0].pid
    os.kill(mpi_cluster.ranks[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while mpi_cluster.ranks[1].state != "dead":
        mpi_cluster.poll_dead()
        assert time.monotonic() < deadline, "rank 1's death was not noticed within 20 s"
        time.sleep(0.1)
    assert "signal 9" in mpi_cluster.ranks[1].exit_detail or "exit" in mpi_cluster.ranks[1].exit_detail
    mpi_cluster.restart()
    assert not {p.pid for p in mpi_cluster.ranks} & old_pids
    assert mpi_cluster.launch_mode.launchers()[0].pid != old_launcher
    assert_all_gone(sorted(old_pids | {old_launcher}))
    mpi_cluster.run("t = torch.ones(1)\ndist.all_reduce(t)", timeout=60).raise_for_errors()
    assert mpi_cluster.pull("t") == {r: torch.tensor([4.0]) for r in range(4)}
