"""Rank side of `%dist_diff`: an object flattened to {name: entry}, each entry fingerprinted (shape,
dtype, hash, summary numbers; else type, hash, short repr): only entries that differ are fetched."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any

from nbdist.worker.rank_service import command

MAX_ENTRIES = 100_000  # flattening stops there: a diff of more is not what anyone meant
_FLAT: dict[str, Any] = {}  # the last flattened object: `fetch` sends entries without re-evaluating


@command("diff.fingerprint", main_thread=True)
def fingerprint_expression(expr: str, full: bool = False) -> dict[str, Any]:
    """`expr` evaluated in the rank's namespace, fingerprinted. An error comes back as {"error"}:
    raised here, `%dist_debug` would debug it instead of the failed cell."""
    from IPython import get_ipython

    try:
        value = eval(expr, get_ipython().user_ns)  # noqa: S307 - the user's own expression
        return fingerprint(value, full=full)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def fingerprint(obj: Any, full: bool = False) -> dict[str, Any]:
    """{"type", "entries": {name: fingerprint}, "notes"}; the entries stay here for `fetch`.
    `full`: sharded DTensors are gathered (a collective: every rank must be fingerprinting)."""
    notes: set[str] = set()
    flat: dict[str, Any] = {}
    _walk(obj, "", full, notes, flat)
    _FLAT.clear()  # kept whole or not at all: a walk that raised leaves the last one
    _FLAT.update(flat)
    return {"type": describe_type(obj),
            "entries": {name: entry_fingerprint(value) for name, value in flat.items()},
            "notes": sorted(notes)}


@command("diff.fetch", main_thread=True)
def fetch(names: list[str]) -> dict[str, Any]:
    """Those of the named entries of the last fingerprinted object this rank has (detached
    tensors: the frames bring them to the CPU). One call asks for every name a diff needs."""
    return {name: _FLAT[name] for name in names if name in _FLAT}


def local_entry(name: str) -> Any:
    return _FLAT[name]


def describe_type(obj: Any) -> str:
    return type(obj).__qualname__


def _walk(obj: Any, name: str, full: bool, notes: set[str], flat: dict[str, Any]) -> None:
    """Modules (parameters and buffers by name), optimizers (state_dict), dicts, lists and tuples
    are walked; tensors (DTensors resolved) and other values are leaves."""
    import torch

    if len(flat) >= MAX_ENTRIES:
        notes.add(f"stopped after {MAX_ENTRIES} entries")
        return
    if isinstance(obj, torch.nn.Module):
        children = {**dict(obj.named_parameters()), **dict(obj.named_buffers())}
        notes.add("module: parameters and buffers by name")
    elif isinstance(obj, torch.optim.Optimizer):
        children = obj.state_dict()
        notes.add("optimizer: its state_dict")
    elif isinstance(obj, dict):
        children = obj
    elif isinstance(obj, list | tuple):
        children = dict(enumerate(obj))
    else:
        flat[name] = _resolve_dtensor(obj, full, notes) if isinstance(obj, torch.Tensor) else obj
        return
    for key, child in children.items():
        _walk(child, f"{name}.{key}" if name else str(key), full, notes, flat)


def _resolve_dtensor(tensor: Any, full: bool, notes: set[str]) -> Any:
    """Replicate placements: the local tensor (what must be equal). Shard / Partial: the local
    shard's layout only (ranks hold different data by design), or the full tensor when `full`."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return tensor.detach()
    if all(isinstance(p, Replicate) for p in tensor.placements):
        notes.add("replicated DTensor: local tensors compared")
        return tensor.to_local().detach()
    if full:
        notes.add("sharded DTensor: full tensors gathered and compared")
        return tensor.full_tensor().detach()
    notes.add("sharded DTensor: only the local shards' shapes compared (full=True / --full "
              "compares the full tensors)")
    return ShardedEntry(tuple(tensor.to_local().shape), str(tensor.dtype),
                        tuple(str(p) for p in tensor.placements), tuple(tensor.shape))


@dataclass(frozen=True)
class ShardedEntry:
    local_shape: tuple[int, ...]
    dtype: str
    placements: tuple[str, ...]
    global_shape: tuple[int, ...]

    def __repr__(self) -> str:
        return (f"shard {list(self.local_shape)} of {list(self.global_shape)} {self.dtype} "
                f"({', '.join(self.placements)})")


def entry_fingerprint(value: Any) -> dict[str, Any]:
    import torch

    if isinstance(value, ShardedEntry):
        return {"kind": "sharded", "shape": list(value.local_shape), "dtype": value.dtype,
                "digest": _digest(repr(value).encode()), "repr": repr(value)}
    if not isinstance(value, torch.Tensor):
        text = repr(value)
        try:
            data = pickle.dumps(value, protocol=4)
        except Exception:
            data = text.encode()
        return {"kind": "value", "type": describe_type(value), "digest": _digest(data),
                "repr": text if len(text) <= 80 else text[:77] + "..."}
    base = {"kind": "tensor", "shape": list(value.shape),
            "dtype": str(value.dtype).replace("torch.", "")}
    if value.is_meta or value.layout != torch.strided:
        return {**base, "digest": _digest(repr(base).encode()), "stats": {}}
    cpu = value.detach().to("cpu").contiguous()
    try:
        raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):  # quantized and other exotic dtypes
        raw = repr(cpu.tolist()).encode()
    stats = {}
    if cpu.numel() and cpu.dtype != torch.bool:
        values = cpu.to(torch.complex128).abs() if cpu.is_complex() else cpu.double()
        stats = {"sum": float(values.sum()), "min": float(values.min()),
                 "max": float(values.max()), "norm": float(values.norm())}
    return {**base, "digest": _digest(raw), "stats": stats}


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()
