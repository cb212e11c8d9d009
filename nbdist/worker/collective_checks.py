"""check_collectives on a rank: torch wraps each group it creates so that every collective's
operation and shapes are compared across ranks before it runs (TORCH_DISTRIBUTED_DEBUG=DETAIL),
and a mismatch raises on every rank instead of ending one inside gloo."""

from __future__ import annotations

import os
import subprocess
import sys

DDP_PROBE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
"""
"""Builds a DDP model on a one-rank group: some torch releases (2.13) crash doing so under
DETAIL, in DDP's construction logging; a rank must say so before the user's DDP ends it."""


def apply(check: bool) -> list[str]:
    """Set the debug level (torch read TORCH_DISTRIBUTED_DEBUG once, at import: a value the user
    exported for the engines is read again too); the notes the user should see at start."""
    from torch._C import _distributed_c10d

    if check:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if "TORCH_DISTRIBUTED_DEBUG" not in os.environ:
        return []
    _distributed_c10d.set_debug_level_from_env()
    if os.environ["TORCH_DISTRIBUTED_DEBUG"].strip().upper() != "DETAIL" or ddp_survives():
        return []
    import torch

    return [f"collective checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) are on, and on torch "
            f"{torch.__version__} DistributedDataParallel crashes the process (SIGSEGV) under "
            "them: a DDP model would end its engine. Start without --check-collectives to "
            "train with DDP (FSDP2 and plain collectives are checked fine)."]


def ddp_survives() -> bool:
    """Whether building a DDP model under DETAIL leaves a process alive (in a child process)."""
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL", OMP_NUM_THREADS="1")
    try:
        probe = subprocess.run([sys.executable, "-c", DDP_PROBE], env=env, timeout=120,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0
