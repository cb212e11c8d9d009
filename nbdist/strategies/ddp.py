"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets.

The right choice while parameters, gradients and optimizer state fit on one device (see
nbdist.advise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbdist.strategies._common import (
    BlockSpec,
    OptimizerArg,
    apply_activation_checkpointing,
    check_known,
    param_names,
    rank_device,
    rebind_optimizer,
    reject,
    spread_over_gpus,
)
from nbdist.strategies.base import Sharding
from nbdist.strategies.torch_native import TorchNativeStrategy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


@dataclass
class DDPOptions:
    """The options `prepare(model, optimizer, strategy="ddp", ...)` takes."""

    gradient_as_bucket_view: bool = True
    """Gradients are views into DDP's all-reduce buckets, which saves one gradient-sized copy."""

    find_unused_parameters: bool = False
    """Needed when some parameters get no gradient in a step (costs a graph traversal per step)."""

    static_graph: bool = False
    """Promise the same graph every step: more overlap, and unused params with checkpointing."""

    bucket_cap_mb: float | None = None
    """All-reduce bucket size in MiB (None: DDP's default of 25)."""

    activation_checkpointing: BlockSpec = None
    """Recompute these blocks' activations in backward ("auto": children of each ModuleList)."""


HINTS = {
    "cpu_offload": "DDP keeps a full replica on every rank and cannot offload; use "
    "strategy='fsdp', cpu_offload=True or strategy='deepspeed', offload_optimizer='cpu'",
    "offload_optimizer": "offloading needs sharding; use strategy='deepspeed' (ZeRO) instead",
    "offload_param": "offloading needs sharding; use strategy='deepspeed', zero_stage=3",
    "zero_stage": "ZeRO stages are DeepSpeed's; use strategy='deepspeed', zero_stage=N "
    "(or strategy='fsdp' for a ZeRO-3-like full shard)",
    "reshard_after_forward": "resharding is an FSDP option; use strategy='fsdp'",
    "wrap": "per-block wrapping is an FSDP option; use strategy='fsdp'",
    "mixed_precision": "DDP has no precision policy; wrap the forward in "
    "torch.autocast(device.type, dtype=torch.bfloat16) in your loop, or use strategy='fsdp'",
    "config": "a config is DeepSpeed's; use strategy='deepspeed'",
}


def wrap(
    model: nn.Module, optimizer: OptimizerArg, **options: Any
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Wrap ``model`` in DDP on this rank's device (a model already split over the rank's GPUs
    stays where it is); the optimizer keeps its parameters."""
    from torch.nn.parallel import DistributedDataParallel

    reject(options, HINTS, "ddp")
    check_known(options, [f.name for f in dataclasses.fields(DDPOptions)], "ddp")
    opts = DDPOptions(**options)
    names = param_names(model)
    apply_activation_checkpointing(model, opts.activation_checkpointing)
    device = rank_device()
    # a model the user split over the rank's GPUs stays where it is: DDP takes such a
    # multi-device module with device_ids=None, and its forward places each input itself
    multi_device = bool(spread_over_gpus(model))
    if not multi_device:
        model.to(device)  # in place: the optimizer's parameter objects stay valid
    extra = {} if opts.bucket_cap_mb is None else {"bucket_cap_mb": opts.bucket_cap_mb}
    arguments = dict(
        device_ids=[device.index] if device.type == "cuda" and not multi_device else None,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        find_unused_parameters=opts.find_unused_parameters,
        static_graph=opts.static_graph,
        **extra,
    )
    wrapped = DistributedDataParallel(model, **arguments)
    # nbdist wraps the module again with these when it re-forms the group after a fault
    wrapped._nbdist_ddp_options = arguments
    return wrapped, rebind_optimizer(optimizer, names, wrapped.module)


@dataclass(frozen=True)
class DDPStrategy(TorchNativeStrategy):
    """A full replica per rank, nothing sharded: 16Ψ model-state bytes with mixed-precision Adam."""

    family: str = "ddp"

    def wrap(self, model: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, Any]:
        return wrap(model, optimizer, **options)


DDP = DDPStrategy("ddp", Sharding(params=False, grads=False, optimizer=False))
