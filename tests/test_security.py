"""Locked down by default (docs/SECURITY.md), checked on real engines: every socket of the whole
process tree listens on loopback (or on the one interface the user named), the cluster's files are
owner-only from their creation, and a client without the cluster's key cannot run code."""

from __future__ import annotations

import fnmatch
import glob
import ipaddress
import json
import os
import socket
import stat
import time
import uuid

import ipyparallel as ipp
import psutil
import pytest
import zmq
from jupyter_client.session import Session

from nbdist import Cluster
from nbdist.cluster.launchers import MultiHostWarning
from nbdist.worker import net

ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"

# gloo's pairs after a collective, a DDP model (its reducer holds the group) after a backward,
# and a DataLoader worker: a process a rank spawns, which the walk must reach too
DDP_AND_LOADER = """
import os
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(torch.nn.Linear(8, 8))
ddp(torch.ones(4, 8)).sum().backward()
loader = torch.utils.data.DataLoader(list(range(8)), num_workers=1, persistent_workers=True)
loader_iter = iter(loader)
next(loader_iter)
t = torch.ones(1)
dist.all_reduce(t)
rendezvous = [int(os.environ["MASTER_PORT"])] + [os.environ.get(name) for name in (
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")]
"""
DROP_DDP_AND_LOADER = "del ddp, loader_iter, loader, rendezvous"


@pytest.fixture(scope="module")
def cluster(cluster2: Cluster) -> Cluster:
    return cluster2


def _tree() -> list[psutil.Process]:
    """This process (the notebook's stand-in) and every process below it, however deep."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _listeners(procs: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, proto, address, port) of every listening TCP socket and every bound, unconnected UDP
    socket (one that anyone may send to), IPv4 and IPv6."""
    found = []
    for proc in procs:
        try:
            connections = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for conn in connections:
            if conn.type == socket.SOCK_STREAM and conn.status == psutil.CONN_LISTEN:
                found.append((proc.pid, "tcp", conn.laddr.ip, conn.laddr.port))
            elif conn.type == socket.SOCK_DGRAM and not conn.raddr:
                found.append((proc.pid, "udp", conn.laddr.ip, conn.laddr.port))
    return found


def _describe(listeners: list[tuple[int, str, str, int]]) -> list[str]:
    out = []
    for pid, proto, address, port in listeners:
        try:
            command = " ".join(psutil.Process(pid).cmdline()[1:4])
        except psutil.Error:
            command = "?"
        out.append(f"{proto} {address}:{port} pid {pid} ({command})")
    return out


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _rank_pids(cluster: Cluster) -> list[int]:
    return [proc.pid for proc in cluster.ranks]


def test_whole_process_tree_listens_on_loopback_only(cluster: Cluster):
    cluster.run(DDP_AND_LOADER, timeout=120).raise_for_errors()
    try:
        master_port, *ifnames = cluster.pull("rendezvous")[0]
        tree = _tree()
        pids = {p.pid for p in tree}
        # the walk reaches everything nbdist knows of, the controller's forked schedulers and
        # the processes the ranks spawned (the DataLoader workers)
        assert set(cluster.all_pids()) <= pids
        controller = psutil.Process(cluster._processes.controller[0])
        assert len(controller.children()) >= 3, "the controller's schedulers were not found"
        for rank_pid in _rank_pids(cluster):
            assert psutil.Process(rank_pid).children(), f"rank pid {rank_pid}: no DataLoader worker"
        listeners = _listeners(tree)
    finally:
        cluster.run(DROP_DDP_AND_LOADER).raise_for_errors()
    assert {pid for pid, *_ in listeners} >= {controller.pid, *_rank_pids(cluster)}
    off_loopback = [entry for entry in listeners if not _is_loopback(entry[2])]
    assert not off_loopback, "listening off loopback:\n" + "\n".join(_describe(off_loopback))
    # the rendezvous is a file in the private directory: nothing listens on MASTER_PORT at all
    assert not [entry for entry in listeners if entry[3] == master_port]
    # gloo, NCCL's bootstrap and TensorPipe are pinned to loopback unless the user named one
    assert ifnames == [os.environ.get(name, "lo") for name in
                       ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")]


def _interface_off_loopback() -> tuple[str, str] | None:
    for name, addresses in sorted(net.ipv4_addresses().items()):
        for address in addresses:
            if not _is_loopback(address):
                return name, address
    return None


def test_named_interface_is_the_only_one_listened_on(cluster_factory):
    """--interface IFACE: the controller, gloo and the c10d TCP store (unauthenticated, on rank
    0) listen on IFACE's address only, never on every interface (torch's store alone would)."""
    found = _interface_off_loopback()
    if found is None:
        pytest.skip("this machine has no IPv4 interface besides loopback")
    interface, address = found
    with pytest.warns(MultiHostWarning):
        named = cluster_factory(2, interface=interface)
    named.run(DDP_AND_LOADER, timeout=120).raise_for_errors()
    master_port, gloo_ifname, *_ = named.pull("rendezvous")[0]
    listeners = _listeners(_tree())
    named.run(DROP_DDP_AND_LOADER).raise_for_errors()
    assert named.master_addr == address and gloo_ifname == interface
    # rank 0's store (its DataLoader worker, forked, holds the same socket)
    store = [entry for entry in listeners if entry[3] == master_port]
    assert named.ranks[0].pid in {pid for pid, *_ in store}
    assert {ip for _pid, _proto, ip, _port in store} == {address}, (
        "the c10d store: " + ", ".join(_describe(store)))
    elsewhere = [entry for entry in listeners if entry[2] != address and not _is_loopback(entry[2])]
    assert not elsewhere, "listening beyond the named interface:\n" + "\n".join(_describe(elsewhere))
    assert named.run(ALL_REDUCE).raise_for_errors().grouped_values() == [([0, 1], "2.0")]


def _assert_owner_only(workdir: str) -> dict[str, int]:
    """Every directory 0700 and every file 0600 under the cluster's directory; what was there."""
    assert stat.S_IMODE(os.stat(workdir).st_mode) == 0o700, workdir
    wrong, seen = [], {}
    for root, dirs, files in os.walk(workdir):
        for name in dirs:
            path = os.path.join(root, name)
            if stat.S_IMODE(os.stat(path).st_mode) != 0o700:
                wrong.append(f"{oct(os.stat(path).st_mode)} {path}")
        for name in files:
            path = os.path.join(root, name)
            try:
                st_mode = os.stat(path).st_mode
            except FileNotFoundError:  # a breakpoint answer or a store of a generation just gone
                continue
            mode = stat.S_IMODE(st_mode)
            seen[os.path.relpath(path, workdir)] = mode
            # a socket (the fork server's) is owner-only when no one else may write to it
            if (mode & 0o077 if stat.S_ISSOCK(st_mode) else mode != 0o600):
                wrong.append(f"{oct(mode)} {path}")
    assert not wrong, "not owner-only:\n" + "\n".join(wrong)
    return seen


def _kinds(seen: dict[str, int]) -> set[str]:
    patterns = {"key": "profile/security/ipcontroller-*-client.json",
                "engine log": "profile/log/ipengine-*.log",
                "controller log": "profile/log/ipcontroller-*.log",
                "store": "store-generation-*"}
    return {kind for kind, pattern in patterns.items() if fnmatch.filter(seen, pattern)}


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_files_are_owner_only_from_creation_and_user_files_keep_the_umask(cluster, tmp_path):
    """Nothing chmods after the fact: each file was created owner-only (umask 077 while
    ipyparallel writes them; the store file created 0600 by the rank) - after start, after a
    rebuild (new store file) and after a restart (new engines, new logs)."""
    umask = _current_umask()
    assert _kinds(_assert_owner_only(cluster.workdir)) == {
        "key", "engine log", "controller log", "store"}
    cluster.rebuild_process_group()
    assert f"store-generation-{cluster.generation}" in _assert_owner_only(cluster.workdir)
    old_logs = set(glob.glob(os.path.join(cluster.workdir, "profile", "log", "ipengine-*.log")))
    cluster.restart()
    seen = _assert_owner_only(cluster.workdir)
    assert {os.path.join(cluster.workdir, p) for p in seen if p.endswith(".log")} - old_logs
    assert _current_umask() == umask  # the notebook's umask is its own again
    # what the user's code writes on a rank follows the user's umask, as under torchrun
    target = tmp_path / "checkpoint.txt"
    cluster.run(f"if rank == 0:\n    open({str(target)!r}, 'w').write('weights')").raise_for_errors()
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


def _client_connection(cluster: Cluster) -> tuple[str, dict]:
    [path] = glob.glob(os.path.join(cluster.workdir, "profile", "security", "*-client.json"))
    with open(path) as f:
        return path, json.load(f)


def _raw_execute(connection: dict, key: bytes, engine_uuid: str, code: str) -> bool:
    """Send an execute_request signed with `key` straight to the controller's mux, as any local
    process that can reach the port could; True if a reply came within 4 s."""
    session = Session(key=key, signature_scheme=connection["signature_scheme"],
                      packer="json", unpacker="json", username="intruder")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(f"{connection['interface']}:{connection['mux']}")
        session.send(sock, "execute_request", ident=engine_uuid.encode(),
                     content={"code": code, "silent": False, "user_expressions": {}})
        return bool(sock.poll(4000, zmq.POLLIN))
    finally:
        sock.close(linger=0)


def test_without_the_key_no_client_runs_code(cluster, tmp_path):
    path, connection = _client_connection(cluster)
    assert connection["signature_scheme"].startswith("hmac-") and len(connection["key"]) >= 32
    # a copy of the connection file with a wrong key: the hub never answers the handshake
    wrong = dict(connection, key=uuid.uuid4().hex)
    wrong_file = tmp_path / "wrong-key-client.json"
    wrong_file.write_text(json.dumps(wrong))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        ipp.Client(str(wrong_file), timeout=3)
    assert time.monotonic() - started < 30
    # past the handshake, straight to the engine's queue: a wrong key or none is dropped unread;
    # the same message with the right key runs (so the path itself is real)
    engine_uuid = cluster.client._engines[cluster.ranks[0].spec.engine_id]
    markers = {name: tmp_path / f"ran-with-{name}" for name in ("wrong", "none", "right")}
    keys = {"wrong": wrong["key"].encode(), "none": b"", "right": connection["key"].encode()}
    replies = {name: _raw_execute(connection, keys[name], engine_uuid,
                                  f"open({str(markers[name])!r}, 'w').close()")
               for name in ("wrong", "none", "right")}
    assert replies == {"wrong": False, "none": False, "right": True}
    assert {name: marker.exists() for name, marker in markers.items()} == {
        "wrong": False, "none": False, "right": True}
    assert "Invalid Signature" in cluster.engine_log_tail(0, 40)
    # nbdist's own client and process group carry on
    assert cluster.run(ALL_REDUCE).raise_for_errors().grouped_values() == [([0, 1], "2.0")]


def test_the_key_appears_in_no_output(cluster):
    _path, connection = _client_connection(cluster)
    key = connection["key"]
    outputs = [str(cluster.status()), repr(cluster), cluster.status().table()]
    result = cluster.run("import os\nprint(os.environ.get('IPP_CONNECTION_INFO', ''))")
    outputs += list(result.stdout.values()) + list(result.stderr.values())
    assert all(key not in text for text in outputs)
