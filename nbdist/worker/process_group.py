"""The rank's process group: the environment torch reads when it creates one (a variable the user
set stays theirs, with a note), and one generation at a time, each on a fresh store."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from nbdist import ipp_compat, torch_support
from nbdist.worker import release

# so that a stuck collective is an error in the cell, not the end of the engine (docs/NCCL.md)
NCCL_ENVIRONMENT: dict[str, str] = {
    # the watchdog aborts a failed group's communicators and raises nowhere (the user's wait has
    # returned long before; the group's next collective fails): nbdist reads the group's error
    # state after each cell. torch's 3 ends the process
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # the interrupt ladder decides when an engine dies
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # the flight recorder's dump on a timeout or error
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000",  # the cell sees the error 4 times this later
}

# the flight recorder's buffer size and dump prefix under its new and its older name; a user's
# value under either wins. torch 2.6-2.8 read only the older names, so there nbdist sets both;
# later releases read the older name as a fallback and warn that it is deprecated whenever it is
# set (c10d getCvarInt), so there only the new one is set
BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_FILE_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_names(names: tuple[str, str]) -> tuple[str, ...]:
    """The names of a flight-recorder variable the running torch needs set."""
    return names[:1] if torch_support.has("flight-recorder-fr-names") else names

# some torch releases crash building a DDP model under TORCH_DISTRIBUTED_DEBUG=DETAIL
DDP_PROBE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
"""


def apply_environment(setup: Any) -> list[str]:
    """Set this rank's group environment; returns the notes the user should see."""
    faults = setup.config.faults
    release.ABORT_TIMEOUT = faults.teardown_grace
    nccl, notes = nccl_environment(os.environ) if setup.spec.backend == "nccl" else ({}, [])
    buffer, buffer_notes = _user_wins(
        {BUFFER_VARIABLES: str(faults.flight_recorder_entries)}, os.environ, "FAULTS.md")
    buffer = {name: value for name, value in buffer.items()
              if name in flight_recorder_names(BUFFER_VARIABLES)}
    os.environ.update({**nccl, **buffer,
                       **dump_environment(os.environ, setup.spec.rank, setup.private_dir)})
    return notes + buffer_notes + check_collectives(faults.check_collectives)


def _user_wins(wanted: Mapping[tuple[str, ...], str], current: Mapping[str, str],
               doc: str) -> tuple[dict[str, str], list[str]]:
    """What to set (under every one of its names, where the user set none of them), and a note
    per value the user set otherwise."""
    to_set: dict[str, str] = {}
    notes: list[str] = []
    for names, value in wanted.items():
        theirs = next((name for name in names if name in current), None)
        if theirs is None:
            to_set.update(dict.fromkeys(names, value))
        elif current[theirs].strip() != value:
            notes.append(f"{theirs}={current[theirs]} is yours and kept (nbdist would set "
                         f"{value}: see docs/{doc})")
    return to_set, notes


def nccl_environment(current: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    return _user_wins({(name,): value for name, value in NCCL_ENVIRONMENT.items()}, current,
                      "NCCL.md")


def dump_environment(current: Mapping[str, str], rank: int,
                     private_dir: str | None) -> dict[str, str]:
    """The dump's prefix, unless the user chose one, in a directory only this user reads (torch's
    default in /tmp is readable by anyone): the cluster's private one, else a temporary one."""
    if any(name in current for name in DUMP_FILE_VARIABLES):
        return {}
    if private_dir:
        directory = os.path.join(private_dir, f"flight-recorder-rank{rank}")
        os.makedirs(directory, mode=0o700, exist_ok=True)
    else:
        directory = tempfile.mkdtemp(prefix="nbdist-flight-recorder-")  # 0700
        TEMPORARY_DUMPS.append(directory)
        atexit.register(remove_temporary_dumps)
    return dict.fromkeys(flight_recorder_names(DUMP_FILE_VARIABLES),
                         os.path.join(directory, "nccl_trace_rank_"))


TEMPORARY_DUMPS: list[str] = []  # a rank away from the notebook's machine: its own dump dirs


def remove_temporary_dumps() -> None:
    """At exit, and when the rank ends itself without one (the kernel is gone: os._exit)."""
    while TEMPORARY_DUMPS:
        shutil.rmtree(TEMPORARY_DUMPS.pop(), ignore_errors=True)


def check_collectives(check: bool) -> list[str]:
    """torch compares every collective across ranks before it runs (TORCH_DISTRIBUTED_DEBUG=DETAIL,
    read at import: set again here); a note where DDP crashes under it."""
    import torch
    import torch.distributed as dist

    if check:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if "TORCH_DISTRIBUTED_DEBUG" not in os.environ:
        return []
    dist.set_debug_level_from_env()  # raises for a value other than OFF, INFO, DETAIL (any case)
    if dist.get_debug_level() != dist.DebugLevel.DETAIL or ddp_survives():
        return []
    return [f"collective checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) are on, and on torch "
            f"{torch.__version__} DistributedDataParallel crashes the process (SIGSEGV) under "
            "them: a DDP model would end its engine. Start without --check-collectives to "
            "train with DDP (FSDP2 and plain collectives are checked fine)."]


def ddp_survives() -> bool:
    """Whether building a DDP model under DETAIL leaves a (child) process alive."""
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL", OMP_NUM_THREADS="1")
    try:
        probe = subprocess.run([sys.executable, "-c", DDP_PROBE], env=env, timeout=120,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


# when this rank began joining its generation (time.time()): older flight-recorder entries belong
# to groups that no longer exist
GENERATION_STARTED = 0.0

KEPT_ERROR: BaseException | None = None  # the last cell error the teardown found, for %dist_debug


def init_generation(setup: Any) -> None:
    """Join the generation a `RankSetup` names. On one host its store is an owner-only file
    (`store_path`): nothing listens on a port. Across hosts: a TCP store on rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    global GENERATION_STARTED
    GENERATION_STARTED = time.time()
    os.environ.update(MASTER_ADDR=setup.master_addr, MASTER_PORT=str(setup.port))
    spec, store_path, timeout_s = setup.spec, setup.store_path, setup.process_group_timeout
    rank, world_size, nccl = spec.rank, spec.world_size, spec.backend == "nccl"
    # binds the group to that GPU (eager NCCL init); a rank spanning several GPUs must be free
    # to run collectives on any of them
    device_id = torch.device(spec.device) if nccl and len(spec.gpus) == 1 else None
    if store_path is not None:
        # torch creates the file with the user's umask; created first, owner-only, it stays so
        os.close(os.open(store_path, os.O_WRONLY | os.O_CREAT, 0o600))
        store = dist.FileStore(store_path, world_size)
    else:
        store = _tcp_store(setup.master_addr, setup.port, rank, world_size, timeout_s)
    with release.recording_sockets():
        # torch's own function: `dist.init_process_group` is the cells' wrapper (pasted_code)
        distributed_c10d.init_process_group(
            backend=torch_backend(spec.backend), rank=rank, world_size=world_size, store=store,
            timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)
        check = torch.full((1,), rank + 1.0, device=spec.device if nccl else "cpu")
        dist.all_reduce(check)
    expected = world_size * (world_size + 1) / 2
    if float(check.item()) != expected:
        raise RuntimeError(f"process group check failed on rank {rank}: all_reduce gave "
                           f"{check.item()}, expected {expected}")


def torch_backend(backend: str) -> str:
    """The backend string torch gets: an NCCL rank also has gloo for its CPU tensors (plain
    "nccl" maps only cuda, and a collective on a CPU tensor then has no backend at all)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def sequence_numbers() -> dict[str, int]:
    """Collectives this rank queued per group and device backend ("cuda": the world group's
    NCCL half, "cpu@group mesh_tp (ranks 0, 1)": a sub-group's gloo): equal on every member between
    cells unless one queued a collective its peers never reached. Microseconds per group."""
    import torch

    if not is_initialized():
        return {}
    found: dict[str, int] = {}
    for group, _name, label, _ranks, backend in groups():
        for device in backend.split(","):
            kind = device.split(":")[0].strip()
            with contextlib.suppress(RuntimeError, ValueError):
                number = int(group._get_backend(torch.device(kind))
                             ._get_sequence_number_for_group())
                found[kind if label == "default group" else f"{kind}@{label}"] = number
    return found


def groups() -> list[tuple[Any, str, str, tuple[int, ...], str]]:
    """Every process group of this generation: (group, torch's name for it, how a person calls
    it, its global ranks, its backend string as `dist.get_backend` gives it)."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    default = world.default_pg
    found = []
    for pg, name in list(world.pg_names.items()):
        ranks = tuple(sorted(world.pg_group_ranks.get(pg, {})))
        desc = "default_pg" if pg is default else str(getattr(pg, "group_desc", ""))
        backend = str(world.pg_backend_config.get(pg, ""))
        found.append((pg, str(name), group_label(str(name), desc, ranks), ranks, backend))
    return found


def group_label(name: str, desc: str, ranks: tuple[int, ...]) -> str:
    if desc == "default_pg":
        return "default group"
    listed = f" (ranks {', '.join(str(r) for r in ranks)})" if ranks else ""
    return f"group {desc if desc and desc != 'undefined' else name}{listed}"


def _tcp_store(master_addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """torch's store server listens on every interface whatever host it is given, unauthenticated:
    rank 0 binds the listening socket itself, on `master_addr` only, and hands it over."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(master_addr, port, world_size, is_master=False, timeout=timeout)
    family, _kind, _proto, _name, address = socket.getaddrinfo(
        master_addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.create_server(address, family=family, backlog=max(128, world_size))
    # the store owns the descriptor from here on (it closes it when the generation ends)
    return dist.TCPStore(master_addr, port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach(),
                         use_libuv=torch_support.has("tcpstore-libuv-listen-fd"))


def teardown() -> bool:
    """Abort and destroy the process group, if any (True then), so peers blocked on this rank fail
    now. Destroying is not enough: a traceback or a DDP model keeps the group's sockets open."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not is_initialized():
        # the cell destroyed the group, but a DDP model may still hold it connected
        release.shutdown_group_sockets()
        release.GROUP_SOCKETS.clear()
        return False
    nccl = release.uses_nccl(dist.get_backend())
    _drop_last_traceback()
    if not release.release_now():  # NCCL's communicators aborted, then the sockets shut
        raise RuntimeError(
            f"NCCL's abort of this rank's communicators did not finish within "
            f"{release.ABORT_TIMEOUT:g} s (NbdistConfig.teardown_grace): the GPU may still run "
            "its collectives; %dist_restart (Cluster.restart()) starts fresh engines")
    if not nccl:
        with contextlib.suppress(Exception):  # a broken group can fail to abort cleanly
            distributed_c10d._abort_process_group()
    release.GROUP_SOCKETS.clear()
    with contextlib.suppress(Exception):
        distributed_c10d.destroy_process_group()
    gc.collect()
    return True


def _drop_last_traceback() -> None:
    # %dist_debug still wants the rank's own error: kept (the group's sockets are shut down by
    # then, so holding the user's frames no longer holds any peer)
    global KEPT_ERROR
    KEPT_ERROR = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None) or KEPT_ERROR
    for name in ("last_traceback", "last_value", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    with contextlib.suppress(Exception):
        from IPython import get_ipython

        ipp_compat.forget_last_traceback(get_ipython())  # None: no shell, nothing kept


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
