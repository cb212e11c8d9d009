"""The rank's torch.distributed process group: one generation at a time, each on a fresh store.

A generation is torn down (so peers blocked on this rank fail at once instead of waiting for the
timeout) and rebuilt on a new port; the notebook side decides when (see nbdist.faults).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any


def init_generation(
    backend: str,
    master_addr: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    gpu: int | None,
    generation: int,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(port)
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and gpu is not None:
        kwargs["device_id"] = torch.device("cuda", gpu)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    check = torch.ones(1, device=f"cuda:{gpu}" if backend == "nccl" else "cpu") * (rank + 1)
    dist.all_reduce(check)
    expected = world_size * (world_size + 1) / 2
    if float(check.item()) != expected:
        raise RuntimeError(
            f"process group check failed on rank {rank}: all_reduce gave {check.item()}, "
            f"expected {expected}"
        )
    return {"generation": generation, "seconds": time.perf_counter() - started}


def teardown() -> bool:
    """Destroy the current process group if any; True if there was one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    try:
        dist.destroy_process_group()
    except Exception:
        # a broken group can fail to destroy cleanly; what matters is that its sockets close
        pass
    return True


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
