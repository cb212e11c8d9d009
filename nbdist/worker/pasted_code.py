"""Code pasted from a script or a tutorial, unchanged, made to work on a rank that already is one
of the processes it would start: its process-group and RPC calls, its launchers (run in place, or
an error that says what to write instead), and `%dist_run script.py`."""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import multiprocessing.process
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")
PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"  # read by accelerate's Accelerator

SHELL_LAUNCHERS = {
    "torchrun": "torchrun", "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torch.distributed.launch", "deepspeed": "deepspeed",
    "deepspeed.launcher.runner": "deepspeed", "accelerate": "accelerate launch",
    "accelerate.commands.launch": "accelerate launch", "mpirun": "mpirun", "mpiexec": "mpiexec",
}
"""Programs (or `python -m` modules) that start one process per rank themselves."""


@dataclass
class PastedState:
    rank: int = 0
    world_size: int = 1
    noted: set[str] = field(default_factory=set)  # rank 0's notes in the running cell
    process_indices: set[int] = field(default_factory=set)  # the cell's Process(args=(i, ...))
    destroyed: bool = False  # the cell destroyed the world group: the notebook re-forms it
    rpc_started_before: bool = False  # torch's RRef context outlives the first agent

    def cell_started(self) -> None:
        self.noted.clear()
        self.process_indices.clear()
        self.destroyed = False


STATE = PastedState()


class LauncherInCellError(RuntimeError):
    """A pasted launcher asked for processes the cluster's ranks cannot stand in for."""


class IncompatibleInitError(RuntimeError):
    """init_process_group asked for a group the cluster's existing one is not."""


class ScriptExit(Exception):
    """A `%dist_run` script ended with `sys.exit(code)`, a code other than 0 / None."""


def _wrap(owner: Any, name: str, replacement: Any) -> None:
    """`owner.name` becomes `replacement(original, *args, **kwargs)`, once; `__wrapped__` is it."""
    original = getattr(owner, name)
    if hasattr(original, "__nbdist_original__"):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # IPython leaves this frame out of the user's traceback
        return replacement(original, *args, **kwargs)

    wrapper.__nbdist_original__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def install(rank: int, world_size: int, shell: Any) -> None:
    """Wrap what pasted code calls (nbdist's own group calls go through `distributed_c10d`);
    accelerate's notebook_launcher when (if ever) accelerate is imported."""
    import torch.distributed as dist
    import torch.multiprocessing as torch_mp
    from torch.distributed import rpc

    STATE.rank, STATE.world_size = rank, world_size
    _wrap(dist, "init_process_group", _init_process_group)
    _wrap(dist, "destroy_process_group", _destroy_process_group)
    if rpc.is_available():
        _wrap(rpc, "init_rpc", _init_rpc)
    for module in (torch_mp, sys.modules["torch.multiprocessing.spawn"]):
        _wrap(module, "spawn", _spawn)
        _wrap(module, "start_processes", _spawn)
    _wrap(multiprocessing.process.BaseProcess, "start", _process_start)
    for name in ("system", "getoutput"):  # `!cmd` and `x = !cmd`
        _wrap(shell, name, _shell_command)
    if "accelerate.launchers" in sys.modules:
        _wrap(sys.modules["accelerate.launchers"], "notebook_launcher", _notebook_launcher)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _note(key: str, text: str) -> None:
    if STATE.rank == 0 and key not in STATE.noted:
        print(f"nbdist: {text}", flush=True)
    STATE.noted.add(key)


def group_state() -> dict[str, Any] | None:
    """For the cell's telemetry: None while the world group is as nbdist formed it."""
    import torch.distributed as dist

    initialized = dist.is_initialized()
    if initialized and not STATE.destroyed:
        return None
    return {"initialized": initialized, "destroyed_by_cell": STATE.destroyed}


def _init_process_group(original: Any, *args: Any, **kwargs: Any) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        # destroyed earlier in this cell and initialised again: the script's own rendezvous
        return original(*args, **kwargs)
    asked = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    backend, world_size, rank = str(dist.get_backend()), dist.get_world_size(), dist.get_rank()
    current = f"{backend}, world size {world_size}, rank {rank}"
    # what the call asks for that the group is not (its rendezvous arguments no longer matter)
    differences = []  # 'gloo' matches a 'cpu:gloo,cuda:nccl' group
    names = [{part.split(":")[-1].strip().lower() for part in str(b).split(",")}
             for b in (asked.get("backend"), backend)]
    if asked.get("backend") is not None and not names[0] & names[1]:
        differences.append(f"backend {asked['backend']!r} (the group is {backend!r})")
    if asked.get("world_size", -1) not in (-1, None) and int(asked["world_size"]) != world_size:
        differences.append(f"world_size={asked['world_size']} (the cluster has {world_size} ranks)")
    if asked.get("rank", -1) not in (-1, None) and int(asked["rank"]) != rank:
        differences.append(f"rank={asked['rank']} (this is rank {rank})")
    if differences:
        raise IncompatibleInitError(
            f"init_process_group: this rank is already in the cluster's process group "
            f"({current}), and the call asks for {'; '.join(differences)}. Drop the call (the "
            "group exists), or start the cluster to match (%dist_start --backend ...)")
    _note("init", f"init_process_group() skipped: the cluster's process group is already up "
                  f"({current})")


def _destroy_process_group(original: Any, group: Any = None) -> None:
    import torch.distributed as dist

    if group is not None and group is not dist.GroupMember.WORLD:
        return original(group)
    STATE.destroyed = STATE.destroyed or dist.is_initialized()
    return original() if dist.is_initialized() else None


def _init_rpc(original: Any, name: str, *args: Any, **kwargs: Any) -> None:
    """A second init_rpc under the running agent's name is a no-op with a note (a cell run
    twice); under another name it cannot work in one process: say so."""
    from torch.distributed.rpc import api

    if not api._is_current_rpc_agent_set():
        if STATE.rpc_started_before:
            _note("rpc again", "RPC starts again in this process: calls and distributed "
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
            "(then init_rpc works again), or %dist_restart for fresh processes")
    _note("rpc", f"rpc.init_rpc({name!r}) skipped: RPC already runs on this rank under that "
                 "name (call rpc.shutdown() first to start it anew)")


def _ranks_already() -> str:
    n = STATE.world_size
    return (f"This cluster's {n} ranks already are {n} processes in one process group "
            "(torch.distributed is initialized; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
            "MASTER_PORT are set on each), and a %%distributed cell runs on all of them at once, "
            "so processes started from a cell would be more processes on every rank, outside "
            "that group.")


def _spawn(original: Any, *args: Any, **kwargs: Any) -> Any:
    """torch.multiprocessing.spawn / start_processes: `fn(rank, *args)` in place, or an error."""
    __tracebackhide__ = True
    call = inspect.signature(original).bind(*args, **kwargs)
    call.apply_defaults()
    fn, nprocs = call.arguments["fn"], call.arguments["nprocs"]
    name, launcher = _name(fn), f"mp.{original.__name__}"
    if str(getattr(fn, "__module__", "")).startswith(LIGHTNING_PACKAGES):
        raise LauncherInCellError(
            f"Lightning's process launcher (strategy 'ddp_notebook', 'ddp_fork' or 'ddp_spawn') "
            f"would start {nprocs} processes from every rank. {_ranks_already()} Use "
            f"strategy='ddp': Lightning then finds the ranks through torchrun's environment "
            f"(TorchElasticEnvironment) and uses the cluster's process group, starting nothing.")
    _check_count(launcher, name, "nprocs", nprocs, "rank, *args",
                 "nbdist defines `rank` and `world_size`")
    _note(launcher, f"{launcher}({name}, nprocs={nprocs}) runs {name}(rank, ...) in place on each "
                    f"of the {nprocs} ranks: they already are the processes it would start")
    fn(STATE.rank, *call.arguments["args"])
    return None if call.arguments["join"] else _RanInPlace()


def _notebook_launcher(original: Any, *args: Any, **kwargs: Any) -> None:
    __tracebackhide__ = True
    call = inspect.signature(original).bind(*args, **kwargs)
    call.apply_defaults()
    fn, precision = call.arguments["function"], str(call.arguments["mixed_precision"])
    name = _name(fn)
    _check_count("notebook_launcher", name, "num_processes", call.arguments["num_processes"],
                 "*args", "accelerate's Accelerator finds the group and the environment")
    _note("notebook_launcher", f"notebook_launcher({name}) runs {name}(*args) in place on each "
                               f"of the {STATE.world_size} ranks: they already are its processes")
    from unittest import mock

    # the environment the launcher gives its workers' Accelerator, gone with them afterwards
    with mock.patch.dict(os.environ, {PRECISION_ENV: precision} if precision != "no" else {}):
        fn(*call.arguments["args"])


def _check_count(launcher: str, name: str, param: str, count: Any, call_as: str, why: str) -> None:
    """A launcher asking for another number of processes than there are ranks: what to write."""
    __tracebackhide__ = True
    if count not in (None, STATE.world_size):
        raise LauncherInCellError(
            f"{launcher}({name}, {param}={count}) asks for {count} processes. {_ranks_already()} "
            f"Call the function yourself, `{name}({call_as})` ({why}), or write "
            f"`{param}=world_size` and nbdist runs it in place on each rank; for {count} ranks, "
            f"start the cluster with `%dist_start -n {count}`. `{launcher}.__wrapped__(...)` "
            "starts real processes if that is what you mean.")


def _process_start(original: Any, process: Any) -> None:
    """`Process(target=f, args=(i, ...)).start()` for a function of the cell or script, as the
    tutorials start one process per rank: rank i runs `f(i, ...)` in place, the others skip."""
    __tracebackhide__ = True
    target, args = getattr(process, "_target", None), tuple(getattr(process, "_args", ()))
    if (getattr(target, "__module__", None) != "__main__" or not args
            or type(args[0]) is not int):
        return original(process)  # not the one-process-per-rank pattern: a real process
    index, name = args[0], _name(target)
    if not 0 <= index < STATE.world_size:
        raise LauncherInCellError(
            f"multiprocessing.Process(target={name}, args=({index}, ...)) starts a process for "
            f"rank {index}. {_ranks_already()} Call `{name}(rank, ...)` once per cell instead "
            f"(nbdist defines `rank`), or start the cluster with `%dist_start -n {index + 1}`.")
    _note("Process", f"multiprocessing.Process(target={name}, args=(i, ...)) runs on rank i, in "
                     f"place: the {STATE.world_size} ranks already are the processes it would "
                     "start")
    STATE.process_indices.add(index)
    if index == STATE.rank:
        target(*args, **process._kwargs)
    process._popen, process._sentinel = _RanInPlace(), -1  # as start() sets them: close() dels
    del process._target, process._args, process._kwargs  # as start() does


def _shell_command(original: Any, command: str, *args: Any, **kwargs: Any) -> Any:
    __tracebackhide__ = True
    launcher = launcher_in(command)
    if launcher is not None:
        n, words = STATE.world_size, _words(command)
        script = next((w for w in words if w.endswith(".py")), "train.py")
        after = words[words.index(script) + 1:] if script in words else []
        raise LauncherInCellError(
            f"`!{command.strip()}` in a %%distributed cell runs {launcher} on each of the {n} "
            f"ranks: {n} launchers, each starting its own workers in a process group of their "
            f"own. {_ranks_already()} Run the script on the ranks instead: `%dist_run "
            f"{' '.join([script, *after])}` (unchanged: its argv, torchrun's environment, its "
            f"init_process_group answered by the cluster's group). To run {launcher} itself, "
            f"use `!` in an ordinary cell, without %%distributed.")
    return original(command, *args, **kwargs)


def launcher_in(command: str) -> str | None:
    """The launcher a shell command starts (`torchrun ...`, `cd x && deepspeed ...`,
    `python -m torch.distributed.run ...`, `accelerate launch ...`), else None."""
    for part in re.split(r"&&|\|\||;|\|", command):
        words = _words(part)
        while words and (os.path.basename(words[0]) in ("env", "nohup", "time", "exec")
                         or re.match(r"[A-Za-z_]\w*=", words[0])):  # `OMP_NUM_THREADS=1 torchrun`
            words = words[1:]
        if not words:
            continue
        program = os.path.basename(words[0])
        if re.fullmatch(r"python[0-9.]*", program) and len(words) > 2 and words[1] == "-m":
            program = words[2]
        if program == "accelerate" and "launch" not in words[1:2]:
            continue  # `accelerate config`, `accelerate env`: not a launcher
        if program in SHELL_LAUNCHERS:
            return SHELL_LAUNCHERS[program]
    return None


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an unbalanced quote: the shell will say so; words are enough here
        return command.split()


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


class _RanInPlace:
    """Stands in for the child process a launcher would have started: already finished, exit 0
    (`join`, `is_alive`, `exitcode` and torch's `ProcessContext.join` all ask it)."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def wait(self, timeout: float | None = None) -> int:
        expected = set(range(STATE.world_size))
        if STATE.process_indices and STATE.process_indices != expected:
            raise LauncherInCellError(
                f"multiprocessing.Process: this cell started processes for ranks "
                f"{sorted(STATE.process_indices)} only, so rank(s) "
                f"{sorted(expected - STATE.process_indices)} had nothing to run and the others "
                f"wait for them. {_ranks_already()} Start one per rank "
                f"(`for i in range(world_size)`), or call the target with `rank` yourself.")
        return 0

    def poll(self) -> int:
        return 0

    def join(self, timeout: float | None = None) -> bool:
        return True

    def pids(self) -> list[int]:
        return [self.pid]

    def terminate(self) -> None:
        pass

    kill = close = terminate


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps accelerate's notebook_launcher as `accelerate.launchers` is imported (optional and
    slow to import: nbdist never imports it itself)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "accelerate.launchers":
            return None
        specs = (f.find_spec(fullname, path, target) for f in sys.meta_path if f is not self)
        spec = next((s for s in specs if s is not None and s.loader is not None), None)
        if spec is not None:
            exec_module = spec.loader.exec_module

            def exec_then_wrap(module: Any) -> None:
                exec_module(module)
                _wrap(module, "notebook_launcher", _notebook_launcher)

            spec.loader.exec_module = exec_then_wrap
        return spec


def run_rank_script(path: str, argv: Sequence[str], namespace: dict[str, Any]) -> None:
    """`%dist_run`: a torchrun script, unchanged, as `__main__` with its own `sys.argv`, in the
    rank's namespace (as `%run -i`: its functions are `__main__.name` for pickle and RPC); its
    `sys.exit(0)` is success, another code an error."""
    full_path = os.path.abspath(path)
    with open(full_path, encoding="utf-8") as f:
        code = compile(f.read(), full_path, "exec")
    saved_argv, saved_path, saved_file = list(sys.argv), list(sys.path), namespace.get("__file__")
    sys.argv = [full_path, *argv]
    sys.path.insert(0, os.path.dirname(full_path))  # as `python script.py` puts it first
    namespace["__file__"] = full_path
    try:
        exec(code, namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            name = os.path.basename(full_path)
            raise ScriptExit(f"{name} exited with code {exc.code!r}") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        namespace.pop("__file__", None)
        if saved_file is not None:
            namespace["__file__"] = saved_file
