"""The ``Strategy`` protocol: one object per way of wrapping a model (DDP, FSDP, each ZeRO stage).

``prepare``, ``Prepared.backward/step``, the checkpoint functions and the memory estimator all go
through it, so nothing outside a strategy's own module branches on its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

GRAD_SCALER = "nbdist_grad_scaler"
"""The attribute of a prepared model that holds its gradient scaler, when its precision needs one
(fp16); ``Prepared.backward`` / ``step`` drive it."""


@dataclass(frozen=True)
class Sharding:
    """Which model states a strategy splits across the data-parallel ranks at the peak of a step."""

    params: bool
    grads: bool
    optimizer: bool


@runtime_checkable
class Strategy(Protocol):
    """How one strategy wraps, trains, checkpoints and budgets memory (see ddp, fsdp, deepspeed)."""

    name: str
    """The one name prepare() and estimate_memory() share: ddp, fsdp, fsdp_shard_grad_op, zeroN."""

    family: str
    """The library that does the wrapping: "ddp", "fsdp" or "deepspeed" (``Prepared.strategy``)."""

    sharding: Sharding
    """What the ZeRO formulas divide by the world size (ZeRO paper §5)."""

    checkpoint_format: str
    """What save_state writes: "dcp" (readable at any world size) or "deepspeed"."""

    engine_accumulates: bool
    """True when the wrapper scales the loss for gradient accumulation and steps only at the
    accumulation boundary itself (DeepSpeed); False when the training loop does both."""

    def wrap(self, model: Any, optimizer: Any, options: dict[str, Any]) -> tuple[Any, Any]:
        """The wrapped model and the optimizer to step, on this rank (a collective)."""
        ...

    def backward(self, model: Any, loss: Any) -> None:
        """Backward through the wrapped model the way the strategy needs it."""
        ...

    def step(self, model: Any, optimizer: Any) -> None:
        """Optimizer step and gradient reset."""
        ...

    def bytes_per_param(self, precision: str) -> tuple[float, float, float]:
        """(params, grads, optimizer) bytes per parameter with Adam, before sharding."""
        ...

    def save_state(self, path: Path, model: Any, optimizer: Any) -> None:
        """Write this rank's part of the checkpoint into the directory ``path`` (a collective)."""
        ...

    def load_state(self, path: Path, model: Any, optimizer: Any, saved_format: str) -> None:
        """Load a checkpoint of ``saved_format`` into the wrapped model (and optimizer)."""
        ...

    def release(self, model: Any) -> None:
        """Drop what the wrapper holds beyond the model (hooks, buffers) before it is discarded."""
        ...


def adam_bytes(precision: str, fp32_master: bool) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter for Adam.

    mixed: 2 + 2 + 12 (fp32 master, momentum, variance), the paper's K = 12.
    fp32: 4 + 4 + 8 without a master copy; ``fp32_master`` (DeepSpeed's ZeRO clones an fp32
    master partition even for an fp32 model, as of DeepSpeed 0.19) makes K = 12.
    """
    if precision == "mixed":
        return (2.0, 2.0, 12.0)
    if precision == "fp32":
        return (4.0, 4.0, 12.0 if fp32_master else 8.0)
    raise ValueError(f"precision={precision!r}: use 'mixed' (16-bit + fp32 master) or 'fp32'")
