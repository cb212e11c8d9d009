"""Where a rank computes and talks: its device, the interface its sockets use, and for ranks that
share a GPU, the NCCL host of their own; a setting the user exported stays theirs, with a note."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from nbdist.worker import net
from nbdist.worker.setup_message import RankSetup, RankSpec

RANK_DEVICE_VAR = "NBDIST_DEVICE"  # the rank's own device, for nbdist.strategies

# where gloo, NCCL and TensorPipe (torch.distributed.rpc) open their sockets
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")

# NCCL refuses two ranks on one GPU of one host (its "Duplicate GPU detected"); a host is its
# hash of NCCL_HOSTID, else of hostname + boot id (getHostHash in NCCL's utils.cc), read once
# per process. Ranks sharing a GPU are each a host of their own, and talk over NCCL's socket
# transport as hosts do; on one machine that is loopback (GLOO/NCCL_SOCKET_IFNAME=lo).
HOST_ID_VAR = "NCCL_HOSTID"
SHARED_GPU_NET = {"NCCL_NET": "Socket"}  # not InfiniBand loopback, whatever the host has


def pin_device(setup: RankSetup) -> tuple[Any, list[str]]:
    """This rank's device (its first GPU, else the CPU), the interface its sockets use and, when
    it shares its GPU, its NCCL host; returns the device and the notes for the user."""
    import torch

    spec = setup.spec
    device = torch.device(spec.device)
    notes: list[str] = []
    if spec.shares_gpu and spec.backend == "nccl":
        wanted, notes = shared_gpu_environment(spec, os.environ, socket.gethostname(),
                                               net.boot_id())
        os.environ.update(wanted)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        notes += local_rank_notes(spec)
    else:  # DeepSpeed would see the host's GPUs and set_device(LOCAL_RANK): invalid on a CPU rank
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # nbdist.prepare() computes here too: a CPU rank on a GPU host must not land on cuda:0
    os.environ[RANK_DEVICE_VAR] = str(device)
    # one host: else gloo, NCCL and TensorPipe listen on the interface the host name resolves
    # to (or NCCL's first non-loopback one); across hosts: the one that reaches the other ranks
    interface = setup.interface or ("lo" if setup.master_addr.startswith("127.") else None)
    if interface:
        wanted, kept = socket_interfaces(os.environ, interface)
        os.environ.update(wanted)
        notes += kept
    return device, notes


def socket_interfaces(environ: Mapping[str, str],
                      interface: str) -> tuple[dict[str, str], list[str]]:
    """Each socket variable the user left unset, set to `interface`; a note for each they set
    otherwise (a site's NCCL_SOCKET_IFNAME names the data network, nbdist's pick the one that
    reaches the notebook, often management Ethernet)."""
    wanted = {name: interface for name in SOCKET_IFNAME_VARS if name not in environ}
    notes = [f"{name}={environ[name]} is yours and kept (nbdist would set {interface}: see "
             "docs/MULTI_NODE.md)" for name in SOCKET_IFNAME_VARS
             if name in environ and environ[name].strip() != interface]
    return wanted, notes


def shared_gpu_environment(spec: RankSpec, environ: Mapping[str, str], hostname: str,
                           boot_id: str) -> tuple[dict[str, str], list[str]]:
    """NCCL's view of a rank that shares its GPU: a host id of its own (the user's NCCL_HOSTID,
    else NCCL's own hostname + boot id, with the rank added) and the socket network."""
    base = environ.get(HOST_ID_VAR) or f"{hostname}{boot_id}"
    wanted = {HOST_ID_VAR: f"{base}.nbdist-rank{spec.rank}"}
    notes = []
    for name, value in SHARED_GPU_NET.items():
        if name not in environ:
            wanted[name] = value
        elif environ[name].strip() != value:
            notes.append(f"{name}={environ[name]} is yours and kept (ranks sharing a GPU would "
                         f"use {value}: see docs/NCCL.md)")
    return wanted, notes


def local_rank_notes(spec: RankSpec) -> list[str]:
    """The note for code that takes LOCAL_RANK as the GPU index, when here it is not."""
    if not spec.gpus or spec.gpus[0] == spec.local_rank:
        return []
    return ["LOCAL_RANK is not the GPU index on some ranks (ranks sharing a GPU, several GPUs per "
            "rank, a GPU per task): torch.cuda.set_device(LOCAL_RANK), cuda:LOCAL_RANK or "
            "DDP(device_ids=[LOCAL_RANK]) picks another GPU or none there; use `device` (also "
            f"${RANK_DEVICE_VAR}), see docs/NCCL.md"]


def device_index_hint(message: str, environ: Mapping[str, str]) -> str | None:
    """A line for torch's "invalid device (ordinal)" on a rank whose LOCAL_RANK is not its GPU."""
    device, local_rank = environ.get(RANK_DEVICE_VAR, ""), environ.get("LOCAL_RANK", "")
    if "invalid device" not in message.lower() or not device.startswith("cuda:"):
        return None
    if device == f"cuda:{local_rank}":
        return None
    return (f"nbdist: this rank computes on {device} (`device`, ${RANK_DEVICE_VAR}) while its "
            f"LOCAL_RANK is {local_rank}: code that calls torch.cuda.set_device(LOCAL_RANK) "
            "must use `device` here (docs/NCCL.md)")
