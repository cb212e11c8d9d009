"""One DDP or FSDP2 training step on the GPU, timed: the same file under torchrun and in nbdist
(`%dist_run`, `Cluster.run_script`), for tests/benchmarks/GPU_RESULTS.md (.ci/gpu-check).

    torchrun --standalone --nproc_per_node=1 tests/benchmarks/gpu_step.py ddp --out steps.jsonl

Each rank computes on GPU ``LOCAL_RANK % device_count``: with more ranks than GPUs they share
them, and under torchrun each such rank is then an NCCL host of its own (``NCCL_HOSTID``, socket
transport on loopback), as nbdist's ``--share-gpu`` makes them. Rank 0 appends one JSON line to
``--out``: ms per step (median of the timed steps, each ended by ``torch.cuda.synchronize``),
torch's peak, NVML's figure for the process, device, torch, CUDA, NCCL and driver versions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

WIDTH, DEPTH, BATCH = 4096, 8, 64


def _share_gpu_environment(local_world_size: int, gpus: int, rank: int) -> bool:
    """Under torchrun, ranks beyond the GPUs become NCCL hosts of their own (nbdist does this
    itself: its ranks arrive with NCCL_HOSTID set)."""
    if local_world_size <= gpus or "NCCL_HOSTID" in os.environ:
        return "NCCL_HOSTID" in os.environ
    os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}.gpu-step-rank{rank}"
    os.environ.setdefault("NCCL_NET", "Socket")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return True


def _model(strategy: str, device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index])
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _nvml_process_memory(device: Any) -> int | None:
    """NVML's used memory for this process on its device (its CUDA context included)."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-")
                                                  else f"GPU-{uuid}")
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return int(proc.usedGpuMemory)
    except Exception:
        return None
    return None


def _versions(device: Any) -> dict[str, Any]:
    import torch

    driver = None
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        pass
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda, "driver": driver,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def run(strategy: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    gpus = torch.cuda.device_count()
    shared = _share_gpu_environment(int(os.environ["LOCAL_WORLD_SIZE"]), gpus, rank)
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    model = _model(strategy, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(BATCH, WIDTH, device=device)
    times = []
    for index in range(warmup + steps):
        started = time.perf_counter()
        model(data).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return {"strategy": strategy, "world_size": dist.get_world_size(),
            "launcher": "nbdist" if "NBDIST_DEVICE" in os.environ else "torchrun",
            "shared_gpu": shared, "backend": str(dist.get_backend()), "steps": steps,
            "ms_per_step": round(1000 * statistics.median(times), 2),
            "ms_min": round(1000 * min(times), 2),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "nvml_process": _nvml_process_memory(device), "rank": rank, **_versions(device)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strategy", choices=["ddp", "fsdp2"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    row = run(args.strategy, args.steps, args.warmup)
    import torch.distributed as dist

    if row["rank"] == 0:
        with open(args.out, "a") as out:
            out.write(json.dumps(row) + "\n")
    if "NBDIST_DEVICE" not in os.environ:  # nbdist's ranks keep their group for the next cell
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
