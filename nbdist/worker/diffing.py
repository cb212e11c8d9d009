"""Rank side of `%dist_diff`: flatten an object to {name: entry} and fingerprint each entry, so
the notebook compares ranks without shipping whole models; only differing entries are fetched.

A fingerprint is small and picklable: shape, dtype, a hash of the bytes and a few summary numbers
for a tensor; the type, a hash and a short repr for any other value.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

MAX_ENTRIES = 100_000
"""Flattening stops there: a diff of more entries than that is not what anyone meant."""

_FLAT: dict[str, Any] = {}
"""The last flattened object on this rank, kept so `fetch` sends entries without re-evaluating."""


def fingerprint_expression(expr: str, full: bool = False) -> dict[str, Any]:
    """Evaluate `expr` in the rank's namespace and fingerprint it (`fingerprint`). An error in the
    expression comes back as {"error": ...}: raised here, the engine would record it as the
    rank's last traceback and `%dist_debug` would debug it instead of the failed cell."""
    from IPython import get_ipython

    shell = get_ipython()
    namespace = shell.user_ns if shell is not None else {}
    try:
        value = eval(expr, namespace)  # noqa: S307 - the user's own expression, on the user's rank
        return fingerprint(value, full=full)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def fingerprint(obj: Any, full: bool = False) -> dict[str, Any]:
    """{"type", "entries": {name: fingerprint}, "notes"}; the entries stay here for `fetch`.
    `full`: sharded DTensors are gathered (a collective: every rank must be fingerprinting)."""
    notes: set[str] = set()
    flat = flatten(obj, full=full, notes=notes)
    _FLAT.clear()
    _FLAT.update(flat)
    return {"type": describe_type(obj),
            "entries": {name: entry_fingerprint(value) for name, value in flat.items()},
            "notes": sorted(notes)}


def fetch(names: list[str]) -> dict[str, Any]:
    """The named entries of the last fingerprinted object; tensors on CPU."""
    missing = [name for name in names if name not in _FLAT]
    if missing:
        raise KeyError(f"not in the last %dist_diff on this rank: {', '.join(missing)}")
    return {name: _to_cpu(_FLAT[name]) for name in names}


def local_entry(name: str) -> Any:
    """One entry of the last fingerprinted object, where it lives (for a collective)."""
    return _FLAT[name]


def describe_type(obj: Any) -> str:
    return type(obj).__qualname__


def flatten(obj: Any, full: bool = False, notes: set[str] | None = None,
            prefix: str = "") -> dict[str, Any]:
    """{dotted name: leaf}: a module's parameters and buffers by name, an optimizer's state_dict,
    dicts, lists and tuples walked; tensors (DTensors resolved, see `_resolve_dtensor`) and every
    other value are leaves."""
    notes = set() if notes is None else notes
    out: dict[str, Any] = {}
    _walk(obj, prefix, out, full, notes)
    return out


def _walk(obj: Any, name: str, out: dict[str, Any], full: bool, notes: set[str]) -> None:
    import torch

    if len(out) >= MAX_ENTRIES:
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
    elif isinstance(obj, (list, tuple)):
        children = dict(enumerate(obj))
    else:
        out[name] = _resolve_dtensor(obj, full, notes) if isinstance(obj, torch.Tensor) else obj
        return
    for key, child in children.items():
        _walk(child, f"{name}.{key}" if name else str(key), out, full, notes)


def _resolve_dtensor(tensor: Any, full: bool, notes: set[str]) -> Any:
    """Replicate placements: the local tensor (what must be equal). Shard / Partial: the local
    shard's shape only (ranks hold different data by design), or the full tensor when `full`."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # pragma: no cover - torch without distributed
        return tensor.detach()
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


class ShardedEntry:
    """What a rank says about its shard of a sharded DTensor: no data, only layout."""

    def __init__(self, local_shape: tuple[int, ...], dtype: str, placements: tuple[str, ...],
                 global_shape: tuple[int, ...]) -> None:
        self.local_shape = local_shape
        self.dtype = dtype
        self.placements = placements
        self.global_shape = global_shape

    def __repr__(self) -> str:
        return (f"shard {list(self.local_shape)} of {list(self.global_shape)} {self.dtype} "
                f"({', '.join(self.placements)})")


def entry_fingerprint(value: Any) -> dict[str, Any]:
    import torch

    if isinstance(value, ShardedEntry):
        return {"kind": "sharded", "shape": list(value.local_shape), "dtype": value.dtype,
                "digest": _digest(repr(value).encode()), "repr": repr(value)}
    if isinstance(value, torch.Tensor):
        return _tensor_fingerprint(value)
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception:
        data = repr(value).encode()
    text = repr(value)
    return {"kind": "value", "type": describe_type(value), "digest": _digest(data),
            "repr": text if len(text) <= 80 else text[:77] + "..."}


def _tensor_fingerprint(tensor: Any) -> dict[str, Any]:
    import torch

    base = {"kind": "tensor", "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}
    if tensor.is_meta or tensor.layout != torch.strided:
        return {**base, "digest": _digest(repr(base).encode()), "stats": {}}
    cpu = tensor.detach().to("cpu").contiguous()
    try:
        raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):  # quantized and other exotic dtypes
        raw = repr(cpu.tolist()).encode()
    return {**base, "digest": _digest(raw), "stats": _stats(cpu)}


def _stats(cpu: Any) -> dict[str, float]:
    import torch

    if cpu.numel() == 0 or cpu.dtype == torch.bool:
        return {}
    values = cpu.to(torch.complex128 if cpu.is_complex() else torch.float64)
    if values.is_complex():
        values = values.abs()
    return {"sum": float(values.sum()), "min": float(values.min()), "max": float(values.max()),
            "norm": float(values.norm())}


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    return value
