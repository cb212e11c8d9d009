"""The per-rank memory budget (`--memory-limit`), applied inside the rank after start-up so that
the notebook, the controller and the engine's nanny stay unlimited.

CPU: the soft RLIMIT_DATA becomes what the rank's data mappings hold after start-up plus the
budget. RLIMIT_DATA counts private writable mappings (heap, anonymous mmaps: every tensor) and not
the shared libraries or the PROT_NONE reservations glibc makes per thread, which RLIMIT_AS counts:
measured in an nbdist rank after `import torch` and the gloo group, VmSize is ~1.4 GiB, VmData
~0.3 GiB and VmRSS ~0.25 GiB (numbers and the choice: docs/FAULTS.md). An allocation past
it fails where it is made: MemoryError, or torch's "DefaultCPUAllocator: can't allocate memory".
GPU: `torch.cuda.set_per_process_memory_fraction` caps what torch's CUDA caching allocator
reserves (its cached blocks count, not only live tensors) at the budget. Outside it: the CUDA
context, and NCCL's own buffers (cudaMalloc'd by NCCL, not through torch's allocator).
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nbdist.worker.memory_sampler import libc, read_status

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

STATE: dict[str, Any] = {}
"""What `apply_memory_limit` did in this process: mechanism, limit, baseline, soft_limit."""


def data_bytes() -> int:
    """VmData (private writable mappings: what RLIMIT_DATA counts) in bytes; 0 off Linux."""
    try:
        return read_status("VmData").get("VmData", 0)
    except OSError:
        return 0


def apply_memory_limit(limit: int | None, device: Any) -> dict[str, Any]:
    """Cap what this rank may allocate from now on at `limit` bytes (None: leave it unlimited)."""
    if limit is None:
        return {}
    if getattr(device, "type", "cpu") == "cuda":
        return _cap_cuda(int(limit), device)
    fixed_threshold = _return_freed_memory()
    baseline = data_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    new_soft = baseline + int(limit)
    if hard != resource.RLIM_INFINITY:
        new_soft = min(new_soft, hard)
    # the soft limit only: the rank (or nbdist) may lift it again; a budget, not a sandbox
    resource.setrlimit(resource.RLIMIT_DATA, (new_soft, hard))
    STATE.clear()
    STATE.update(mechanism="RLIMIT_DATA", limit=int(limit), baseline=baseline, soft_limit=new_soft,
                 previous_soft_limit=soft, mmap_threshold_fixed=fixed_threshold)
    return dict(STATE)


def _return_freed_memory() -> bool:
    """glibc: serve every block of 128 KiB or more with its own mmap, unmapped when freed. By
    default glibc raises that threshold after the first large free (up to 32 MiB), and freed
    tensors then stay in the heap, still counted against the budget (measured: a model's 80 MiB
    of full parameters, sharded by FSDP, still counted after the shards replaced them)."""
    try:
        return bool(libc().mallopt(_M_MMAP_THRESHOLD, 128 * 1024))
    except (OSError, AttributeError):  # not glibc
        return False


def _cap_cuda(limit: int, device: Any) -> dict[str, Any]:
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, limit / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    STATE.clear()
    STATE.update(mechanism="cuda memory fraction", limit=limit, baseline=0, fraction=fraction,
                 total=total, device=str(device))
    return dict(STATE)


def memory_budget() -> dict[str, Any]:
    """This rank's budget now: the limit, and how much of it is in use (CPU: VmData beyond the
    start-up baseline; GPU: torch.cuda.memory_reserved, what the cap counts, with
    ``allocated`` beside it)."""
    if not STATE:
        return {"limit": None, "in_use": None}
    if STATE["mechanism"] == "RLIMIT_DATA":
        in_use = data_bytes() - STATE["baseline"]
    else:
        import torch

        device = STATE["device"]
        return {"limit": STATE["limit"], "in_use": torch.cuda.memory_reserved(device),
                "allocated": torch.cuda.memory_allocated(device),
                "mechanism": STATE["mechanism"]}
    return {"limit": STATE["limit"], "in_use": in_use, "mechanism": STATE["mechanism"]}


@contextmanager
def lifted() -> Iterator[None]:
    """The CPU budget lifted while nbdist itself works inside the rank: formatting the very error
    that hit the limit needs memory too (IPython's traceback formatter failed there otherwise)."""
    if STATE.get("mechanism") != "RLIMIT_DATA":
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
