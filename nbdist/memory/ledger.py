"""Exact storage accounting for one rank: bytes of params, grads, optimizer state, gathered
parameters and buffers.

Every tensor is charged through its storage, de-duplicated by data pointer, so views into flat
buffers (DeepSpeed partitions, DDP buckets, FSDP2 padded shards) are counted once, where first seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

CATEGORIES = ("params", "grads", "optimizer", "gathered", "buffers")


class Ledger:
    """Bytes per category; a storage is charged once, to the first category that claims it."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.offloaded = 0  # model-state bytes on the CPU while the rank computes on a GPU
        self.seen: set[tuple[str, int]] = set()

    def charge(self, category: str, tensor: Any) -> None:
        local = _local(tensor)
        if local is None or local.device.type == "meta":
            return
        storage = local.untyped_storage()
        nbytes = storage.nbytes()
        key = (local.device.type, storage.data_ptr())
        if nbytes == 0 or key[1] == 0 or key in self.seen:
            return
        self.seen.add(key)
        if local.device.type != self.device_type and self.device_type != "cpu":
            self.offloaded += nbytes
        else:
            self.bytes[category] += nbytes

    def charge_all(self, category: str, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            self.charge(category, tensor)


def account(model: Any, optimizer: Any, device_type: str) -> Ledger:
    """Charge everything ``model`` and ``optimizer`` hold on this rank."""
    import torch

    module = _unwrap(model)
    if optimizer is None and _is_deepspeed_engine(model):
        optimizer = model.optimizer
    ledger = Ledger(device_type)
    params = list(module.parameters())
    # ZeRO-3 swaps each param's data for an empty tensor and keeps the rank's shard in ds_tensor.
    # Full data on such a param is a gathered copy: kept for reuse after a forward, or a param
    # under stage3_param_persistence_threshold, which every rank holds whole between steps.
    ledger.charge_all("params", (getattr(p, "ds_tensor", None) for p in params))
    ledger.charge_all("gathered", (p for p in params if hasattr(p, "ds_tensor")))
    ledger.charge_all("params", params)
    ledger.charge_all("params", module.buffers())
    ledger.charge_all("grads", (p.grad for p in params))

    found = {c: [] for c in CATEGORIES}
    for opt in _optimizer_chain(optimizer):
        from_deepspeed = type(opt).__module__.startswith("deepspeed.runtime")
        if from_deepspeed or not isinstance(opt, torch.optim.Optimizer):
            _walk_deepspeed(opt, "", 0, set(), found)
    for category in ("params", "grads"):
        ledger.charge_all(category, found[category])
    ledger.charge_all("grads", (t.grad for t in found["optimizer"]))
    for opt in _optimizer_chain(optimizer):
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            ledger.charge_all("optimizer", _tensors(state.values()))
    ledger.charge_all("optimizer", found["optimizer"])
    ledger.charge_all("buffers", found["buffers"])
    return ledger


def _unwrap(model: Any) -> Any:
    # DDP and DeepSpeedEngine hold the user's module in `.module`; FSDP2 shards it in place.
    inner = getattr(model, "module", None)
    return inner if inner is not None and hasattr(inner, "parameters") else model


def _is_deepspeed_engine(model: Any) -> bool:
    return type(model).__module__.startswith("deepspeed") and hasattr(model, "optimizer")


def _local(tensor: Any) -> Any:
    if tensor is None:
        return None
    local = getattr(tensor, "_local_tensor", None)  # DTensor: this rank's shard
    return local if local is not None else tensor


def _optimizer_chain(optimizer: Any) -> Iterator[Any]:
    """The optimizer and whatever it wraps (DeepSpeed's ZeRO optimizer wraps the torch one)."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None)


def _tensors(values: Iterable[Any]) -> Iterator[Any]:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            yield from _tensors(value.values())
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _category(name: str) -> str:
    """DeepSpeed keeps model states in flat attributes; their names say what they are."""
    name = name.lower()
    if "ipg" in name or "bucket" in name:
        return "buffers"  # reduce buckets are communication scratch, not model state
    if "grad" in name:
        return "grads"
    if "fp32" in name or "master" in name:
        return "optimizer"  # fp32 master partitions belong to the optimizer (K in the ZeRO paper)
    if "bit16" in name or "fp16" in name or "lp_param" in name or "param" in name:
        return "params"
    return "buffers"


def _walk_deepspeed(
    obj: Any, name: str, depth: int, seen: set[int], found: dict[str, list]
) -> None:
    import torch

    if depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[_category(name)].append(obj)
        return
    if isinstance(obj, dict):
        items = [(f"{name}.{k}" if isinstance(k, str) else name, v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(name, v) for v in obj]
    elif depth == 0 or type(obj).__module__.startswith("deepspeed"):
        attrs = vars(obj).items() if hasattr(obj, "__dict__") else ()
        items = [(f"{name}.{k}" if name else k, v) for k, v in attrs if k not in _CHARGED_ELSEWHERE]
    else:
        return
    for child_name, value in items:
        _walk_deepspeed(value, child_name, depth + 1, seen, found)


# the torch optimizer (its state) and the model are charged explicitly, not by name
_CHARGED_ELSEWHERE = frozenset(("optimizer", "module", "param_groups", "state"))
