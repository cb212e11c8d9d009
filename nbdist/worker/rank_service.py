"""The commands a notebook may send this rank, by name, registered by the features that provide
them; the rank refuses any other. A command that touches the namespace, the process group or a
profiler runs on the main thread between cells; the others answer on the service thread at once,
while a cell runs or pdb waits there."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

COMMAND_MODULES = (
    "nbdist.worker.values", "nbdist.worker.diffing", "nbdist.worker.post_mortem",
    "nbdist.worker.profiling", "nbdist.worker.bootstrap", "nbdist.worker.survivors",
    "nbdist.features.env.env_probe",
)
"""The rank-side modules that register commands (the rank halves of nbdist's features among
them), imported at set-up: a command is never reached by importing what its name says."""


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    function: Callable[..., Any]
    main_thread: bool  # waits for the running cell: it touches what the cell's thread owns


COMMANDS: dict[str, Command] = {}


class UnknownCommand(LookupError):
    pass


def command(name: str, main_thread: bool = False) -> Callable[[F], F]:
    """Register the decorated function as the rank's command `name`."""

    def register(function: F) -> F:
        known = COMMANDS.get(name)
        if known is not None and known.function is not function:
            raise ValueError(f"two rank commands named {name!r}: {known.function.__module__}."
                             f"{known.function.__qualname__} and {function.__module__}."
                             f"{function.__qualname__}")
        COMMANDS[name] = Command(name, function, main_thread)
        return function

    return register


def lookup(name: str) -> Command:
    found = COMMANDS.get(name)
    if found is None:
        raise UnknownCommand(f"this rank has no command {name!r} (it has: "
                             f"{', '.join(sorted(COMMANDS))})")
    return found


def load_command_modules() -> None:
    for module in COMMAND_MODULES:
        importlib.import_module(module)


def untraced(thread: threading.Thread) -> threading.Thread:
    """Mark a service thread as ipykernel marks its control thread: debugpy (pydevd) neither
    traces nor suspends it; pdb traces only the thread that called it."""
    thread.pydev_do_not_trace = True  # type: ignore[attr-defined]
    thread.is_pydev_daemon_thread = True  # type: ignore[attr-defined]
    return thread


def no_tracing() -> None:
    """At the start of a service thread: drop a tracer `threading.settrace` gave every thread."""
    sys.settrace(None)
    sys.setprofile(None)
