"""``nbdist.compare_strategies``: same model, same data, one strategy after another, model states
measured after every backward and set beside the ZeRO formula.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nbdist.memory.breakdown import gather_from_ranks
from nbdist.memory.estimate import estimate_memory
from nbdist.text import format_bytes, render_table

MICRO_BATCHES = 2

_HEADER = ("strategy", "rank", "measured", "estimated", "ratio", "params", "grads", "optimizer",
           "first loss", "last loss", "step s")


@dataclass
class StrategyComparison:
    """Measured beside estimated model-state bytes, one row per (strategy, rank)."""

    rows: list[dict[str, Any]]

    def table(self) -> str:
        lines = [
            (
                r["strategy"], r["rank"], format_bytes(r["measured"]), format_bytes(r["estimated"]),
                f"{r['ratio']:.3f}", format_bytes(r["params"]), format_bytes(r["grads"]),
                format_bytes(r["optimizer"]), f"{r['losses'][0]:.4g}", f"{r['losses'][-1]:.4g}",
                f"{r['step_seconds']:.3f}",
            )
            for r in self.rows
        ]
        return render_table(_HEADER, lines, align="right")

    def __str__(self) -> str:
        return self.table()


def compare_strategies(
    model_fn: Callable[[], Any],
    batch: Any,
    loss_fn: Callable[[Any], Any],
    *,
    optimizer_fn: Callable[[Any], Any] | None = None,
    strategies: Sequence[str] = ("ddp", "zero1", "zero2", "zero3", "fsdp"),
    steps: int = 3,
    precision: str = "fp32",
) -> StrategyComparison:
    """Train ``steps`` steps of ``model_fn()`` under each strategy; measured beside estimated.

    Runs on every rank (a collective). Each step takes two micro-batches of ``batch``, and model
    states are measured after each backward; the peak is reported. Two micro-batches matter for
    DeepSpeed's stage 1, which keeps full gradients only while it accumulates (at one micro-batch
    per step it reduces them into partitions during backward, like stage 2).
    """
    import torch

    if optimizer_fn is None:
        optimizer_fn = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    rows = []
    for strategy in strategies:
        rows.append(_measure(strategy, model_fn, batch, loss_fn, optimizer_fn, steps, precision))
        gc.collect()
    return StrategyComparison([row for rank_rows in gather_from_ranks(rows) for row in rank_rows])


def _measure(strategy: str, model_fn: Callable[[], Any], batch: Any, loss_fn: Callable[[Any], Any],
             optimizer_fn: Callable[[Any], Any], steps: int, precision: str) -> dict[str, Any]:
    """Train under one strategy and return its row: peak model states beside the formula."""
    import torch
    import torch.distributed as dist

    from nbdist.memory.ledger import account
    from nbdist.strategies import get_strategy, prepare

    handler = get_strategy(strategy)
    # An engine that accumulates itself is told the micro-batch count; other loops scale the loss.
    options = {"gradient_accumulation_steps": MICRO_BATCHES} if handler.engine_accumulates else {}
    torch.manual_seed(0)
    model = model_fn()
    param_count = sum(p.numel() for p in model.parameters())
    prepared = prepare(model, optimizer_fn, handler.name, **options)
    device = next(iter(prepared.model.parameters())).device
    peak: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0}
    losses: list[float] = []
    started = time.perf_counter()
    for _ in range(steps):
        for _micro in range(MICRO_BATCHES):
            loss = loss_fn(_call(prepared.model, batch))
            losses.append(float(loss.detach()))
            prepared.backward(loss if handler.engine_accumulates else loss / MICRO_BATCHES)
            ledger = account(prepared.model, prepared.optimizer, device.type)
            if sum(ledger.bytes[c] for c in peak) > sum(peak.values()):
                peak = {c: ledger.bytes[c] for c in peak}
            if handler.engine_accumulates:
                prepared.step()  # a no-op off the accumulation boundary, but the engine counts it
        if not handler.engine_accumulates:
            prepared.step()
    seconds = (time.perf_counter() - started) / steps
    world_size = dist.get_world_size()
    estimate = estimate_memory(param_count, world_size, handler.name, precision=precision)
    measured = sum(peak.values())
    handler.release(prepared.model)
    return {
        "strategy": handler.name, "rank": dist.get_rank(), "measured": measured, **peak,
        "estimated": estimate.model_states, "ratio": measured / estimate.model_states,
        "formula": estimate.formula, "losses": losses, "step_seconds": seconds,
    }


def _call(model: Any, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
