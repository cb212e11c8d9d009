"""Two NCCL ranks for the gpu tests that need them: one GPU each where the machine has two or
more, else both on its one GPU (--share-gpu: each rank its own NCCL host, loopback sockets)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nbdist import Cluster

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = GPUS == 1
"""Whether two ranks here share a GPU."""


def two_ranks(config: Any, **kwargs: Any) -> Cluster:
    """A started cluster of two NCCL ranks (sharing the GPU where there is one)."""
    return Cluster(n=2, share_gpu=SHARED, config=config, **kwargs).start()


def at_least_two(cluster: Cluster, config: Any) -> Iterator[Cluster]:
    """For a module fixture: `cluster` (one rank per GPU) where it has two ranks or more, else a
    pair sharing the one GPU, stopped afterwards."""
    if cluster.world_size >= 2:
        yield cluster
        return
    pair = two_ranks(config)
    try:
        yield pair
    finally:
        pair.stop()
