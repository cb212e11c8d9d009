"""Distributed checkpoints: each strategy saves in its own format (DCP for DDP/FSDP, DeepSpeed's own
for ZeRO) beside a marker saying which, and either consolidates into one full state dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nbdist.strategies.base import Strategy
from nbdist.strategies.prepared import Prepared
from nbdist.strategies.registry import strategy_of

MARKER = "nbdist_checkpoint.json"
"""Written by rank 0 beside the shards: which format, strategy and world size saved them."""

CONSOLIDATED = "consolidated.pt"


def save_checkpoint(path: str | Path, model: Any, optimizer: Any = None) -> Path:
    """Save model (and optimizer) state from every rank into the directory ``path``; a collective.

    ``model`` is what :func:`nbdist.prepare` returned (the Prepared result itself works too).
    DDP/FSDP write DCP shards, readable at any world size; DeepSpeed writes its own layout.
    ``path`` must be one directory every rank can reach (a shared filesystem across hosts).
    """
    import torch.distributed as dist

    model, optimizer, strategy = _unpack(model, optimizer)
    target = Path(path)
    strategy.save_state(target, model, optimizer)
    if _rank() == 0:
        meta = {"format": strategy.checkpoint_format, "strategy": strategy.name,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "has_optimizer": optimizer is not None}
        (target / MARKER).write_text(json.dumps(meta))
    _barrier()
    if not (target / MARKER).is_file():
        raise FileNotFoundError(_not_shared(target, f"rank {_rank()} does not see the "
                                            f"{MARKER} rank 0 just wrote there"))
    return target


def load_checkpoint(path: str | Path, model: Any, optimizer: Any = None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into a prepared model (and optimizer).

    DCP checkpoints reshard on load, so the world size or even the strategy (DDP <-> FSDP) may
    differ from the one that saved; DeepSpeed checkpoints load into a DeepSpeed engine.
    """
    model, optimizer, strategy = _unpack(model, optimizer)
    source = Path(path)
    strategy.load_state(source, model, optimizer, _format(source))


def consolidate_checkpoint(
    path: str | Path, output: str | Path | None = None, *, include_optimizer: bool = False
) -> Path:
    """Write a checkpoint's full (unsharded, fp32) model state dict into one ``torch.save`` file.

    Load it in any single process with ``model.load_state_dict(torch.load(file))``. Runs without a
    process group; inside a cluster, rank 0 writes and the others wait. ``include_optimizer``
    (DCP only) saves ``{"model": ..., "optimizer": ...}`` instead.
    """
    import torch

    source = Path(path)
    target = Path(output) if output is not None else source / CONSOLIDATED
    if _rank() == 0:
        fmt = _format(source)
        if fmt == "dcp":
            state = _dcp_full_state(source)
            full = state if include_optimizer else state["model"]
        else:
            if include_optimizer:
                raise ValueError(
                    "include_optimizer applies to DCP checkpoints; DeepSpeed's optimizer state"
                    " stays in its own layout (load it with load_checkpoint)"
                )
            full = _deepspeed_full_state(source)
        torch.save(full, target)
    _barrier()
    return target


def _dcp_full_state(source: Path) -> dict[str, Any]:
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        flat = Path(scratch) / "full.pt"
        dcp_to_torch_save(str(source), str(flat))
        return torch.load(flat, map_location="cpu", weights_only=False)


def _deepspeed_full_state(source: Path) -> dict[str, Any]:
    import torch

    tag = (source / "latest").read_text().strip() if (source / "latest").is_file() else None
    folder = source / tag if tag else source
    if any(folder.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(source), tag=tag)
    else:  # ZeRO stage 0 keeps the whole module in the model-states file
        # saved from GPU ranks, its tensors would otherwise come back on CUDA, here too
        states_file = next(folder.glob("mp_rank_*_model_states.pt"))
        state = torch.load(states_file, map_location="cpu", weights_only=False)["module"]
    return {name: t.clone() if hasattr(t, "clone") else t for name, t in state.items()}


def _format(source: Path) -> str:
    marker = source / MARKER
    if marker.is_file():
        return str(json.loads(marker.read_text())["format"])
    if (source / ".metadata").is_file():
        return "dcp"
    if (source / "latest").is_file():
        return "deepspeed"
    raise FileNotFoundError(_not_shared(
        source, "no checkpoint there (neither DCP .metadata nor DeepSpeed 'latest')"))


def _not_shared(path: Path, what: str) -> str:
    return (f"{path}: {what}. Every rank must see the same directory: across hosts each one's "
            "working directory is its own, so give a path on a filesystem every host mounts")


def _unpack(model: Any, optimizer: Any) -> tuple[Any, Any, Strategy]:
    """(model, optimizer, strategy) from a Prepared result or a bare wrapped model."""
    if isinstance(model, Prepared):
        assert model.handler is not None  # Prepared fills it in on construction
        return model.model, optimizer if optimizer is not None else model.optimizer, model.handler
    return model, optimizer, strategy_of(model)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
