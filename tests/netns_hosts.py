"""Several hosts on one machine, for the multihost tests and benchmarks: network namespaces
joined by veth pairs to a bridge, each with its own address, its own hostname (a UTS namespace)
and its own sshd. The notebook side and the controller sit on the bridge (the "head node");
ipyparallel's SSH launcher starts the engines on the hosts over real ssh.

Needs root, iproute2, OpenSSH server and client (`.ci/extra-suites` installs them); `why_not`
says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import nbdist

HOSTS = ("hosta", "hostb")
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(nbdist.__file__)))
"""The tree whose nbdist this process imports: the engines started over ssh import the same one."""


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


def why_not() -> str | None:
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


@contextlib.contextmanager
def hosts_network(names: tuple[str, ...] = HOSTS) -> Iterator[Network]:
    """The hosts, each with its sshd, for as long as the context lasts; then every process in
    their namespaces is ended by PID and the namespaces and bridge are removed."""
    tag = f"{os.getpid() % 10000:04d}"
    subnet = f"10.231.{os.getpid() % 200 + 20}"
    workdir = tempfile.mkdtemp(prefix="nbdist-netns-")
    net = Network(bridge=f"nbd{tag}br", head_address=f"{subnet}.1",
                  hosts=[Host(name, f"nbd{tag}-{name}", f"{subnet}.{11 + i}")
                         for i, name in enumerate(names)],
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


def ssh_launcher_options(net: Network, ranks_per_host: int = 2) -> dict[str, Any]:
    """`launcher_options` for an ssh cluster on these hosts (fast heartbeats, this nbdist)."""
    return {"hosts": {h.address: ranks_per_host for h in net.hosts}, "ssh_args": net.ssh_args,
            "scp_args": net.ssh_args, "heartbeat_period_ms": 500, "heartbeat_misses": 6,
            "environment": {"PYTHONPATH": SOURCE}}
