"""``nbdist.prepare``: wrap a model and optimizer for DDP, FSDP2 or DeepSpeed inside a rank.

One call on CPU and GPU alike; each strategy's options live in its own module (ddp, fsdp, deepspeed).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbdist.strategies._common import OptimizerArg, StrategyOptionError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = ["Prepared", "StrategyOptionError", "prepare", "STRATEGIES"]

STRATEGIES = ("ddp", "fsdp", "deepspeed")


@dataclass
class Prepared:
    """What :func:`prepare` returns; unpacks as ``model, optimizer = nbdist.prepare(...)``."""

    model: Any
    """The wrapped model: a DDP module, the FSDP-sharded module itself, or a DeepSpeedEngine."""

    optimizer: Any
    """The optimizer to step (rebound to sharded params for FSDP; DeepSpeed's wrapper for ZeRO)."""

    strategy: str
    """"ddp", "fsdp" or "deepspeed"."""

    options: dict[str, Any] = field(default_factory=dict)
    """The options prepare() was given, for display and for checkpoint metadata."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.model, self.optimizer))

    def __repr__(self) -> str:  # the model's own repr can run to pages; this fits a cell output
        return (f"Prepared(strategy={self.strategy!r}, model={type(self.model).__name__}, "
                f"optimizer={type(self.optimizer).__name__}, options={self.options!r})")

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, or ``engine.backward(loss)`` under DeepSpeed (it scales and reduces)."""
        if self.strategy == "deepspeed":
            self.model.backward(loss)
        else:
            loss.backward()

    def step(self) -> None:
        """Optimizer step and gradient reset, the way the strategy wants it."""
        if self.strategy == "deepspeed":
            self.model.step()  # steps, zeroes grads and advances DeepSpeed's own counters
        elif self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def prepare(
    model: nn.Module,
    optimizer: OptimizerArg = None,
    strategy: str = "ddp",
    **options: Any,
) -> Prepared:
    """Wrap ``model`` (and ``optimizer``) for data-parallel training across the process group.

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

    name = strategy.lower()
    if name not in STRATEGIES:
        hint = " (ZeRO stages: strategy='deepspeed', zero_stage=N)" if name.startswith("zero") else ""
        raise StrategyOptionError(f"strategy={strategy!r}: use one of {', '.join(STRATEGIES)}{hint}")
    if not (dist.is_available() and dist.is_initialized()):
        raise StrategyOptionError(
            "prepare() runs inside a rank of a started cluster (torch.distributed is not initialised "
            "here): call it in a %%distributed cell after %dist_start"
        )
    module = importlib.import_module(f"nbdist.strategies.{name}")
    wrapped, wrapped_optimizer = module.wrap(model, optimizer, **options)
    return Prepared(model=wrapped, optimizer=wrapped_optimizer, strategy=name, options=dict(options))
