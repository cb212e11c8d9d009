# The head of every script %dist_export writes: nbdist.export.script_text reads this file as
# text, drops these lines down to the shebang, fills in {title}, {nproc}, {filename} and the
# THREADS line, and appends the cells. A real .py file so ruff checks it, shipped as package
# data; never import it (it would start a process group).
#!/usr/bin/env python
"""{title}

Exported by nbdist's %dist_export from the notebook's %%distributed cells and %dist_push
values, in the order they ran.
Run it with one process per rank, e.g.:

    torchrun --nproc-per-node {nproc} {filename}

Every process gets what a notebook rank had: rank, world_size, local_rank, device, dist, torch.
"""

import atexit
import os

import torch
import torch.distributed as dist

try:
    import nbdist  # nbdist.log() is a no-op outside a notebook cluster
except ImportError:  # the script runs without nbdist installed too
    import sys
    import types

    def _needs_nbdist(name):
        raise AttributeError(f"nbdist.{name} needs nbdist installed; without it only nbdist.log"
                             " works (as a no-op)")

    # in sys.modules, so the cells' own `import nbdist` finds it instead of failing
    nbdist = sys.modules["nbdist"] = types.ModuleType("nbdist")
    nbdist.log = lambda *args, **kwargs: None
    nbdist.__getattr__ = _needs_nbdist

THREADS = None
"""Threads per rank: %dist_start --threads in the notebook (None: cores / ranks on this host)."""


def _setup_rank():
    """What nbdist's bootstrap does for a notebook rank, from torchrun's environment."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # threads per rank as nbdist sets them: the notebook's --threads, else this host's cores
    # shared by its ranks (torchrun's own default, OMP_NUM_THREADS=1, would train slower on CPU)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = THREADS or max(1, (cores or 1) // local_world_size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "MASTER_ADDR" not in os.environ:  # plain `python FILE`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            device_id=device if backend == "nccl" else None)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    _free_the_rendezvous_port(rank)
    return rank, world_size, local_rank, device


def _free_the_rendezvous_port(rank):
    """In a notebook cell, MASTER_PORT is free and no agent store exists, so a cell's own
    rendezvous (rpc.init_rpc with env:// or tcp://, a second process group) has rank 0 host its
    store. Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes every rank a client of torchrun's
    store instead, and a tcp:// rendezvous on another port then waits for a server that never
    comes. So: the same as the notebook, a fresh MASTER_PORT chosen by rank 0, no agent store."""
    import socket

    port = [None]
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = [s.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def _cell_boundary():
    """Where one notebook cell ended: every rank had finished it before any began the next."""
    if dist.is_initialized():
        dist.barrier()


def display(*values):
    """IPython's display() in a notebook; plain printing here."""
    for value in values:
        _show(value)


def _show(value):
    """A notebook shows a cell's last expression; the script prints it with the rank."""
    if value is not None:
        print(f"[rank {rank}] {value!r}", flush=True)


rank, world_size, local_rank, device = _setup_rank()
