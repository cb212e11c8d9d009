"""Where the ranks meet (master address, interface, each generation's store) and where each end
of the cell channel listens. On one host nothing leaves loopback."""

from __future__ import annotations

import os
import socket
from typing import Any

from nbdist import ipp_compat
from nbdist.cluster.gather import short_error
from nbdist.cluster.launchers import warn_unauthenticated_rendezvous
from nbdist.cluster.ranks import RankSpec
from nbdist.errors import ClusterStartError
from nbdist.protocol.handshake import ProbeReply
from nbdist.worker import net
from nbdist.worker.process_tree import same_process


class Rendezvous:
    def __init__(self, master_addr: str | None, interface: str | None) -> None:
        self.requested_master_addr = master_addr
        self.master_addr = master_addr or "127.0.0.1"
        self.interface = interface
        self.spans_hosts = False

    def choose(self, plan_spans_hosts: bool, specs: list[RankSpec],
               probes: dict[int, ProbeReply]) -> None:
        """Rendezvous on rank 0: its address on --interface, else the one it reaches the
        controller by (so the others reach it too); 127.0.0.1 for a local cluster."""
        self.spans_hosts = plan_spans_hosts or not all(map(is_local_engine, probes.values()))
        if self.spans_hosts and not plan_spans_hosts:
            warn_unauthenticated_rendezvous()  # found out only now (attached engines elsewhere)
        self.master_addr = self.requested_master_addr or "127.0.0.1"
        if self.spans_hosts and self.requested_master_addr is None:
            rank0, host = probes[specs[0].engine_id], specs[0].host
            address = _probe_address(rank0, self.interface)
            if address is None and self.interface is not None:
                raise ClusterStartError(
                    f"--interface {self.interface}: rank 0 (host {host}) has no IPv4 address on "
                    f"it (it has {sorted(rank0.addresses)})")
            if address is None:
                raise ClusterStartError(
                    f"could not tell which address of rank 0 (host {host}) the other ranks "
                    "can reach; pass master_addr= (--master-addr) or interface= (--interface)")
            self.master_addr = address

    def rank_interface(self, probe: ProbeReply) -> str | None:
        """--interface, else (across hosts) the one the rank reaches the controller by."""
        if self.interface is not None or not self.spans_hosts:
            return self.interface
        return probe.route_interface or None

    def channel_host(self, probe: ProbeReply) -> str:
        """Where a rank's cell channel listens: loopback on one host, else the rank's address on
        --interface or the one it reaches the controller by."""
        if not self.spans_hosts:
            return "127.0.0.1"
        address = _probe_address(probe, self.interface) or probe.route_address
        if not address:
            raise ClusterStartError(
                f"could not tell which address of host {probe.host} the notebook can reach "
                "its rank by; pass interface= (--interface)")
        return str(address)

    def notebook_host(self, client: Any, probes: dict[int, ProbeReply]) -> str:
        """Where the notebook's end listens: loopback on one host; else this host's address on
        --interface, the controller's when it runs here, or the one it reaches a rank by."""
        if not self.spans_hosts:
            return "127.0.0.1"
        if self.interface is not None and (address := net.interface_ipv4(self.interface)):
            return str(address)
        controller = controller_host(client)
        if controller in {a for found in net.ipv4_addresses().values() for a in found}:
            return str(controller)
        for probe in probes.values():
            if probe.route_address:
                return net.route_source(str(probe.route_address))
        raise ClusterStartError("could not tell which address of this host the ranks reach it by; "
                                "pass interface= (--interface)")

    def store_path(self, workdir: str, generation: int) -> str | None:
        if self.spans_hosts or not workdir:
            return None
        return os.path.join(workdir, f"store-generation-{generation}")

    def port(self, client: Any, rank0_engine: int, timeout: float) -> int:
        """A fresh port for the store: picked here for a local master, else on rank 0."""
        if net.is_loopback(self.master_addr) or not self.spans_hosts:
            return net.free_port(self.master_addr)
        ar = client[rank0_engine].apply_async(net.free_port, self.master_addr)
        try:
            return int(ar.get(timeout=timeout))
        except Exception as exc:
            raise ClusterStartError(
                f"rank 0 could not open a port on {self.master_addr}: {short_error(exc)}"
            ) from None


def _probe_address(probe: ProbeReply, interface: str | None) -> str | None:
    found = (probe.addresses.get(interface, []) if interface is not None
             else [probe.route_address])
    return str(found[0]) if found and found[0] else None


def is_local_engine(probe: ProbeReply) -> bool:
    """Same machine (hostname and boot id) and the PID really is that engine here."""
    return (probe.host == socket.gethostname() and probe.boot_id == net.boot_id()
            and same_process(probe.pid, probe.create_time) is not None)


def controller_host(client: Any) -> str | None:
    """The controller's address as engines see it (the peer ranks route towards)."""
    cfg = ipp_compat.client_connection(client)
    interface = str(cfg.get("interface", ""))
    host = interface.split("://", 1)[-1]
    if host in ("", "*", "0.0.0.0"):
        host = str(cfg.get("location") or "") or None
    return host
