"""``nbdist.prepare``: wrap a model and optimizer for DDP, FSDP2 or DeepSpeed inside a rank.

One call on CPU and GPU alike; each strategy's options live in its own module (ddp, fsdp,
deepspeed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbdist.strategies._common import OptimizerArg, StrategyOptionError
from nbdist.strategies.base import Strategy
from nbdist.strategies.prepared import Prepared
from nbdist.strategies.registry import FAMILIES, STRATEGY_NAMES, get_strategy, resolve

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = [
    "Prepared",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "Strategy",
    "StrategyOptionError",
    "get_strategy",
    "prepare",
]

STRATEGIES = FAMILIES
"""The libraries prepare() wraps with: ddp, fsdp, deepspeed (each of STRATEGY_NAMES maps to one)."""


def prepare(
    model: nn.Module,
    optimizer: OptimizerArg = None,
    strategy: str = "ddp",
    **options: Any,
) -> Prepared:
    """Wrap ``model`` (and ``optimizer``) for data-parallel training across the process group.

    ``strategy`` is ddp, fsdp (FULL_SHARD), fsdp_shard_grad_op, zero0-zero3 (DeepSpeed; the same
    names ``estimate_memory`` takes), or deepspeed with ``zero_stage=N``.

    ``optimizer`` may be an optimizer built on ``model.parameters()``, a factory
    ``params -> optimizer`` (preferred with FSDP, which replaces the parameters), or None.
    Options per strategy (see ``DDPOptions``, ``FSDPOptions``, ``DeepSpeedOptions``):

    - ddp: ``gradient_as_bucket_view``, ``find_unused_parameters``, ``static_graph``,
      ``bucket_cap_mb``, ``activation_checkpointing``
    - fsdp: ``reshard_after_forward`` (or ``sharding="full_shard"|"shard_grad_op"``), ``wrap``,
      ``mixed_precision="bf16"|"fp16"``, ``cpu_offload``, ``activation_checkpointing``
    - deepspeed: ``zero_stage``, ``offload_optimizer``/``offload_param`` = "cpu"|"nvme",
      ``nvme_path``, ``mixed_precision``, ``micro_batch_size``, ``gradient_clipping``,
      ``activation_checkpointing``, or ``config`` (dict or JSON path, used untouched)

    A wrong option or combination raises :class:`StrategyOptionError` saying what to change.
    Runs on every rank, after the process group exists.
    """
    import torch.distributed as dist

    handler, options = resolve(strategy, options)
    if not (dist.is_available() and dist.is_initialized()):
        raise StrategyOptionError(
            "prepare() runs inside a rank of a started cluster (torch.distributed is not"
            " initialised here): call it in a %%distributed cell after %dist_start"
        )
    wrapped, wrapped_optimizer = handler.wrap(model, optimizer, options)
    return Prepared(
        model=wrapped,
        optimizer=wrapped_optimizer,
        strategy=handler.family,
        options=dict(options),
        handler=handler,
    )
