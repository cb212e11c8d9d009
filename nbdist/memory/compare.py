"""The training loop behind ``nbdist.compare_strategies``: same model, same data, one strategy after
another, model states measured after every backward and set beside the formula.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from nbdist.memory.estimate import estimate_memory, normalize_strategy

MICRO_BATCHES = 2


def prepare_args(strategy: str) -> tuple[str, dict[str, Any]]:
    """The ``nbdist.prepare`` strategy and options that realise an estimator strategy name."""
    name = normalize_strategy(strategy)
    if name.startswith("zero"):
        return "deepspeed", {"zero_stage": int(name[-1]), "gradient_accumulation_steps": MICRO_BATCHES}
    if name == "fsdp_shard_grad_op":
        return "fsdp", {"reshard_after_forward": False}
    return name, {}


def run_comparison(
    model_fn: Callable[[], Any],
    batch: Any,
    loss_fn: Callable[[Any], Any],
    optimizer_fn: Callable[[Any], Any] | None,
    strategies: Sequence[str],
    steps: int,
    precision: str,
) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from nbdist.memory.ledger import account
    from nbdist.memory import _gather
    from nbdist.strategies import prepare

    if optimizer_fn is None:
        optimizer_fn = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    world = dist.get_world_size()
    rows: list[dict[str, Any]] = []
    for strategy in strategies:
        name = normalize_strategy(strategy)
        kind, options = prepare_args(name)
        torch.manual_seed(0)
        model = model_fn()
        param_count = sum(p.numel() for p in model.parameters())
        prepared = prepare(model, optimizer_fn, kind, **options)
        device = next(iter(prepared.model.parameters())).device
        peak: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0}
        losses: list[float] = []
        started = time.perf_counter()
        for _ in range(steps):
            for _micro in range(MICRO_BATCHES):
                loss = loss_fn(_call(prepared.model, batch))
                losses.append(float(loss.detach()))
                # DeepSpeed divides by gradient_accumulation_steps itself; the others need it here.
                prepared.backward(loss if kind == "deepspeed" else loss / MICRO_BATCHES)
                ledger = account(prepared.model, prepared.optimizer, device.type)
                if sum(ledger.bytes[c] for c in peak) > sum(peak.values()):
                    peak = {c: ledger.bytes[c] for c in peak}
                if kind == "deepspeed":
                    prepared.step()  # a no-op off the accumulation boundary, but DeepSpeed counts it
            if kind != "deepspeed":
                prepared.step()
        seconds = (time.perf_counter() - started) / steps
        estimate = estimate_memory(param_count, world, name, precision=precision)
        measured = sum(peak.values())
        rows.append({
            "strategy": name, "rank": dist.get_rank(), "measured": measured, **peak,
            "estimated": estimate.model_states, "ratio": measured / estimate.model_states,
            "formula": estimate.formula, "losses": losses, "step_seconds": seconds,
        })
        _release(prepared)
        del model, prepared
        gc.collect()
    return [row for rank_rows in _gather(rows) for row in rank_rows]


def _call(model: Any, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _release(prepared: Any) -> None:
    destroy = getattr(prepared.model, "destroy", None)  # DeepSpeedEngine: drop hooks and buffers
    if prepared.strategy == "deepspeed" and callable(destroy):
        destroy()
