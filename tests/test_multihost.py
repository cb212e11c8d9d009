"""Several hosts on one machine: network namespaces joined by veth pairs to a bridge, each with
its own address, its own hostname (a UTS namespace) and its own sshd. The notebook side and the
controller sit on the bridge (the "head node"); ipyparallel's SSH launcher starts the engines on
the hosts over real ssh; the ranks form one gloo process group across them.

Needs root, iproute2, OpenSSH server and client (`.ci/extra-suites` installs them); skipped with
the reason otherwise. Run with ``pytest -m multihost``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest
import torch

import nbdist
from nbdist import Cluster
from nbdist.cluster.launchers import MultiHostWarning
from tests import rank_parity

pytestmark = pytest.mark.multihost

HOSTS = ("hosta", "hostb")
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(nbdist.__file__)))
"""The tree whose nbdist this test imports: the engines over ssh import the same one."""
ALL_REDUCE = "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()"


@dataclass
class Host:
    name: str
    netns: str
    address: str
    sshd: subprocess.Popen[bytes] | None = None


@dataclass
class Network:
    bridge: str
    head_address: str
    hosts: list[Host]
    ssh_args: list[str]
    workdir: str
    created_netns: list[str] = field(default_factory=list)

    def pids_in(self, host: Host) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen", "scp"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not os.path.exists("/usr/sbin/sshd"):
        return "OpenSSH server (/usr/sbin/sshd) not installed"
    probe = f"nbdprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _wait_for_port(address: str, port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not listen on {address}:{port}: {exc}") from None
            time.sleep(0.1)


def _sshd_config(workdir: str, host: Host) -> str:
    path = os.path.join(workdir, f"sshd-{host.name}.conf")
    with open(path, "w") as f:
        f.write(
            f"ListenAddress {host.address}\nPort 22\nHostKey {workdir}/host_key\n"
            f"AuthorizedKeysFile {workdir}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            f"StrictModes no\nPidFile {workdir}/sshd-{host.name}.pid\nMaxStartups 50\n"
            "MaxSessions 50\nSubsystem sftp internal-sftp\n"
        )
    return path


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 10000:04d}"
    subnet = f"10.231.{os.getpid() % 200 + 20}"
    workdir = tempfile.mkdtemp(prefix="nbdist-netns-")
    net = Network(bridge=f"nbd{tag}br", head_address=f"{subnet}.1",
                  hosts=[Host(name, f"nbd{tag}-{name}", f"{subnet}.{11 + i}")
                         for i, name in enumerate(HOSTS)],
                  ssh_args=[], workdir=workdir)
    try:
        _run("ip", "link", "add", net.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{net.head_address}/24", "dev", net.bridge)
        _run("ip", "link", "set", net.bridge, "up")
        for i, host in enumerate(net.hosts):
            _run("ip", "netns", "add", host.netns)
            net.created_netns.append(host.netns)
            outside, inside = f"nbd{tag}v{i}", f"nbd{tag}p{i}"
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", outside, "master", net.bridge, "up")
            _run("ip", "link", "set", inside, "netns", host.netns)
            _run("ip", "-n", host.netns, "link", "set", inside, "name", "eth0")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        key = os.path.join(workdir, "id_ed25519")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(workdir, "host_key"))
        shutil.copy(key + ".pub", os.path.join(workdir, "authorized_keys"))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        net.ssh_args = ["-i", key, "-o", "StrictHostKeyChecking=no", "-o",
                        "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o",
                        "LogLevel=ERROR", "-o", "ConnectTimeout=10"]
        for host in net.hosts:
            # ip netns exec, unshare and sh all exec: the Popen PID ends up being sshd itself,
            # and every session (so every engine) inherits the host's own hostname
            host.sshd = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
                 f'hostname {host.name} && exec /usr/sbin/sshd -D -e -f "$0"',
                 _sshd_config(workdir, host)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(workdir, f"sshd-{host.name}.log"), "wb"),
            )
        for host in net.hosts:
            _wait_for_port(host.address, 22, 20, f"sshd of {host.name}")
        yield net
    finally:
        for host in net.hosts:
            if host.netns in net.created_netns:
                # everything in a namespace this fixture made was started by this module
                for pid in net.pids_in(host):
                    if host.sshd is None or pid != host.sshd.pid:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            if host.sshd is not None:
                host.sshd.terminate()
                try:
                    host.sshd.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    host.sshd.kill()
                    host.sshd.wait(timeout=10)
        for ns in net.created_netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", net.bridge], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(network: Network, fast_config, assert_all_gone) -> Iterator[Cluster]:
    hosts = {h.address: 2 for h in network.hosts}
    cluster = Cluster(
        n=4, config=fast_config.replace(engine_start_timeout=120.0), launcher="ssh",
        launcher_options={"hosts": hosts, "ssh_args": network.ssh_args,
                          "scp_args": network.ssh_args, "heartbeat_period_ms": 500,
                          "heartbeat_misses": 6, "environment": {"PYTHONPATH": SOURCE}},
    )
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
    assert cluster._controller_pid is not None
    controller = psutil.Process(cluster._controller_pid[0])
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
