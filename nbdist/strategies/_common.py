"""Helpers every strategy shares: option errors, the rank's device, block discovery, activation
checkpointing without model changes, rank-0 weight sync and re-binding an optimizer to new
params.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Union

from nbdist.errors import NbdistError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

BlockSpec = bool | str | type | tuple | Callable[[Any], bool] | None
"""Which submodules are "blocks": ``"auto"``/``True`` (children of every ``nn.ModuleList``), a
module class or tuple of classes, a predicate ``module -> bool``, or ``None``/``False`` (none)."""

OptimizerArg = Union[
    "torch.optim.Optimizer", Callable[[Iterable[Any]], "torch.optim.Optimizer"], None
]


class StrategyOptionError(NbdistError, ValueError):
    """Options the chosen strategy cannot honour, alone or together; the message says what to do."""


DEEPSPEED_MISSING = (
    "strategy='deepspeed' needs DeepSpeed, which is not installed on this rank. "
    "Install it on every rank with `pip install deepspeed` (in a clone of nbdist: "
    "`pip install -e '.[deepspeed]'`), "
    "then %dist_restart; or use strategy='fsdp' (ZeRO-3-like) which needs nothing extra."
)


RANK_DEVICE_VAR = "NBDIST_DEVICE"
"""Set by an nbdist rank to its own device; the same name as nbdist.worker.bootstrap's."""


def rank_device() -> torch.device:
    """The device this rank computes on: the one nbdist pinned it to (a CPU rank on a GPU host
    stays on the CPU); outside nbdist (torchrun) its current CUDA device, else the CPU."""
    import os

    import torch

    pinned = os.environ.get(RANK_DEVICE_VAR)
    if pinned:
        return torch.device(pinned)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def spread_over_gpus(model: nn.Module) -> list[torch.device]:
    """The CUDA devices ``model``'s parameters and buffers lie on when more than one (a model the
    user split over the rank's GPUs, ``--gpus-per-rank``); ``[]`` otherwise."""
    from itertools import chain

    devices = {t.device for t in chain(model.parameters(), model.buffers()) if t.is_cuda}
    return sorted(devices, key=lambda device: device.index or 0) if len(devices) > 1 else []


def refuse_spread(model: nn.Module, strategy: str, why: str) -> None:
    """A clear error for a strategy that would move a model split over several GPUs to one."""
    spread = spread_over_gpus(model)
    if spread:
        raise StrategyOptionError(
            f"this model lies on {', '.join(map(str, spread))}, but strategy={strategy!r} {why}. "
            "Use strategy='ddp', which keeps a model split over the rank's GPUs where it is, "
            "or put the whole model on one GPU per rank"
        )


def find_blocks(model: nn.Module, spec: BlockSpec) -> list[nn.Module]:
    """The submodules selected by ``spec`` (outermost first, never ``model`` itself)."""
    from torch import nn

    if spec is None or spec is False:
        return []
    if spec is True or spec == "auto":
        # Transformer-like models keep their repeated blocks in a ModuleList (GPT-2 `h`,
        # Llama `layers`, ViT `blocks`): those are the units worth sharding and recomputing.
        return [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    classes = isinstance(spec, tuple) and all(isinstance(t, type) for t in spec)
    if isinstance(spec, type) or classes:
        return [m for m in model.modules() if m is not model and isinstance(m, spec)]
    if callable(spec):
        return [m for m in model.modules() if m is not model and spec(m)]
    raise StrategyOptionError(
        f"cannot select blocks from {spec!r}: pass 'auto', a module class (e.g. GPT2Block), "
        "a tuple of classes, a predicate module -> bool, or None"
    )


def apply_activation_checkpointing(model: nn.Module, spec: BlockSpec) -> int:
    """Recompute each selected block's activations in backward; returns how many blocks.

    Uses the composable ``checkpoint`` (forward hooks, non-reentrant): no model code changes and
    no renamed parameters, so state dicts and checkpoints stay interchangeable.
    """
    from torch.distributed._composable import checkpoint

    blocks = find_blocks(model, spec)
    if spec not in (None, False) and not blocks:
        raise StrategyOptionError(
            "activation_checkpointing found no blocks to recompute: the model has no"
            " nn.ModuleList; pass activation_checkpointing=<your block class> (or a predicate)"
        )
    for block in blocks:
        checkpoint(block)
    return len(blocks)


def broadcast_from_rank0(model: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (ranks may initialise differently)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type != "meta":
                dist.broadcast(tensor.data, src=0)


def param_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> fully qualified name, taken before a wrapper replaces the parameters."""
    return {id(p): name for name, p in model.named_parameters()}


def rebind_optimizer(
    optimizer: OptimizerArg, names_before: dict[int, str], model: nn.Module
) -> torch.optim.Optimizer | None:
    """An optimizer over ``model``'s (possibly replaced) parameters with the same hyperparameters.

    A factory is simply called. An instance built on the original parameters is rebuilt group by
    group through the parameter names, because sharding wrappers swap in new parameter objects.
    """
    import torch

    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        if callable(optimizer):
            return optimizer(model.parameters())
        raise StrategyOptionError(
            "optimizer must be a torch.optim.Optimizer, a factory params -> optimizer, or None;"
            f" got {type(optimizer).__name__}"
        )
    current = dict(model.named_parameters())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(current.get(names_before.get(id(p), "")) is p for p in params):
        return optimizer  # nothing was replaced (DDP)
    if any(optimizer.state.values()):
        raise StrategyOptionError(
            "the optimizer already has state (it has stepped); sharding replaces the parameters"
            " it refers to. Create the optimizer before training, or pass a factory:"
            " optimizer=lambda params: torch.optim.AdamW(params)"
        )
    groups = []
    for group in optimizer.param_groups:
        try:
            params = [current[names_before[id(p)]] for p in group["params"]]
        except KeyError as missing:
            raise StrategyOptionError(
                f"the optimizer holds a parameter that is not in the model ({missing}); "
                "build it from model.parameters() or pass a factory"
            ) from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return type(optimizer)(groups, **optimizer.defaults)


def reject(options: dict[str, Any], hints: dict[str, str], strategy: str) -> None:
    """Raise for the first option in ``hints`` that was passed, with the hint as the fix."""
    for name, hint in hints.items():
        if name in options:
            raise StrategyOptionError(
                f"{name}={options[name]!r} does not apply to strategy={strategy!r}: {hint}"
            )


def check_known(options: dict[str, Any], known: Iterable[str], strategy: str) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise StrategyOptionError(
            f"unknown option(s) for strategy={strategy!r}: {', '.join(unknown)}; "
            f"valid options: {', '.join(sorted(known))}"
        )
