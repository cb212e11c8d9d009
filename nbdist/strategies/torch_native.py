"""What DDP and FSDP share: a plain torch training step and torch.distributed.checkpoint (DCP)
state dicts, which reshard on load so DDP and FSDP checkpoints are interchangeable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbdist.strategies.base import Sharding, adam_bytes


@dataclass(frozen=True)
class TorchNativeStrategy:
    """Base of the strategies whose wrapper is a torch module and whose optimizer is a torch one."""

    name: str
    sharding: Sharding
    family: str = ""
    checkpoint_format: str = "dcp"
    engine_accumulates: bool = False

    def backward(self, model: Any, loss: Any) -> None:
        loss.backward()

    def step(self, model: Any, optimizer: Any) -> None:
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def bytes_per_param(self, precision: str) -> tuple[float, float, float]:
        return adam_bytes(precision, fp32_master=False)

    def save_state(self, path: Path, model: Any, optimizer: Any) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dcp_state(model, optimizer), checkpoint_id=str(path))

    def load_state(self, path: Path, model: Any, optimizer: Any, saved_format: str) -> None:
        if saved_format != "dcp":
            raise ValueError(
                f"{path} holds a DeepSpeed checkpoint: load it with strategy='deepspeed', or "
                "consolidate_checkpoint() it and load the full state dict"
            )
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = dcp_state(model, optimizer)
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer if optimizer is not None else [],
                       model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))

    def release(self, model: Any) -> None:
        """Nothing beyond the module itself: garbage collection frees it."""


def dcp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The model (and optimizer) state dict DCP saves and loads in place."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # get_state_dict strips wrapper prefixes (DDP's "module.") so DDP and FSDP checkpoints match.
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    return state
