"""Every strategy under its one name: the names ``prepare()`` and ``estimate_memory()`` both
accept, and which strategy wrapped a model that arrives without its ``Prepared`` (checkpoints).
"""

from __future__ import annotations

from typing import Any

from nbdist.strategies import deepspeed, fsdp
from nbdist.strategies._common import StrategyOptionError
from nbdist.strategies.base import Strategy
from nbdist.strategies.ddp import DDP
from nbdist.strategies.deepspeed import ZERO_STAGES
from nbdist.strategies.fsdp import FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP

STRATEGIES_BY_NAME: dict[str, Strategy] = {
    strategy.name: strategy
    for strategy in (
        DDP, ZERO_STAGES[1], ZERO_STAGES[2], ZERO_STAGES[3], FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
        ZERO_STAGES[0],
    )
}
STRATEGY_NAMES = tuple(STRATEGIES_BY_NAME)
"""ddp, zero1, zero2, zero3, fsdp (FULL_SHARD), fsdp_shard_grad_op, zero0."""

FAMILIES = ("ddp", "fsdp", "deepspeed")
"""The libraries behind the names; ``strategy="deepspeed", zero_stage=N`` is ``"zeroN"``."""

ALIASES = {
    "fsdp_full_shard": "fsdp", "full_shard": "fsdp", "shard_grad_op": "fsdp_shard_grad_op",
    "zero-0": "zero0", "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3",
}


def resolve(strategy: str, options: dict[str, Any]) -> tuple[Strategy, dict[str, Any]]:
    """The strategy that ``strategy`` and its ``options`` select, and the options that realise it.

    ``"deepspeed"`` takes its stage from ``zero_stage`` (default 2) or the config; ``"zeroN"`` fills
    in ``zero_stage=N``; ``"fsdp"`` is FULL_SHARD unless the options keep params gathered.
    """
    name = ALIASES.get(strategy.lower(), strategy.lower())
    if name == "deepspeed" or (name in STRATEGIES_BY_NAME and name.startswith("zero")):
        return deepspeed.strategy_for(name, options)
    if name in (FSDP_FULL_SHARD.name, FSDP_SHARD_GRAD_OP.name):
        return fsdp.strategy_for(name, options)
    if name == DDP.name:
        return DDP, options
    hint = ""
    if name.startswith("zero"):
        hint = " (ZeRO stages: strategy='deepspeed', zero_stage=N or strategy='zeroN', N = 0-3)"
    choices = ", ".join((*STRATEGY_NAMES, "deepspeed"))
    raise StrategyOptionError(f"strategy={strategy!r}: use one of {choices}{hint}")


def get_strategy(strategy: str, zero_stage: int | None = None) -> Strategy:
    """The strategy called ``strategy``; ``zero_stage`` picks the stage of ``"deepspeed"``."""
    selected, _ = resolve(strategy, {} if zero_stage is None else {"zero_stage": zero_stage})
    return selected


WRAPPING_FAMILIES = {
    "ddp": "ddp", "fsdp": "fsdp", "fsdp1": "fsdp", "none": "none",
    **{f"zero{stage}": "deepspeed" for stage in ZERO_STAGES},
}
"""What ``wrapping_of`` can answer, each with its library (one of ``FAMILIES``, or none)."""


def wrapping_of(model: Any) -> str:
    """How ``model`` is wrapped now: ``zeroN`` (a DeepSpeedEngine), ``fsdp`` (FSDP2's DTensor
    parameters), ``fsdp1`` (FullyShardedDataParallel), ``ddp``, or ``none`` (a plain module)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    if type(model).__module__.startswith("deepspeed") and hasattr(model, "save_checkpoint"):
        return strategy_of(model).name
    if isinstance(model, FullyShardedDataParallel):
        return "fsdp1"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DDP.name
    if any(hasattr(param, "_local_tensor") for param in model.parameters()):
        return FSDP_FULL_SHARD.name
    return "none"


def strategy_of(model: Any) -> Strategy:
    """The strategy that wrapped ``model``: a DeepSpeedEngine's stage, FSDP2 (DTensor), DDP."""
    if type(model).__module__.startswith("deepspeed") and hasattr(model, "save_checkpoint"):
        stage_of = getattr(model, "zero_optimization_stage", None)
        return ZERO_STAGES.get(stage_of() if callable(stage_of) else 0, ZERO_STAGES[0])
    if any(hasattr(param, "_local_tensor") for param in model.parameters()):
        return FSDP_FULL_SHARD
    return DDP
