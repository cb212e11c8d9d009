"""The warm cluster: engines forked from one fork server that imported torch once,
kept across restarts; a killed fork server falls back to cold engines with a message; a dead rank
replaced alone while the living ranks keep a trained model. Real engines, real process groups.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest
from IPython.core.error import UsageError

from nbdist import Cluster, ipp_compat
from nbdist.cluster import fork_launcher
from nbdist.notebook import magics
from nbdist.worker.engine import ForkedEngine

ALL_REDUCE = "_t = torch.ones(8) * (rank + 1)\ndist.all_reduce(_t)\nfloat(_t[0])"
TRAIN = """
import torch.nn as nn
torch.manual_seed(0)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(rank))
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
trained = model.weight.detach().clone()
"""


def _values(cluster: Cluster, code: str) -> dict[int, str | None]:
    result = cluster.run(code).raise_for_errors()
    return {rank: result.value_text(rank) for rank in result.ranks}


def _parents(cluster: Cluster) -> set[int]:
    return {psutil.Process(p.pid).ppid() for p in cluster.ranks}


def _server_pid(cluster: Cluster) -> int:
    server = cluster.launch_mode.fork_server
    assert server is not None and server.pid is not None, "a local cluster starts a fork server"
    return server.pid


def test_engines_are_forked_and_the_server_outlives_a_restart(cluster_factory: Any) -> None:
    cluster = cluster_factory(2)
    server = _server_pid(cluster)
    assert _parents(cluster) == {server}
    assert _values(cluster, ALL_REDUCE) == {0: '3.0', 1: '3.0'}
    old = {p.pid for p in cluster.ranks}
    cluster.restart()
    assert not old & {p.pid for p in cluster.ranks}
    assert _server_pid(cluster) == server and _parents(cluster) == {server}
    assert _values(cluster, ALL_REDUCE) == {0: '3.0', 1: '3.0'}
    # a fork copies the server's random state: numpy's is reseeded in each engine
    draws = _values(cluster, "import numpy as np\nfloat(np.random.rand())")
    assert draws[0] != draws[1]
    # a rank is no multiprocessing child of the notebook: libraries that branch on it see a main
    names = _values(cluster, "import multiprocessing as mp\nmp.current_process().name")
    assert set(names.values()) == {"'MainProcess'"}
    import multiprocessing

    assert not multiprocessing.active_children()
    assert server in cluster.all_pids()
    # fork safety, seen from outside: the server that engines fork from runs one thread (Python's
    # or a library's) and has not loaded the CUDA driver (which torch loads only to use a GPU)
    process = psutil.Process(server)
    assert process.num_threads() == 1
    assert not [m.path for m in process.memory_maps() if "libcuda.so" in m.path
                or m.path.startswith("/dev/nvidia")]
    assert {child.pid for child in process.children()} == {p.pid for p in cluster.ranks}
    # it forks nbdist's engine and nothing else, for no one else: its socket is the owner's only
    socket_path = cluster.launch_mode.fork_server.socket_path
    assert stat.S_IMODE(os.stat(socket_path).st_mode) & 0o077 == 0
    with pytest.raises(fork_launcher.ForkServerUnavailable, match="only starts nbdist.worker"):
        fork_launcher.fork(socket_path, ForkedEngine(["python", "-c", "pass"], {}, "", ""), 5.0)


class _Sleeper(ipp_compat.ForkserverChild):
    def run(self) -> int:
        time.sleep(120)
        return 0


_KERNEL = """
import sys
import time
from nbdist import ipp_compat
from nbdist.cluster.fork_launcher import ForkServerProcess
from tests.test_warm_cluster import _Sleeper
server = ForkServerProcess(sys.argv[1], sys.executable)
_status, engine = ipp_compat.forkserver_fork(server.socket_path, _Sleeper(), 120)
print(server.pid, engine, flush=True)
time.sleep(120)
"""


def test_the_fork_server_ends_with_the_kernel_even_while_an_engine_lives(tmp_path: Any) -> None:
    kernel = subprocess.Popen([sys.executable, "-c", _KERNEL, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    assert kernel.stdout is not None
    server, engine = map(int, kernel.stdout.readline().split())
    kernel.stdout.close()
    try:
        assert psutil.Process(engine).ppid() == server
        kernel.kill()
        kernel.wait(10)
        deadline = time.monotonic() + 20
        while _running(server):
            assert time.monotonic() < deadline, "the fork server outlived its kernel by 20 s"
            time.sleep(0.05)
        assert _running(engine)  # the server's end is its own, not its engines' end
    finally:
        for pid in (engine, server):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:  # an orphan may wait as init's zombie
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_dead_fork_server_means_cold_engines_and_a_message(cluster_factory: Any) -> None:
    cluster = cluster_factory(2)
    server = _server_pid(cluster)
    os.kill(server, signal.SIGKILL)
    said: list[str] = []
    cluster.restart(progress=said.append)
    text = "\n".join(said)
    assert f"the fork server (pid {server}) killed by signal 9" in text
    assert "starting the engines cold instead" in text
    assert server not in _parents(cluster)
    assert _values(cluster, ALL_REDUCE) == {0: '3.0', 1: '3.0'}


def test_fork_server_off_starts_engines_cold(cluster_factory: Any, fast_config: Any) -> None:
    cluster = cluster_factory(2, config=fast_config.replace(fork_server=False))
    assert cluster.launch_mode.fork_server is None
    assert _parents(cluster) == {os.getpid()}
    assert _values(cluster, ALL_REDUCE) == {0: '3.0', 1: '3.0'}


def test_replace_dead_keeps_the_living_ranks_trained_model(cluster_factory: Any) -> None:
    cluster = cluster_factory(3)
    cluster.run(TRAIN).raise_for_errors()
    before = cluster.pull("trained")
    generation = cluster.generation
    victim = cluster.ranks[1].pid
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while cluster.ranks[1].state != "dead" and time.monotonic() < deadline:
        cluster.poll_dead()
        time.sleep(0.05)
    said: list[str] = []
    assert cluster.replace_dead(progress=said.append) == [1]
    assert "rank(s) 0, 2 keep their state" in said[0]
    assert cluster.ranks[1].pid != victim and cluster.ranks[1].state == "alive"
    assert cluster.generation == generation + 1
    assert _values(cluster, ALL_REDUCE) == {0: '6.0', 1: '6.0', 2: '6.0'}
    after = cluster.pull("trained", ranks=[0, 2])
    for rank in (0, 2):
        assert after[rank].equal(before[rank])
    assert _values(cluster, "'trained' in globals()") == {0: "True", 1: "False", 2: "True"}
    assert cluster.replace_dead() == []  # nothing dead: nothing to do


def test_replace_dead_refuses_when_every_rank_is_dead(cluster_factory: Any) -> None:
    cluster = cluster_factory(2)
    for proc in cluster.ranks:
        os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(p.state != "dead" for p in cluster.ranks) and time.monotonic() < deadline:
        cluster.poll_dead()
        time.sleep(0.05)
    with pytest.raises(Exception, match="every rank is dead: nothing is left to keep"):
        cluster.replace_dead()
    cluster.restart()  # the full restart still works
    assert _values(cluster, ALL_REDUCE) == {0: '3.0', 1: '3.0'}


def test_dist_restart_dead_magic(ip: Any, capsys: pytest.CaptureFixture[str],
                                 assert_all_gone: Any) -> None:
    with pytest.raises(UsageError, match="unrecognized arguments: --deadly"):
        ip.run_line_magic("dist_restart", "--deadly")
    ip.run_line_magic("dist_start", "-n 2 --threads 1")
    cluster = magics.current_cluster()
    assert cluster is not None
    try:
        capsys.readouterr()
        ip.run_line_magic("dist_restart", "--dead")
        assert "no rank is dead: nothing to replace" in capsys.readouterr().out
        os.kill(cluster.ranks[0].pid, signal.SIGKILL)
        time.sleep(0.3)
        ip.run_line_magic("dist_restart", "--dead")
        out = capsys.readouterr().out
        assert "replaced rank(s) 0 in" in out and "rank(s) 0 start empty" in out
        ip.run_cell_magic("distributed", "", "dist.barrier()")
    finally:
        pids = cluster.all_pids()
        ip.run_line_magic("dist_stop", "")
    assert_all_gone(pids)


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "cold"])
def test_stop_leaves_no_private_directory(forked: bool, fast_config: Any,
                                          assert_all_gone: Any) -> None:
    # ipyparallel rewrites the cluster file when an engine's wait thread reports its exit: one
    # reported after the directory was removed would leave profile/security/cluster-*.json behind
    cluster = Cluster(n=2, config=fast_config.replace(fork_server=forked)).start()
    workdir = cluster.workdir
    cluster.restart()
    assert_all_gone(cluster.stop())
    assert not os.path.exists(workdir), sorted(os.listdir(workdir))
