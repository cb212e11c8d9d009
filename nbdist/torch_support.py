"""Which torch releases nbdist supports, and the features that need a newer one than the oldest:
one table, so a feature says so in one line at use instead of failing deep inside torch."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbdist.errors import NbdistError

TORCH_FLOOR = (2, 6)
"""The oldest torch the default suite passes on (.ci/floor-suite); pyproject.toml says the same."""


class TorchTooOldError(NbdistError):
    """A rank's torch is older than nbdist, or one of its features, needs."""


@dataclass(frozen=True)
class Feature:
    """A feature that needs a newer torch than the floor, and how torch fails without it."""

    title: str
    minimum: tuple[int, int]
    symptom: str
    """A regular expression matched against ``"ExceptionName: message"`` of the failure."""

    @property
    def requirement(self) -> str:
        """``"FSDP2 (fully_shard) on CPU needs torch >= 2.7"``."""
        return f"{self.title} needs torch >= {_dotted(self.minimum)}"


FEATURES: dict[str, Feature] = {
    "fsdp2-cpu": Feature(
        "FSDP2 (fully_shard) on CPU", (2, 7),
        r"AttributeError: 'Stream' object has no attribute 'record_event'",
    ),
    "tcpstore-libuv-listen-fd": Feature(
        "a libuv TCPStore on a socket nbdist bound", (2, 8),
        r"NotImplementedError: The libuv TCPStore backend does not support initialization",
    ),
    # gloo has _dump_fr_trace from 2.8, but read from the telemetry thread on torch 2.11 it can
    # end the rank by SIGSEGV (docs/GPU_CHECKS.md): 2.13 is the first version known to hold
    "flight-recorder": Feature(
        "the flight recorder on gloo (_dump_fr_trace)", (2, 13),
        r"AttributeError: .*has no attribute '_dump_fr_trace'",
    ),
    # before it torch reads only TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE;
    # nothing fails without it (the older names are set), so no symptom ever matches
    "flight-recorder-fr-names": Feature(
        "the flight recorder's TORCH_FR_* variables", (2, 9), r"(?!)",
    ),
}


def version_tuple(version: str) -> tuple[int, int]:
    """``"2.6.0+cu124"`` -> ``(2, 6)``."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if not match:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _this_torch(torch_version: str | None) -> str:
    if torch_version is not None:
        return torch_version
    import torch

    return str(torch.__version__)


def has(feature: str, torch_version: str | None = None) -> bool:
    """Whether ``torch_version`` (default: this process's) has `feature`."""
    return version_tuple(_this_torch(torch_version)) >= FEATURES[feature].minimum


def require(feature: str, torch_version: str | None = None) -> None:
    """Raise `TorchTooOldError` when ``torch_version`` (default: this process's) lacks `feature`."""
    torch_version = _this_torch(torch_version)
    if not has(feature, torch_version):
        raise TorchTooOldError(f"{FEATURES[feature].requirement}; this rank has {torch_version}.")


def hint(ename: str, evalue: str, torch_version: str) -> str | None:
    """The one-line reason when a rank's error is a known failure of a torch that is too old."""
    failure = f"{ename}: {evalue}"
    for needed in FEATURES.values():
        if version_tuple(torch_version) < needed.minimum and re.search(needed.symptom, failure):
            return f"{needed.requirement}; this rank has {torch_version}."
    return None


def floor_problem(versions: dict[int, str]) -> str | None:
    """Why engines whose torch is older than `TORCH_FLOOR` cannot run (engine id -> version)."""
    old = {key: v for key, v in sorted(versions.items()) if version_tuple(v) < TORCH_FLOOR}
    if not old:
        return None
    listed = ", ".join(f"engine {key} has {v}" for key, v in old.items())
    return (f"nbdist needs torch >= {_dotted(TORCH_FLOOR)}: {listed}. "
            "Install a newer torch in the engines' environment.")
