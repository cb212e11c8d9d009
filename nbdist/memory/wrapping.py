"""The wrapping a measured model actually got (DDP, FSDP, a DeepSpeed engine or none) beside the
one its Hugging Face ``Trainer`` was asked for, so a silent fallback to DDP is said out loud.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbdist.strategies.registry import WRAPPING_FAMILIES, wrapping_of

LABELS = {"ddp": "DDP", "fsdp": "FSDP2", "fsdp1": "FSDP", "none": "no wrapper",
          **{f"zero{stage}": f"DeepSpeed ZeRO-{stage}" for stage in range(4)}}
"""How each ``wrapping_of`` answer reads in a report."""

_ASKED_LABELS = {"fsdp": "FSDP", "deepspeed": "DeepSpeed"}


@dataclass(frozen=True)
class Wrapping:
    """What wrapped the model on one rank, and what the user asked for where nbdist can see it."""

    got: str
    """``wrapping_of``'s answer: ddp, fsdp, fsdp1, zero0-3 or none."""
    asked: str | None = None
    """The family a Trainer's TrainingArguments asked for (fsdp, deepspeed); None: not known."""
    device_type: str = "cpu"

    @property
    def label(self) -> str:
        return LABELS.get(self.got, self.got)

    def mismatch(self) -> str | None:
        """One line when the model did not get the wrapping that was asked for, else None."""
        if self.asked is None or WRAPPING_FAMILIES.get(self.got) == self.asked:
            return None
        asked = _ASKED_LABELS.get(self.asked, self.asked)
        if self.got == "none":
            return (f"TrainingArguments asked for {asked} but the model is not wrapped yet "
                    "(the Trainer wraps it in train()): nothing is sharded")
        why = f" (accelerate does not use {asked} on CPU)" if self.device_type == "cpu" else ""
        return (f"TrainingArguments asked for {asked} but the model got {self.label}{why}: "
                "every rank holds the whole model, nothing is sharded")


def is_trainer(candidate: Any) -> bool:
    """A Hugging Face ``transformers.Trainer`` (or subclass), recognised without importing it."""
    return hasattr(candidate, "model_wrapped") and hasattr(candidate, "args") and any(
        cls.__module__.startswith("transformers") and cls.__name__ == "Trainer"
        for cls in type(candidate).__mro__
    )


def unwrap_trainer(model: Any, optimizer: Any) -> tuple[Any, Any, str | None]:
    """What to measure: a Trainer's wrapped model and optimizer (unless one is given) and the
    family its arguments asked for; anything else as it is, with nothing asked."""
    if not is_trainer(model):
        return model, optimizer, None
    # fsdp is a list of options, a string or True across transformers versions: truthy when asked
    families = ("fsdp", "deepspeed")
    asked = next((family for family in families if getattr(model.args, family, None)), None)
    return model.model_wrapped, model.optimizer if optimizer is None else optimizer, asked


def wrapping(model: Any, asked: str | None, device_type: str) -> Wrapping:
    """What wraps ``model`` on this rank now, beside what was asked for."""
    return Wrapping(got=wrapping_of(model), asked=asked, device_type=device_type)
