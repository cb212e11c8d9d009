"""Distributed checkpoints: torch.distributed.checkpoint (DCP) for DDP/FSDP, DeepSpeed's own for
DeepSpeed, and consolidation of either into one full state dict a single process can load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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

    model, optimizer = _unpack(model, optimizer)
    target = Path(path)
    if _is_deepspeed(model):
        model.save_checkpoint(str(target))
        fmt = "deepspeed"
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(target))
        fmt = "dcp"
    if _rank() == 0:
        meta = {"format": fmt, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "has_optimizer": optimizer is not None}
        (target / MARKER).write_text(json.dumps(meta))
    _barrier()
    return target


def load_checkpoint(path: str | Path, model: Any, optimizer: Any = None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into a prepared model (and optimizer).

    DCP checkpoints reshard on load, so the world size or even the strategy (DDP <-> FSDP) may
    differ from the one that saved; DeepSpeed checkpoints load into a DeepSpeed engine.
    """
    model, optimizer = _unpack(model, optimizer)
    source = Path(path)
    fmt = _format(source)
    if _is_deepspeed(model):
        if fmt != "deepspeed":
            raise ValueError(f"{source} holds a {fmt} checkpoint; load it into a DDP/FSDP model, or "
                             "consolidate it and load the full state dict into the DeepSpeed engine's module")
        loaded, _ = model.load_checkpoint(str(source), load_optimizer_states=optimizer is not None)
        if loaded is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {source}")
        return
    if fmt != "dcp":
        raise ValueError(f"{source} holds a DeepSpeed checkpoint: load it with strategy='deepspeed', or "
                         "consolidate_checkpoint() it and load the full state dict")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(source))
    set_state_dict(model, optimizer if optimizer is not None else [],
                   model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))


def consolidate_checkpoint(path: str | Path, output: str | Path | None = None, *,
                           include_optimizer: bool = False) -> Path:
    """Write the full (unsharded, fp32) model state dict of a checkpoint into one ``torch.save`` file.

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
                raise ValueError("include_optimizer applies to DCP checkpoints; DeepSpeed's optimizer "
                                 "state stays in its own layout (load it with load_checkpoint)")
            full = _deepspeed_full_state(source)
        torch.save(full, target)
    _barrier()
    return target


def _dcp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # get_state_dict strips wrapper prefixes (DDP's "module.") so DDP and FSDP checkpoints match.
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    return state


def _dcp_full_state(source: Path) -> dict[str, Any]:
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        flat = Path(scratch) / "full.pt"
        dcp_to_torch_save(str(source), str(flat))
        return torch.load(flat, weights_only=False)


def _deepspeed_full_state(source: Path) -> dict[str, Any]:
    import torch

    tag = (source / "latest").read_text().strip() if (source / "latest").is_file() else None
    folder = source / tag if tag else source
    if any(folder.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(source), tag=tag)
    else:  # ZeRO stage 0 keeps the whole module in the model-states file
        state = torch.load(next(folder.glob("mp_rank_*_model_states.pt")), weights_only=False)["module"]
    return {name: tensor.clone() if hasattr(tensor, "clone") else tensor for name, tensor in state.items()}


def _format(source: Path) -> str:
    marker = source / MARKER
    if marker.is_file():
        return str(json.loads(marker.read_text())["format"])
    if (source / ".metadata").is_file():
        return "dcp"
    if (source / "latest").is_file():
        return "deepspeed"
    raise FileNotFoundError(f"no checkpoint in {source} (neither DCP .metadata nor DeepSpeed 'latest')")


def _unpack(model: Any, optimizer: Any) -> tuple[Any, Any]:
    from nbdist.strategies import Prepared

    if isinstance(model, Prepared):
        return model.model, optimizer if optimizer is not None else model.optimizer
    return model, optimizer


def _is_deepspeed(model: Any) -> bool:
    return type(model).__module__.startswith("deepspeed") and hasattr(model, "save_checkpoint")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
