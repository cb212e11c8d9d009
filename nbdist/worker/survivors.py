"""What a re-formed process group leaves in the rank's namespace: every object made on the old
group holds an aborted one. A DDP model `nbdist.prepare` made is wrapped again on the new group
(same module, same options); the others are named, for the user to make again."""

from __future__ import annotations

import contextlib
from typing import Any

from nbdist.worker.rank_service import command

DDP_OPTIONS = "_nbdist_ddp_options"  # set by nbdist.prepare on the DDP it makes: its arguments


def _shell_namespace() -> dict[str, Any]:
    from IPython import get_ipython

    shell = get_ipython()
    return {} if shell is None else shell.user_ns


def _what_holds_a_group(value: Any, current: set[Any]) -> str:
    """How to call an object that holds a process group of an earlier generation, or ""."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(value, DistributedDataParallel):
        return "" if value.process_group in current else "DDP model"
    if isinstance(value, dist.ProcessGroup):
        return "" if value in current else "process group (dist.new_group)"
    with contextlib.suppress(ImportError):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        if isinstance(value, FSDPModule | FullyShardedDataParallel):
            return "FSDP model (sharded over the old group)"
        if isinstance(value, DeviceMesh):
            return "DeviceMesh"
    if type(value).__name__ == "DeepSpeedEngine":
        return "DeepSpeed engine"
    model = getattr(value, "model", None)  # nbdist.prepare's Prepared
    if type(value).__name__ == "Prepared" and model is not None:
        held = _what_holds_a_group(model, current)
        return f"nbdist.prepare result, {held}" if held else ""
    return ""


def _model(value: Any) -> Any:
    """The model of an nbdist.prepare result, else the value itself."""
    return value.model if type(value).__name__ == "Prepared" else value


@command("survivors.scan", main_thread=True)
def scan() -> dict[str, list[str]]:
    """After a re-form: ``rewrap``, the names of DDP models nbdist.prepare made that still hold
    the old group; ``stale``, "name (what it is)" for every other object that does."""
    from torch.distributed import distributed_c10d

    current = set(distributed_c10d._world.pg_map)
    rewrap, stale = [], []
    for name, value in sorted(_shell_namespace().items()):
        if name.startswith("_"):
            continue
        with contextlib.suppress(Exception):  # an object whose attributes raise holds nothing
            held = _what_holds_a_group(value, current)
            if held.endswith("DDP model") and getattr(_model(value), DDP_OPTIONS, None):
                rewrap.append(name)
            elif held:
                stale.append(f"{name} ({held})")
    return {"rewrap": rewrap, "stale": stale}


@command("survivors.rewrap", main_thread=True)
def rewrap(names: list[str]) -> list[str]:
    """Wrap each named DDP model's module again on the current group, with the options
    nbdist.prepare gave it; every name (and nbdist.prepare result) bound to the old wrapper is
    rebound. DDP broadcasts rank 0's parameters as it is made: every rank calls this at once."""
    from torch.nn.parallel import DistributedDataParallel

    namespace = _shell_namespace()
    done: dict[int, Any] = {}
    for name in names:
        old = _model(namespace[name])
        if id(old) not in done:
            options = getattr(old, DDP_OPTIONS)
            new = DistributedDataParallel(old.module, **options)
            setattr(new, DDP_OPTIONS, options)
            done[id(old)] = new
    for name, value in list(namespace.items()):
        if id(value) in done:
            namespace[name] = done[id(value)]
        elif type(value).__name__ == "Prepared" and id(getattr(value, "model", None)) in done:
            value.model = done[id(value.model)]
    return sorted(names)
