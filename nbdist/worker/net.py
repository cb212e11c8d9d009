"""Network helpers for both sides of a cluster (stdlib and psutil, no torch): free ports, which
machine this is, its IPv4 addresses and the address (and interface) it reaches a peer by."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def boot_id() -> str:
    """Differs between machines (same for network namespaces of one kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def ipv4_addresses() -> dict[str, list[str]]:
    """Each network interface that has IPv4 addresses, with them."""
    import psutil

    found = {name: [a.address for a in addrs if a.family == socket.AF_INET]
             for name, addrs in psutil.net_if_addrs().items()}
    return {name: addresses for name, addresses in found.items() if addresses}


def interface_ipv4(interface: str) -> str | None:
    """The first IPv4 address of a local network interface, or None."""
    return next(iter(ipv4_addresses().get(interface, [])), None)


def route_source(peer: str) -> str:
    """The local address the kernel would use to reach `peer` (no packet is sent); OSError when
    `peer` does not resolve or is unreachable."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer), 9))
        return str(s.getsockname()[0])


def route_to(peer: str) -> tuple[str | None, str | None]:
    """The local address and its interface this machine reaches `peer` by; (None, None) if none."""
    try:
        address = route_source(peer)
    except OSError:
        return None, None
    names = [name for name, addrs in ipv4_addresses().items() if address in addrs]
    return address, next(iter(names), None)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def host_address() -> str | None:
    """This host's own non-loopback IPv4 address that peers most likely reach it by: the one its
    name resolves to, else the one of the interface with the default route; None if neither."""
    mine = {a for addresses in ipv4_addresses().values() for a in addresses if not is_loopback(a)}
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = ""
    if named in mine:
        return named
    try:
        routed = route_source("192.0.2.1")  # TEST-NET-1: any off-host address takes the default
    except OSError:
        return None
    return routed if routed in mine else None
