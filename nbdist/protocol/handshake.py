"""What notebook and rank tell each other at set-up, before the cell channel exists (through
ipyparallel's signed apply): the probe's reply, where each end of the channel listens, and the
protocol version both must speak."""

from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.protocol import wire
from nbdist.protocol.wire import VERSION


@dataclass(frozen=True)
class ChannelSetup:
    """What the notebook tells a rank about the channel, in its (signed) setup call."""

    notebook_address: str  # the notebook's PULL, where the rank's PUSH connects
    bind_host: str  # where the rank's ROUTER listens: loopback on one host, else its address
    notebook_key: bytes | None = None  # the notebook's CurveZMQ public key; None: not encrypted
    notebook_process: tuple[int, float] | None = None
    """The kernel's (pid, create time): the rank ends itself once it is gone (orphan_guard).
    None for engines nbdist did not start: they live on."""


@dataclass(frozen=True)
class ChannelEndpoint:
    """Where a rank takes requests, as its setup reports it."""

    address: str  # "tcp://HOST:PORT" of the rank's ROUTER for cells, pdb answers, widgets
    public_key: bytes | None = None  # its CurveZMQ public key (None: not encrypted)
    service_address: str | None = None  # its rank service's ROUTER, for calls (None: `address`)
    main_thread_commands: tuple[str, ...] = ()
    """Commands that run on the main thread between cells: a call to one goes to `address`, read
    by the engine's loop as a cell is (no hop through the service thread)."""


@dataclass(frozen=True, slots=True)
class ProbeReply:
    """What an engine is, before it becomes a rank."""

    protocol: int = VERSION
    nbdist: str = ""  # its nbdist's version, named in a mismatch
    host: str = ""
    boot_id: str | None = None
    pid: int = 0
    create_time: float = 0.0
    children: tuple[tuple[int, float], ...] = ()
    addresses: dict[str, list[str]] = field(default_factory=dict)  # interface -> IPv4s
    route_address: str | None = None  # its address toward the notebook's host (multi-host)
    route_interface: str | None = None
    gpu_count: int = 0
    gpu_uuids: tuple[str, ...] = ()
    local_id: int | None = None  # which task on its host, as its launcher numbers them
    cpu_count: int | None = None
    cpu_affinity: tuple[int, ...] = ()
    torch: str = ""  # a string: a TorchVersion would import torch in the notebook
    release_signal: int | None = None
    report_signal: int | None = None


def version_mismatch(rank_protocol: int, rank_nbdist: str, where: str) -> str | None:
    """The one-line error when a rank speaks another protocol than this process; else None."""
    from nbdist._version import __version__

    if rank_protocol == wire.VERSION:
        return None
    return (f"{where} speaks nbdist protocol {rank_protocol} (nbdist {rank_nbdist or '?'}), "
            f"this notebook protocol {wire.VERSION} (nbdist {__version__}): install the same "
            "nbdist on every host")
