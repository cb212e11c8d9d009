"""``Prepared``: what ``nbdist.prepare`` hands back, the wrapped model and optimizer plus the
strategy that drives their backward, step and checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbdist.strategies.base import GRAD_SCALER, Strategy

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class Prepared:
    """``model, optimizer = nbdist.prepare(...)`` unpacks it; ``prepared.model`` works too."""

    model: Any
    """The wrapped model: a DDP module, the FSDP-sharded module itself, or a DeepSpeedEngine."""

    optimizer: Any
    """The optimizer to step (rebound to sharded params for FSDP; DeepSpeed's wrapper for ZeRO)."""

    strategy: str
    """"ddp", "fsdp" or "deepspeed": the library that wrapped the model."""

    options: dict[str, Any] = field(default_factory=dict)
    """The options prepare() was given, for display and for checkpoint metadata."""

    handler: Strategy | None = field(default=None, repr=False)
    """The Strategy object behind ``strategy`` (looked up from it and the options if None)."""

    def __post_init__(self) -> None:
        if self.handler is None:
            from nbdist.strategies.registry import resolve

            self.handler, _ = resolve(self.strategy, self.options)

    @property
    def name(self) -> str:
        """The strategy's one name, as estimate_memory() takes it: ddp, fsdp, zero2, ..."""
        return self._handler.name

    @property
    def _handler(self) -> Strategy:
        assert self.handler is not None  # __post_init__ always sets it
        return self.handler

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer))

    def __repr__(self) -> str:  # the model's own repr can run to pages; this fits a cell output
        return (
            f"Prepared(strategy={self.strategy!r}, model={type(self.model).__name__}, "
            f"optimizer={type(self.optimizer).__name__}, options={self.options!r})"
        )

    @property
    def grad_scaler(self) -> Any:
        """The loss scaler ``backward`` and ``step`` drive (FSDP with fp16), else None; a loop
        that calls ``loss.backward()`` itself scales with it (``torch.amp.GradScaler``)."""
        return getattr(self.model, GRAD_SCALER, None)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, or ``engine.backward(loss)`` under DeepSpeed (scales, reduces)."""
        self._handler.backward(self.model, loss)

    def step(self) -> None:
        """Optimizer step and gradient reset, the way the strategy wants it."""
        self._handler.step(self.model, self.optimizer)
