"""A pasted script's own process-group calls, made to work inside a cell.

`dist.init_process_group` when the cluster's group exists is a no-op with a one-line note (a clear
error when its settings differ); `dist.destroy_process_group` is honoured and the notebook side
re-forms the group after the cell; `rpc.init_rpc` a second time says what to do in one line.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

NOTE_PREFIX = "nbdist:"


@dataclass
class ScriptCallState:
    """What the rank's own calls did to the world group in the running cell."""

    destroyed: bool = False
    noted_init: bool = False
    noted_rpc: bool = False
    rpc_started_before: bool = False
    """RPC was started in this process before (never reset: torch's RRef context outlives it)."""


STATE = ScriptCallState()


class IncompatibleInitError(RuntimeError):
    """init_process_group asked for a group the cluster's existing one is not."""


def install() -> None:
    """Wrap torch.distributed's init/destroy and rpc.init_rpc (module attributes, so code that
    runs `dist.init_process_group(...)` or imports the name afterwards gets the wrapper; nbdist's
    own calls go through `distributed_c10d`, which stays untouched)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist.init_process_group, "__nbdist_original__"):
        dist.init_process_group = wrap(distributed_c10d.init_process_group, _init_process_group)
        dist.destroy_process_group = wrap(distributed_c10d.destroy_process_group,
                                           _destroy_process_group)
    try:
        from torch.distributed import rpc
    except ImportError:  # a torch built without RPC: nothing to wrap
        return
    if rpc.is_available() and not hasattr(rpc.init_rpc, "__nbdist_original__"):
        rpc.init_rpc = wrap(rpc.init_rpc, _init_rpc)


def wrap(original: Any, replacement: Any) -> Any:
    """`replacement(original, *args, **kwargs)` in `original`'s clothes, marked as nbdist's (so an
    install never wraps twice; `__wrapped__` is the original, for whoever needs it)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # IPython leaves this frame out of the user's traceback
        return replacement(original, *args, **kwargs)

    wrapper.__nbdist_original__ = original  # type: ignore[attr-defined]
    return wrapper


def cell_started() -> None:
    STATE.destroyed = False
    STATE.noted_init = False
    STATE.noted_rpc = False


def group_state() -> dict[str, Any] | None:
    """For the cell's telemetry: None while the world group is as nbdist formed it."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if initialized and not STATE.destroyed:
        return None
    return {"initialized": initialized, "destroyed_by_cell": STATE.destroyed}


def _init_process_group(original: Any, *args: Any, **kwargs: Any) -> None:
    import inspect

    import torch.distributed as dist

    if not dist.is_initialized():
        # destroyed earlier in this cell and initialised again: the script's own rendezvous
        return original(*args, **kwargs)
    asked = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    differences = _differences(asked)
    if differences:
        raise IncompatibleInitError(
            "init_process_group: this rank is already in the cluster's process group "
            f"({_describe_current()}), and the call asks for {'; '.join(differences)}. Drop the "
            "call (the group exists), or start the cluster to match (%dist_start --backend ...)"
        )
    if not STATE.noted_init and dist.get_rank() == 0:
        print(f"{NOTE_PREFIX} init_process_group() skipped: the cluster's process group is "
              f"already up ({_describe_current()})")
    STATE.noted_init = True
    return None


def _differences(asked: dict[str, Any]) -> list[str]:
    """What an init_process_group call asks for that the existing group is not (its rendezvous
    arguments, init_method/store/timeout, do not matter once the group exists)."""
    import torch.distributed as dist

    found = []
    current = str(dist.get_backend())
    backend = asked.get("backend")
    if backend is not None and not _backend_matches(str(backend), current):
        found.append(f"backend {backend!r} (the group is {current!r})")
    world_size = asked.get("world_size", -1)
    if world_size not in (-1, None) and int(world_size) != dist.get_world_size():
        found.append(f"world_size={world_size} (the cluster has {dist.get_world_size()} ranks)")
    rank = asked.get("rank", -1)
    if rank not in (-1, None) and int(rank) != dist.get_rank():
        found.append(f"rank={rank} (this is rank {dist.get_rank()})")
    return found


def _backend_matches(asked: str, current: str) -> bool:
    """'gloo' matches gloo; 'cpu:gloo,cuda:nccl' matches either of its backends."""
    asked_names = {part.split(":")[-1].strip().lower() for part in asked.split(",")}
    current_names = {part.split(":")[-1].strip().lower() for part in current.split(",")}
    return bool(asked_names & current_names)


def _describe_current() -> str:
    import torch.distributed as dist

    return f"{dist.get_backend()}, world size {dist.get_world_size()}, rank {dist.get_rank()}"


def _destroy_process_group(original: Any, group: Any = None) -> None:
    import torch.distributed as dist

    if group is not None and group is not dist.GroupMember.WORLD:
        return original(group)
    if dist.is_initialized():
        original()
        STATE.destroyed = True
    return None


def _init_rpc(original: Any, name: str, *args: Any, **kwargs: Any) -> None:
    """A second init_rpc while this rank's RPC agent runs under the same name is a no-op with a
    note (a cell run twice); under another name it cannot work in one process: say so."""
    from torch.distributed.rpc import api

    if not api._is_current_rpc_agent_set():
        if STATE.rpc_started_before and os.environ.get("RANK") == "0":
            print(f"{NOTE_PREFIX} RPC starts again in this process: calls and distributed "
                  "autograd work, but torch keeps its RRef context bound to the first agent, so "
                  "passing RRefs or RemoteModules between workers can fail; %dist_restart gives "
                  "fresh processes")
        STATE.rpc_started_before = True
        return original(name, *args, **kwargs)
    current = api._get_current_rpc_agent().get_worker_info().name
    if current != name:
        raise RuntimeError(
            f"rpc.init_rpc({name!r}): RPC already runs on this rank as {current!r}, and torch "
            "cannot run two RPC agents in one process. Call rpc.shutdown() on every rank first "
            "(then init_rpc works again), or %dist_restart for fresh processes"
        )
    if not STATE.noted_rpc:
        print(f"{NOTE_PREFIX} rpc.init_rpc({name!r}) skipped: RPC already runs on this rank "
              "under that name (call rpc.shutdown() first to start it anew)")
    STATE.noted_rpc = True
    return None
