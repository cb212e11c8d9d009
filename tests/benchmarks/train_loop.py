"""The one DDP training loop B4 times, both inside a ``%%distributed`` cell and under torchrun.

A 4 × 1024 MLP (docs/BENCHMARKS.md), SGD, a fixed batch; rank 0 reports steps/s over the timed steps.
``log`` is ``nbdist.log`` in the nbdist cell (dashboard on) and a no-op under torchrun.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def build(width: int = 1024, depth: int = 4, batch: int = 64) -> tuple[Any, Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(batch, width)
    return model, optimizer, data


def train(steps: int, warmup: int = 3, log: Callable[..., None] | None = None,
          stop_after: float | None = None) -> dict[str, Any]:
    """Run `warmup` + `steps` DDP steps; returns steps/s over the timed steps (and the threads)."""
    import torch

    model, optimizer, data = build()
    started = 0.0
    done = 0
    for index in range(warmup + steps):
        if index == warmup:
            started = time.perf_counter()
        loss = model(data).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if log is not None:
            log(step=index, loss=loss)
        done = index + 1
        if stop_after is not None and time.perf_counter() - started > stop_after and index >= warmup:
            break
    seconds = time.perf_counter() - started
    timed = max(done - warmup, 1)
    return {"steps_per_s": timed / seconds, "steps": timed, "threads": torch.get_num_threads()}


def main() -> None:  # torchrun entry point
    import torch
    import torch.distributed as dist

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    out = train(steps)
    dist.barrier()
    if dist.get_rank() == 0:
        print("NBDIST_BENCH " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
