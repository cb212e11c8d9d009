"""The rank's torch.distributed process group: one generation at a time, each on a fresh store.

A generation is torn down (so peers blocked on this rank fail at once instead of waiting for the
timeout) and rebuilt on a new port; the notebook side decides when (see nbdist.cells.faults).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Any

from nbdist import ipp_compat, torch_support

_GENERATION_STARTED = 0.0


def generation_started() -> float:
    """When this rank began joining its current generation (time.time()): the flight recorder's
    entries before it belong to groups that no longer exist."""
    return _GENERATION_STARTED


def init_generation(
    backend: str,
    master_addr: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    gpus: list[int],
    generation: int,
    store_path: str | None = None,
) -> dict[str, Any]:
    """Join generation `generation`. On one host the store is a file in the cluster's private
    directory (`store_path`, new per generation, owner-only): nothing listens on a port at all.
    Across hosts (or on a named interface): a TCP store on rank 0, listening on `master_addr:port`
    only (see `_tcp_store`)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from nbdist.worker import release

    global _GENERATION_STARTED
    _GENERATION_STARTED = time.time()
    started = time.perf_counter()
    sockets_before = release.socket_fds()
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(port)
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and len(gpus) == 1:
        # binds the group to that GPU (eager NCCL init); a rank spanning several GPUs must be
        # free to run collectives on any of them
        kwargs["device_id"] = torch.device("cuda", gpus[0])
    if store_path is not None:
        # torch creates the file with the rank's umask (the user's: often world-readable);
        # created first, owner-only, it keeps that mode
        os.close(os.open(store_path, os.O_WRONLY | os.O_CREAT, 0o600))
        kwargs["store"] = dist.FileStore(store_path, world_size)
    else:
        kwargs["store"] = _tcp_store(master_addr, port, rank, world_size, timeout_s)
    # torch's own function: `dist.init_process_group` is the cells' wrapper (init_calls)
    distributed_c10d.init_process_group(
        backend=torch_backend(backend),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    check = torch.ones(1, device=f"cuda:{gpus[0]}" if backend == "nccl" else "cpu") * (rank + 1)
    dist.all_reduce(check)
    release.record_group_sockets(sockets_before)
    expected = world_size * (world_size + 1) / 2
    if float(check.item()) != expected:
        raise RuntimeError(
            f"process group check failed on rank {rank}: all_reduce gave {check.item()}, "
            f"expected {expected}"
        )
    return {"generation": generation, "seconds": time.perf_counter() - started}


def torch_backend(backend: str) -> str:
    """The backend string torch gets: an NCCL rank also has gloo for its CPU tensors (plain
    "nccl" maps only cuda, and a collective on a CPU tensor then has no backend at all)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def sequence_numbers() -> dict[str, int]:
    """Device type -> how many collectives this rank has queued on the world group's backend
    for it (NCCL counts at enqueue, before the collective ran). Equal on every rank between
    cells unless one rank queued a collective its peers never reached."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    group = distributed_c10d._get_default_group()
    found: dict[str, int] = {}
    for device in dist.get_backend_config().split(","):
        kind = device.split(":")[0].strip()
        try:
            backend = group._get_backend(torch.device(kind))
            found[kind] = int(backend._get_sequence_number_for_group())
        except (RuntimeError, ValueError):
            continue
    return found


def _tcp_store(master_addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """The generation's TCP store. torch's store server listens on every interface (`::`)
    whatever host it is given, and it is unauthenticated: rank 0 binds the listening socket
    itself, on `master_addr` only (the interface nbdist or the user chose), and hands it over."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(master_addr, port, world_size, is_master=False, timeout=timeout)
    family, _kind, _proto, _name, address = socket.getaddrinfo(
        master_addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(128, world_size))
    except OSError:
        listener.close()
        raise
    # the store owns the descriptor from here on (it closes it when the generation ends)
    return dist.TCPStore(master_addr, port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach(),
                         use_libuv=torch_support.has("tcpstore-libuv-listen-fd"))


def teardown() -> bool:
    """Abort and destroy the current process group if any; True if there was one.

    destroy alone is not enough: a failed cell's traceback or a DDP model keeps the group's
    objects (and so its sockets) alive, and peers stay blocked; gloo's abort does not close them
    either. So the group's sockets are shut down too (nbdist.worker.release): before the abort
    on gloo, after it on NCCL, whose proxy must see its communicator aborted, not its sockets
    fail under it.
    """
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from nbdist.worker import release

    if not dist.is_available() or not dist.is_initialized():
        # the cell destroyed the group, but a DDP model may still hold it connected: a collective
        # on it would wait for a peer forever
        release.shutdown_group_sockets()
        release.forget_group_sockets()
        return False
    nccl = release.uses_nccl(dist.get_backend())
    if not nccl:
        release.shutdown_group_sockets()  # peers fail now, whatever still references the group
    _drop_last_traceback()
    try:
        distributed_c10d._abort_process_group()
    except Exception:
        pass
    if nccl:
        release.shutdown_group_sockets()  # the group's gloo half (CPU tensors)
    release.forget_group_sockets()
    try:
        distributed_c10d.destroy_process_group()
    except Exception:
        # a broken group can fail to destroy cleanly; what matters is that its sockets close
        pass
    sys.last_traceback = None
    gc.collect()
    return True


def _drop_last_traceback() -> None:
    # %dist_debug still wants the rank's own error: keep it (the group's sockets are shut down
    # already, so holding the user's frames no longer holds any peer)
    _keep_error(getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
    for name in ("last_traceback", "last_value", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            ipp_compat.forget_last_traceback(shell)
    except Exception:
        pass


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


_KEPT_ERROR: list[BaseException] = []


def _keep_error(exc: BaseException | None) -> None:
    if exc is not None:
        _KEPT_ERROR[:] = [exc]


def kept_error() -> BaseException | None:
    """The rank's last cell error as the teardown found it, for `%dist_debug`."""
    return _KEPT_ERROR[0] if _KEPT_ERROR else None
