"""Several hosts on one machine (tests/netns_hosts.py: network namespaces, each with its own
address, hostname and sshd): ipyparallel's SSH launcher starts the engines on the hosts over real
ssh; the ranks form one gloo process group across them and take their cells over the encrypted
cell channel, and tests/rank_parity.py checks they behave as local ranks do.

Needs root, iproute2, OpenSSH server and client (`.ci/extra-suites` installs them); skipped with
the reason otherwise. Run with ``pytest -m multihost``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from nbdist import Cluster
from nbdist.cluster.launchers import MultiHostWarning
from tests import rank_parity
from tests.netns_hosts import (
    HOSTS,
    SOURCE,
    Network,
    hosts_network,
    ssh_launcher_options,
    why_not,
)

pytestmark = pytest.mark.multihost

ALL_REDUCE = "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()"


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    reason = why_not()
    if reason:
        pytest.skip(reason)
    with hosts_network() as net:
        yield net


@pytest.fixture(scope="module")
def cluster(network: Network, fast_config, assert_all_gone) -> Iterator[Cluster]:
    cluster = Cluster(n=4, config=fast_config.replace(engine_start_timeout=120.0), launcher="ssh",
                      launcher_options=ssh_launcher_options(network))
    started = time.perf_counter()
    with pytest.warns(MultiHostWarning, match="unauthenticated"):
        cluster.start()
    print(f"4 ranks on 2 hosts started in {time.perf_counter() - started:.1f} s")
    try:
        yield cluster
    finally:
        assert_all_gone(cluster.stop())  # stop() returns the PIDs it stopped
        deadline = time.monotonic() + 15
        leftovers: list[int] = []
        while time.monotonic() < deadline:
            leftovers = [pid for h in network.hosts for pid in network.pids_in(h)
                         if h.sshd is None or pid != h.sshd.pid]
            leftovers = [p for p in leftovers if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            if not leftovers:
                break
            time.sleep(0.2)
        assert not leftovers, f"engines left on the hosts after stop: {leftovers}"


def _rank_facts(cluster: Cluster) -> dict[int, dict[str, str]]:
    code = ("import os, socket\nfacts = {'host': socket.gethostname(), **{k: os.environ.get(k, '')"
            " for k in ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'WORLD_SIZE', 'MASTER_ADDR',"
            " 'GLOO_SOCKET_IFNAME')}}")
    cluster.run(code, timeout=60).raise_for_errors()
    return cluster.pull("facts")


def _check_layout(cluster: Cluster, network: Network) -> dict[int, dict[str, str]]:
    facts = _rank_facts(cluster)
    by_host: dict[str, list[int]] = {}
    for rank, f in sorted(facts.items()):
        by_host.setdefault(f["host"], []).append(rank)
        assert f["RANK"] == str(rank) and f["WORLD_SIZE"] == "4"
        assert f["host"] == cluster.ranks[rank].spec.host
        assert f["GLOO_SOCKET_IFNAME"] == "eth0"
    assert sorted(by_host) == sorted(HOSTS)
    for ranks in by_host.values():
        assert len(ranks) == 2 and ranks == sorted(ranks) and ranks[1] == ranks[0] + 1
        assert [facts[r]["LOCAL_RANK"] for r in ranks] == ["0", "1"]
        assert {facts[r]["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    rank0_host = next(h for h in network.hosts if h.name == facts[0]["host"])
    assert {f["MASTER_ADDR"] for f in facts.values()} == {rank0_host.address}
    return facts


def test_four_ranks_across_two_hosts(cluster: Cluster, network: Network):
    result = cluster.run(ALL_REDUCE, timeout=60).raise_for_errors()
    assert result.grouped_values() == [([0, 1, 2, 3], "10.0")]
    _check_layout(cluster, network)
    status = cluster.status()
    assert {row.host for row in status.rows} == set(HOSTS)
    assert "hosta" in status.table() and "hostb" in status.table()
    # the rendezvous is rank 0's address on the private network, not the head node's or loopback
    assert cluster.master_addr in {h.address for h in network.hosts}
    assert not any(p.local for p in cluster.ranks)


def test_controller_listens_on_the_private_network_only(cluster: Cluster, network: Network):
    assert cluster._processes.controller is not None
    controller = psutil.Process(cluster._processes.controller[0])
    addrs = {c.laddr.ip for c in controller.net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN}
    assert addrs and addrs <= {network.head_address}, addrs


def test_hung_remote_rank_is_interrupted_through_the_controller(cluster: Cluster):
    """Remote PIDs cannot be signalled from here: the deadline's SIGINT goes by the engine's nanny."""
    started = time.perf_counter()
    result = cluster.run("import time\nif rank == 3:\n    while True:\n        time.sleep(0.01)\n",
                         timeout=5)
    elapsed = time.perf_counter() - started
    assert result.timed_out and 3 in result.errors
    assert result.errors[3].kind in ("interrupted", "timeout"), result.failure_message()
    assert elapsed < 20, f"the deadline ladder took {elapsed:.1f} s"
    assert all(p.state == "alive" for p in cluster.ranks)  # SIGINT was enough: nobody killed
    cluster.run(ALL_REDUCE, timeout=60).raise_for_errors()
    assert cluster.pull("t") == {r: torch.tensor([10.0]) for r in range(4)}


def test_the_cell_channel_spans_the_hosts_encrypted(cluster: Cluster, network: Network):
    """Cells reach the remote ranks over the cell channel: the notebook listens on the head
    node's private address, each rank on its host's, both ends CurveZMQ-encrypted; the engines
    run the nbdist under test."""
    channel = cluster.cell_channel
    assert channel is not None and channel.address.startswith(f"tcp://{network.head_address}:")
    assert channel.public_key is not None
    for proc in cluster.ranks:
        host = next(h for h in network.hosts if h.name == proc.spec.host)
        assert proc.endpoint is not None and proc.endpoint.public_key is not None
        assert proc.endpoint.address.startswith(f"tcp://{host.address}:")
    files = cluster.run("import nbdist\nnbdist.__file__", timeout=60).raise_for_errors()
    assert {files.value_text(r).strip("'") for r in files.ranks} == {
        os.path.join(SOURCE, "nbdist", "__init__.py")}


def test_parity_top_level_await(cluster: Cluster):
    rank_parity.check_top_level_await(cluster)


@pytest.mark.parametrize("code", ["import time\nfor _ in range(600): time.sleep(0.05)",
                                  "import asyncio\nawait asyncio.sleep(600)"],
                         ids=["sync", "await"])
def test_parity_stop_button(cluster: Cluster, code: str):
    rank_parity.check_stop_button(cluster, code)


def test_parity_breakpoint_on_a_remote_rank(cluster: Cluster, monkeypatch: pytest.MonkeyPatch):
    rank_parity.check_breakpoint(cluster, monkeypatch, rank=3)


def test_parity_widget_on_a_remote_rank(cluster: Cluster, monkeypatch: pytest.MonkeyPatch):
    rank_parity.check_widget(cluster, monkeypatch, rank=2)


def test_one_host_killed_is_reported_and_restart_brings_it_back(cluster: Cluster, network: Network):
    facts = _rank_facts(cluster)
    victim = next(h for h in network.hosts if h.name != facts[0]["host"])
    victim_ranks = sorted(r for r, f in facts.items() if f["host"] == victim.name)
    old_pids = {p.pid for p in cluster.ranks}
    old_hosts = {p.spec.rank: p.spec.host for p in cluster.ranks}

    def kill_host() -> None:
        # every engine on that host and what it started (nanny, helpers); sshd stays up so
        # that restart can start new engines there
        doomed: list[psutil.Process] = []
        for pid in network.pids_in(victim):
            try:
                proc = psutil.Process(pid)
                if any("nbdist.worker.engine" in part for part in proc.cmdline()):
                    doomed += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        assert len([p for p in doomed if "nbdist.worker.engine" in " ".join(p.cmdline())]) >= 2
        for proc in doomed:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass

    import threading

    timer = threading.Timer(3.0, kill_host)
    timer.start()
    started = time.perf_counter()
    try:
        result = cluster.run(
            "import time\nfor i in range(600):\n    t = torch.ones(1)\n    dist.all_reduce(t)\n"
            "    time.sleep(0.05)\n", timeout=90)
    finally:
        timer.join()
    elapsed = time.perf_counter() - started
    assert elapsed < 30, f"a dead host took {elapsed:.1f} s to report"
    for rank in victim_ranks:
        assert result.errors[rank].kind == "dead", result.failure_message()
        assert victim.name in result.errors[rank].evalue
    states = {row.rank: row.state for row in cluster.status().rows}
    assert all(states[r].startswith("dead") for r in victim_ranks), states
    print(f"host {victim.name} (ranks {victim_ranks}) reported dead after {elapsed:.1f} s")

    started = time.perf_counter()
    cluster.restart()
    print(f"restart across hosts took {time.perf_counter() - started:.1f} s")
    assert not {p.pid for p in cluster.ranks} & old_pids
    assert {p.spec.rank: p.spec.host for p in cluster.ranks} == old_hosts  # ranks stay on hosts
    cluster.run(ALL_REDUCE, timeout=60).raise_for_errors()
    assert cluster.pull("t") == {r: torch.tensor([10.0]) for r in range(4)}
    _check_layout(cluster, network)


def test_kernel_killed_ends_the_engines_on_every_host(network: Network, tmp_path):
    """No cleanup runs in a SIGKILLed kernel and the engines on the hosts are not its to kill by
    PID: each sees its cell channel's notebook end go and ends itself, its children with it."""
    import subprocess
    import sys

    script = tmp_path / "kernel.py"
    script.write_text(
        "from nbdist import Cluster, NbdistConfig\n"
        f"c = Cluster(n=4, launcher='ssh', launcher_options={ssh_launcher_options(network)!r},\n"
        "            config=NbdistConfig(engine_start_timeout=120.0)).start()\n"
        "c.run(\"import subprocess\\nchild = subprocess.Popen(['sleep', '600']).pid\").raise_for_errors()\n"
        "print('PIDS', *[p.pid for p in c.ranks], *c.pull('child').values(), flush=True)\n"
        "import time; time.sleep(600)\n")
    others = {pid for h in network.hosts for pid in network.pids_in(h)}  # sshd, other clusters
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": SOURCE})
    try:
        line = next(line for line in kernel.stdout if line.startswith("PIDS"))
        engines = [int(p) for p in line.split()[1:]]
        on_hosts = {pid for h in network.hosts for pid in network.pids_in(h)}
        assert len(engines) == 8 and set(engines) <= on_hosts, (engines, on_hosts)
        kernel.kill()
        killed = time.perf_counter()
        kernel.wait(timeout=10)
        deadline = time.monotonic() + 20
        left: list[int] = []
        while time.monotonic() < deadline:
            left = [pid for h in network.hosts for pid in network.pids_in(h)
                    if pid not in others and _living(pid)]
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"left on the hosts after the kernel's SIGKILL: {left}"
        print(f"every process on the hosts gone {time.perf_counter() - killed:.2f} s after the "
              "kernel's SIGKILL")
    finally:
        if kernel.poll() is None:
            kernel.kill()


def _living(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it exited between the listing and the look
        return False
