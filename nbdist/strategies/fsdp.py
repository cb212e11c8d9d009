"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded on dim 0 across
ranks.

Blocks are sharded one by one so only one block is gathered at a time; the root gets the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbdist import torch_support
from nbdist.strategies._common import (
    BlockSpec,
    OptimizerArg,
    StrategyOptionError,
    apply_activation_checkpointing,
    broadcast_from_rank0,
    check_known,
    find_blocks,
    param_names,
    rank_device,
    rebind_optimizer,
    refuse_spread,
    reject,
)
from nbdist.strategies.base import GRAD_SCALER, Sharding
from nbdist.strategies.torch_native import TorchNativeStrategy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


@dataclass
class FSDPOptions:
    """The options `prepare(..., strategy="fsdp", ...)` takes: FSDP2's `fully_shard` per block."""

    reshard_after_forward: bool = True
    """True: free gathered params after forward (FULL_SHARD, ~ZeRO-3); False: keep them until
    backward ends (SHARD_GRAD_OP, ~ZeRO-2: more memory, one all-gather less per step)."""

    sharding: str | None = None
    """Alias for reshard_after_forward: "full_shard" or "shard_grad_op"."""

    wrap: BlockSpec = "auto"
    """Blocks sharded as their own unit ("auto": children of each ModuleList); None: root only."""

    mixed_precision: str | None = None
    """"bf16" or "fp16": compute in that dtype; params stay fp32 sharded, grads reduce and outputs
    return in fp32. fp16 also gets a ``torch.amp.GradScaler`` (``Prepared.grad_scaler``), driven
    by ``Prepared.backward`` and ``step``: small fp16 gradients would otherwise round to zero."""

    cpu_offload: bool = False
    """Keep sharded params, grads and the optimizer step on the CPU (CPUOffloadPolicy)."""

    activation_checkpointing: BlockSpec = None
    """Recompute these blocks' activations in backward ("auto": children of each ModuleList)."""

    sync_module_states: bool = True
    """Broadcast rank 0's weights before sharding, so ranks that initialised differently agree."""


_OFFLOAD_TOGETHER = (
    "FSDP offloads params, grads and the optimizer step together: use cpu_offload=True"
)

HINTS = {
    "zero_stage": "ZeRO stages are DeepSpeed's; with FSDP use reshard_after_forward=True "
    "(full shard, ~ZeRO-3) or reshard_after_forward=False (shard grad op, ~ZeRO-2), "
    "or strategy='deepspeed', zero_stage=N",
    "offload_optimizer": _OFFLOAD_TOGETHER,
    "offload_param": _OFFLOAD_TOGETHER,
    "nvme_path": "FSDP cannot offload to disk; use strategy='deepspeed', zero_stage=3,"
    " offload_param='nvme'",
    "config": "a config is DeepSpeed's; use strategy='deepspeed'",
    "gradient_as_bucket_view": "a DDP option; FSDP has no buckets to view",
    "find_unused_parameters": "a DDP option; FSDP handles unused parameters itself",
}

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def wrap(
    model: nn.Module, optimizer: OptimizerArg, **options: Any
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Shard ``model`` in place with ``fully_shard``; rebind the optimizer to the sharded params."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reject(options, HINTS, "fsdp")
    check_known(options, [f.name for f in dataclasses.fields(FSDPOptions)], "fsdp")
    opts = FSDPOptions(**options)
    reshard = _reshard_after_forward(opts)
    mp_policy = _precision_policy(opts.mixed_precision)
    # fully_shard moves every parameter and buffer to its mesh's one device
    refuse_spread(model, "fsdp", "puts each rank's shards on one device")
    device = rank_device()
    if device.type == "cpu":
        torch_support.require("fsdp2-cpu")
    if opts.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    else:
        offload = OffloadPolicy()

    names = param_names(model)
    if opts.sync_module_states:
        broadcast_from_rank0(model)
    apply_activation_checkpointing(model, opts.activation_checkpointing)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard,
        "mp_policy": mp_policy,
        "offload_policy": offload,
    }
    # Innermost first: fully_shard groups whatever parameters are not yet claimed by a child.
    for block in reversed(find_blocks(model, opts.wrap)):
        fully_shard(block, **kwargs)
    if opts.mixed_precision is not None:
        # the model's output in fp32 (the root's only: a block's output feeds the root's own
        # layers, in param_dtype): a loss against an fp32 target fails in backward on
        # torch < 2.13 otherwise ("Found dtype Float but expected BFloat16")
        kwargs["mp_policy"] = dataclasses.replace(mp_policy, output_dtype=torch.float32)
    fully_shard(model, **kwargs)
    if opts.mixed_precision is not None and _DTYPES[opts.mixed_precision] == "float16":
        # as torch's own FSDP2 tests do: the plain torch.amp scaler takes FSDP2's DTensor
        # gradients, and DTensor reduces its inf/nan check over the mesh (a max), so every rank
        # skips the same steps
        setattr(model, GRAD_SCALER, torch.amp.GradScaler(device.type))
    return model, rebind_optimizer(optimizer, names, model)


def _precision_policy(mixed_precision: str | None) -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if mixed_precision not in _DTYPES:
        raise StrategyOptionError(
            f"mixed_precision={mixed_precision!r}: use 'bf16', 'fp16' or None"
        )
    dtype = getattr(torch, _DTYPES[mixed_precision])
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _reshard_after_forward(opts: FSDPOptions) -> bool:
    if opts.sharding is None:
        return opts.reshard_after_forward
    choices = {"full_shard": True, "shard_grad_op": False}
    if opts.sharding.lower() not in choices:
        raise StrategyOptionError(
            f"sharding={opts.sharding!r}: use 'full_shard' or 'shard_grad_op'"
        )
    return choices[opts.sharding.lower()]


@dataclass(frozen=True)
class FSDPStrategy(TorchNativeStrategy):
    """FSDP2: FULL_SHARD (~ZeRO-3) frees gathered params after forward; SHARD_GRAD_OP (~ZeRO-2)
    keeps them until backward ends."""

    family: str = "fsdp"

    def wrap(self, model: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, Any]:
        return wrap(model, optimizer, **options)

    def backward(self, model: Any, loss: Any) -> None:
        scaler = getattr(model, GRAD_SCALER, None)
        (loss if scaler is None else scaler.scale(loss)).backward()

    def step(self, model: Any, optimizer: Any) -> None:
        scaler = getattr(model, GRAD_SCALER, None)
        if scaler is None or optimizer is None:
            super().step(model, optimizer)
            return
        scaler.step(optimizer)  # skipped when a gradient is inf or nan on any rank
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


FSDP_FULL_SHARD = FSDPStrategy("fsdp", Sharding(params=True, grads=True, optimizer=True))
# Gathered params live from forward to the end of backward, so at the peak they are not sharded.
FSDP_SHARD_GRAD_OP = FSDPStrategy(
    "fsdp_shard_grad_op", Sharding(params=False, grads=True, optimizer=True)
)

_RESHARDING = ("reshard_after_forward", "sharding")


def strategy_for(name: str, options: dict[str, Any]) -> tuple[FSDPStrategy, dict[str, Any]]:
    """The FSDP strategy ``name`` plus ``options`` selects, and the options that realise it."""
    given = {key: options[key] for key in _RESHARDING if key in options}
    reshard = _reshard_after_forward(FSDPOptions(**given))
    if name != FSDP_SHARD_GRAD_OP.name:
        return (FSDP_FULL_SHARD if reshard else FSDP_SHARD_GRAD_OP), options
    if given and reshard:
        raise StrategyOptionError(
            "strategy='fsdp_shard_grad_op' keeps gathered parameters until backward, but"
            f" {given} asks for a full shard: drop it, or use strategy='fsdp'"
        )
    return FSDP_SHARD_GRAD_OP, options if given else {**options, "reshard_after_forward": False}
