"""Launchers pasted into a cell, on a rank that already is one of the processes they would start.

`mp.spawn(fn, args, nprocs=world_size)`, `start_processes`, `multiprocessing.Process` targets
given a rank as first argument, and accelerate's `notebook_launcher` run their target here, in
place, with a one-line note; any other count, and a shell launcher (`!torchrun`, `!deepspeed`,
`!accelerate launch`), is an error that says what to write instead. Same wrappers as
`init_calls`: the pasted code runs unchanged.
"""

from __future__ import annotations

import importlib.abc
import inspect
import multiprocessing.process
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from nbdist.worker.init_calls import NOTE_PREFIX, wrap

LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")
"""Lightning's launchers return rank 0's result to a parent that a rank does not have."""


PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"
"""Where accelerate's Accelerator reads the precision `notebook_launcher(mixed_precision=)` sets."""


@dataclass
class LauncherState:
    rank: int = 0
    world_size: int = 1
    noted: set[str] = field(default_factory=set)
    """The launchers whose note rank 0 printed in the running cell."""
    process_indices: set[int] = field(default_factory=set)
    """The ranks `multiprocessing.Process` targets were started for in the running cell."""


STATE = LauncherState()


class LauncherInCellError(RuntimeError):
    """A pasted launcher asked for processes the cluster's ranks cannot stand in for."""


def install(rank: int, world_size: int, shell: Any) -> None:
    """Wrap torch.multiprocessing's spawn/start_processes, `Process.start`, the shell's `!`, and
    accelerate's notebook_launcher when (if ever) accelerate is imported."""
    import torch.multiprocessing as torch_mp

    STATE.rank, STATE.world_size = rank, world_size
    spawn_module = sys.modules["torch.multiprocessing.spawn"]
    for module in (torch_mp, spawn_module):
        if not hasattr(module.spawn, "__nbdist_original__"):
            module.spawn = wrap(module.spawn, _spawn)
            module.start_processes = wrap(module.start_processes, _spawn)
    process_class = multiprocessing.process.BaseProcess
    if not hasattr(process_class.start, "__nbdist_original__"):
        start = wrap(process_class.start, _process_start)
        process_class.start = start  # type: ignore[method-assign]
    for name in ("system", "getoutput"):  # `!cmd` and `x = !cmd`
        if not hasattr(getattr(shell, name), "__nbdist_original__"):
            setattr(shell, name, wrap(getattr(shell, name), _shell_command))
    if "accelerate.launchers" in sys.modules:
        _wrap_notebook_launcher(sys.modules["accelerate.launchers"])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("accelerate.launchers", _wrap_notebook_launcher))


def cell_started() -> None:
    STATE.noted.clear()
    STATE.process_indices.clear()


def _ranks_already() -> str:
    n = STATE.world_size
    return (f"This cluster's {n} ranks already are {n} processes in one process group "
            "(torch.distributed is initialized; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
            "MASTER_PORT are set on each), and a %%distributed cell runs on all of them at once, "
            "so processes started from a cell would be more processes on every rank, outside "
            "that group.")


def _note(launcher: str, text: str) -> None:
    if STATE.rank == 0 and launcher not in STATE.noted:
        print(f"{NOTE_PREFIX} {text}", flush=True)
    STATE.noted.add(launcher)


def _spawn(original: Any, *args: Any, **kwargs: Any) -> Any:
    """torch.multiprocessing.spawn / start_processes: `fn(rank, *args)` in place, or an error."""
    __tracebackhide__ = True
    call = inspect.signature(original).bind(*args, **kwargs)
    call.apply_defaults()
    fn, fn_args = call.arguments["fn"], tuple(call.arguments["args"])
    nprocs = call.arguments["nprocs"]
    name, launcher = _name(fn), f"mp.{original.__name__}"
    if str(getattr(fn, "__module__", "")).startswith(LIGHTNING_PACKAGES):
        raise LauncherInCellError(
            f"Lightning's process launcher (strategy 'ddp_notebook', 'ddp_fork' or 'ddp_spawn') "
            f"would start {nprocs} processes from every rank. {_ranks_already()} Use "
            f"strategy='ddp': Lightning then finds the ranks through torchrun's environment "
            f"(TorchElasticEnvironment) and uses the cluster's process group, starting nothing."
        )
    if nprocs != STATE.world_size:
        raise LauncherInCellError(
            f"{launcher}({name}, nprocs={nprocs}) asks for {nprocs} processes. {_ranks_already()} "
            f"Call the function yourself, `{name}(rank, *args)` (nbdist defines `rank` and "
            f"`world_size`), or write `nprocs=world_size` and nbdist runs it in place on each "
            f"rank; for {nprocs} ranks, start the cluster with `%dist_start -n {nprocs}`. "
            f"`{launcher}.__wrapped__(...)` starts real processes if that is what you mean."
        )
    _note(launcher, f"{launcher}({name}, nprocs={nprocs}) runs {name}(rank, ...) in place on each "
                    f"of the {nprocs} ranks: they already are the processes it would start")
    fn(STATE.rank, *fn_args)
    return None if call.arguments["join"] else _RanInPlace()


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
            f"(nbdist defines `rank`), or start the cluster with `%dist_start -n {index + 1}`."
        )
    _note("Process", f"multiprocessing.Process(target={name}, args=(i, ...)) runs on rank i, in "
                     f"place: the {STATE.world_size} ranks already are the processes it would "
                     "start")
    STATE.process_indices.add(index)
    if index == STATE.rank:
        target(*args, **process._kwargs)
    process._popen = _RanInPlace()
    del process._target, process._args, process._kwargs  # as start() does


def _wrap_notebook_launcher(module: Any) -> None:
    if not hasattr(module.notebook_launcher, "__nbdist_original__"):
        module.notebook_launcher = wrap(module.notebook_launcher, _notebook_launcher)


def _notebook_launcher(original: Any, *args: Any, **kwargs: Any) -> None:
    __tracebackhide__ = True
    call = inspect.signature(original).bind(*args, **kwargs)
    call.apply_defaults()
    fn, fn_args = call.arguments["function"], tuple(call.arguments["args"])
    count, name = call.arguments["num_processes"], _name(call.arguments["function"])
    if count not in (None, STATE.world_size):
        raise LauncherInCellError(
            f"notebook_launcher({name}, num_processes={count}) asks for {count} processes. "
            f"{_ranks_already()} Call `{name}(*args)` yourself (accelerate's Accelerator finds "
            f"the group and the environment), or write `num_processes=world_size` and nbdist "
            f"runs it in place on each rank; for {count} ranks, `%dist_start -n {count}`."
        )
    _note("notebook_launcher", f"notebook_launcher({name}) runs {name}(*args) in place on each "
                               f"of the {STATE.world_size} ranks: they already are its processes")
    precision = str(call.arguments["mixed_precision"])
    saved = os.environ.get(PRECISION_ENV)
    if precision != "no":  # what the launcher tells its workers' Accelerator
        os.environ[PRECISION_ENV] = precision
    try:
        fn(*fn_args)
    finally:
        if saved is None:
            os.environ.pop(PRECISION_ENV, None)
        else:
            os.environ[PRECISION_ENV] = saved


SHELL_LAUNCHERS = {
    "torchrun": "torchrun", "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torch.distributed.launch", "deepspeed": "deepspeed",
    "deepspeed.launcher.runner": "deepspeed", "accelerate": "accelerate launch",
    "accelerate.commands.launch": "accelerate launch", "mpirun": "mpirun", "mpiexec": "mpiexec",
}
"""Programs (or `python -m` modules) that start one process per rank themselves."""


def _shell_command(original: Any, command: str, *args: Any, **kwargs: Any) -> Any:
    __tracebackhide__ = True
    launcher = launcher_in(command)
    if launcher is not None:
        n = STATE.world_size
        script = next((w for w in _words(command) if w.endswith(".py")), "train.py")
        rest = _words(command)
        after = rest[rest.index(script) + 1:] if script in rest else []
        raise LauncherInCellError(
            f"`!{command.strip()}` in a %%distributed cell runs {launcher} on each of the {n} "
            f"ranks: {n} launchers, each starting its own workers in a process group of their "
            f"own. {_ranks_already()} Run the script on the ranks instead: `%dist_run "
            f"{' '.join([script, *after])}` (unchanged: its argv, torchrun's environment, its "
            f"init_process_group answered by the cluster's group). To run {launcher} itself, "
            f"use `!` in an ordinary cell, without %%distributed."
        )
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

    returncode = 0
    sentinel = -1

    def __init__(self) -> None:
        self.pid = os.getpid()

    def wait(self, timeout: float | None = None) -> int:
        expected = set(range(STATE.world_size))
        if STATE.process_indices and STATE.process_indices != expected:
            missing = sorted(expected - STATE.process_indices)
            raise LauncherInCellError(
                f"multiprocessing.Process: this cell started processes for ranks "
                f"{sorted(STATE.process_indices)} only, so rank(s) {missing} had nothing to run "
                f"and the others wait for them. {_ranks_already()} Start one per rank "
                f"(`for i in range(world_size)`), or call the target with `rank` yourself."
            )
        return 0

    def poll(self) -> int:
        return 0

    def join(self, timeout: float | None = None) -> bool:
        return True

    def pids(self) -> list[int]:
        return [os.getpid()]

    def close(self) -> None:
        pass

    def terminate(self) -> None:
        pass

    kill = terminate


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once `name` has been imported (accelerate is optional and slow to
    import: nbdist never imports it itself)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            found = None if finder is self else finder.find_spec(fullname, path, target)
            if found is not None and found.loader is not None:
                return self._then_after(found)
        return None

    def _then_after(self, spec: Any) -> Any:
        loader_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            loader_exec(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec
