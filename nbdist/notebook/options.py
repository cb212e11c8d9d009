"""What the magics' options mean, as plain typed functions that need no IPython: option value
types, %dist_start's multi-host flags as Cluster keyword arguments, %dist_push's items as values."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from nbdist.cluster.arguments import check_variable_name
from nbdist.config import DEFAULT, NbdistConfig, check_seconds, check_whole, memory_limit_bytes
from nbdist.errors import NbdistError

T = TypeVar("T")


def _from_text(parse: Callable[[str], T], check: Callable[[T], Any],
               what: str) -> Callable[[str], Any]:
    """An argparse type: the text read as `what`, then the check the Python API makes too."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        try:
            return check(value)
        except NbdistError as exc:  # its message without the name argparse puts first
            raise argparse.ArgumentTypeError(f"{text!r}: {str(exc).split(': ', 1)[-1]}") from None
    convert.__name__ = what
    return convert


positive_int = _from_text(int, lambda value: check_whole(value, "", minimum=1), "a whole number")
"""-n, --threads, --nproc."""
positive_seconds = _from_text(float, lambda value: check_seconds(value, ""), "a number of seconds")
"""--timeout."""
memory_size = _from_text(str, memory_limit_bytes, "a size")
"""--memory-limit, as bytes (512MiB, 1GiB, 2GB or whole bytes)."""


def launcher_kwargs(*, launcher: str = "local", profile: str | None = None,
                    master_addr: str | None = None, interface: str | None = None,
                    hosts: str | None = None, mpi_args: str | None = None, curve: bool = False,
                    launcher_options: Sequence[str] = ()) -> dict[str, Any]:
    """%dist_start's multi-host flags as Cluster keyword arguments (see nbdist.cluster.launchers).

    ``launcher_options`` are the ``-o KEY=VALUE`` items; a plain local start passes no launcher
    at all, so Cluster keeps its own default."""
    options: dict[str, Any] = {}
    for item in launcher_options:
        if "=" not in item:
            raise NbdistError(f"%dist_start -o {item!r}: write KEY=VALUE (e.g. -o partition=gpu)")
        key, value = item.split("=", 1)
        options[key.strip()] = value
    if hosts:
        options["hosts"] = hosts
    if mpi_args:
        options["mpi_args"] = mpi_args
    if curve:
        options["curve"] = True
    kwargs: dict[str, Any] = {"master_addr": master_addr, "interface": interface}
    if profile is not None:
        kwargs["profile"] = profile
    if launcher != "local" or options:
        kwargs["launcher"] = launcher
        kwargs["launcher_options"] = options
    return kwargs


def push_values(items: Sequence[str], namespace: Mapping[str, Any],
                evaluate: Callable[[str], Any]) -> dict[str, Any]:
    """%dist_push's items as ``{name: value}``: ``NAME`` takes the notebook's value, ``name=expr``
    the value of ``evaluate(expr)`` (the notebook's own evaluation, in its namespace)."""
    if not items:
        raise NbdistError("%dist_push needs names (x y) or name=expression")
    values: dict[str, Any] = {}
    for item in items:
        name, _, expr = item.partition("=")
        name = name.strip()
        check_variable_name(name, "%dist_push")  # first: nothing is evaluated for a bad name
        if "=" in item:
            try:
                values[name] = evaluate(expr)
            except Exception as exc:  # the user's expression, shown as such (not as nbdist's)
                raise NbdistError(f"%dist_push {item!r}: {type(exc).__name__}: {exc}") from None
        elif item in namespace:
            values[item] = namespace[item]
        else:
            raise NbdistError(f"%dist_push: {item!r} is not defined in the notebook")
    return values


def start_config(timeout: float | None, check_collectives: bool,
                 share_gpu: bool = False) -> NbdistConfig:
    """%dist_start's config: the defaults, with its --timeout, --check-collectives and
    --share-gpu (left out, NBDIST_SHARE_GPU decides)."""
    config = DEFAULT if timeout is None else DEFAULT.replace(cell_timeout=timeout)
    config = config.replace(check_collectives=True) if check_collectives else config
    return config.replace(share_gpu=True) if share_gpu else config


def started_message(cluster: Any, tensorboard: str | None) -> str:
    """What %dist_start prints once the ranks are up: timing, the rank table, TensorBoard."""
    lines = [f"nbdist: {cluster.world_size} rank(s) ready ({cluster.backend}) in "
             f"{cluster.start_seconds:.1f} s; first all_reduce ok on every rank",
             cluster.status().table()]
    if cluster.tensorboard is not None:
        lines.append(f"nbdist: TensorBoard scalars go to {cluster.tensorboard.run_dir} "
                     f"(tensorboard --logdir {tensorboard})")
    return "\n".join(lines)


def replaced_message(replaced: list[int], seconds: float, generation: int) -> str:
    """What %dist_restart --dead prints."""
    if not replaced:
        return "nbdist: no rank is dead: nothing to replace"
    ranks = ", ".join(map(str, replaced))
    return (f"nbdist: replaced rank(s) {ranks} in {seconds:.1f} s (process group generation "
            f"{generation}). The other ranks kept their variables; rank(s) {ranks} start empty: "
            "run the cells that define what they need (a model can come from a living rank "
            "with dist.broadcast), or %dist_restart for a fresh set of every rank")


def scripted_answers(commands: list[str]) -> Callable[[str], str]:
    """`%dist_debug -c ...`: the given commands in order (echoed after the prompt), then quit."""
    answers = iter([*commands, "q"])

    def ask(prompt: str) -> str:
        command = next(answers, "q")
        print(f"{prompt}{command}")
        return command
    return ask
