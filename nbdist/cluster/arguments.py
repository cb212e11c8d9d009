"""What a user passes to `Cluster(...)` and its methods (the magics' options end up here too),
checked before any process starts or any rank is asked: each bad value is an NbdistError that
names the argument and says what would fit, never a TypeError from deeper down.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from nbdist.config import NbdistConfig, check_seconds, check_whole
from nbdist.errors import NbdistError


def check_cluster_arguments(*, n: Any, gpus_per_rank: Any, threads: Any, config: Any,
                            master_addr: Any, launcher: Any, launcher_options: Any, profile: Any,
                            interface: Any) -> dict[str, Any]:
    """Cluster's arguments but the backend (`ranks.validate_backend`) and what the launcher plan
    checks itself; returns the launcher options as a plain dict."""
    check_counts(n, gpus_per_rank, threads)
    return check_cluster_options(config=config, master_addr=master_addr, launcher=launcher,
                                 launcher_options=launcher_options, profile=profile,
                                 interface=interface)


def check_counts(n: Any, gpus_per_rank: Any, threads: Any) -> None:
    """A rank count (or None: one per GPU), GPUs per rank (0 or more), threads (or None)."""
    if n is not None:
        check_whole(n, "-n", minimum=1)
    check_whole(gpus_per_rank, "--gpus-per-rank", minimum=0)
    if threads is not None:
        check_whole(threads, "--threads", minimum=1)


def check_cluster_options(*, config: Any, master_addr: Any, launcher: Any,
                          launcher_options: Any, profile: Any, interface: Any) -> dict[str, Any]:
    """The rest of Cluster's arguments; returns the launcher options as a plain dict."""
    if config is not None and not isinstance(config, NbdistConfig):
        raise NbdistError(f"config={config!r}: give an nbdist.config.NbdistConfig "
                          "(e.g. NbdistConfig(cell_timeout=60))")
    for name, value in (("--master-addr", master_addr), ("--interface", interface),
                        ("--profile", profile)):
        if value is not None and (not isinstance(value, str) or not value.strip()
                                  or value.strip() != value or any(c.isspace() for c in value)):
            raise NbdistError(f"{name} {value!r}: give a name or address, without spaces")
    if not isinstance(launcher, str):
        raise NbdistError(f"--launcher {launcher!r}: give its name (local, mpi, slurm or ssh)")
    if launcher_options is None:
        return {}
    if not isinstance(launcher_options, Mapping):
        raise NbdistError(f"launcher_options={launcher_options!r}: give a dict of option names "
                          "to values (e.g. {'partition': 'gpu'})")
    bad_keys = [key for key in launcher_options if not isinstance(key, str) or not key.strip()]
    if bad_keys:
        raise NbdistError(f"launcher_options: {bad_keys!r} are not option names")
    return dict(launcher_options)


def check_timeout(value: Any) -> float | None:
    """None (no deadline), or a finite number of seconds above 0."""
    return None if value is None else check_seconds(value, "--timeout")


def check_rank_selection(selection: Any) -> list[int] | None:
    """None (every rank) or some ranks as whole numbers; bounds are the cluster's to check."""
    if selection is None:
        return None
    if isinstance(selection, (str, bytes)) or not isinstance(selection, Iterable):
        raise NbdistError(f"ranks={selection!r}: give a list of rank numbers, e.g. [0, 2] "
                          "(in a magic: --ranks 0,2-3)")
    ranks = list(selection)
    not_whole = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if not_whole:
        raise NbdistError(f"ranks={selection!r}: {not_whole!r} are not rank numbers")
    if not ranks:
        raise NbdistError("ranks=[]: no rank selected (leave ranks out for every rank)")
    return ranks


def check_variable_name(name: Any, what: str) -> str:
    """A Python identifier, as a rank's namespace needs it."""
    if not isinstance(name, str) or not name.isidentifier():
        raise NbdistError(f"{what}: {name!r} is not a valid Python name")
    return name


def check_directory(path: Any, name: str) -> str:
    """A directory path (str or os.PathLike) that is not an existing file."""
    if isinstance(path, bool) or not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise NbdistError(f"{name} {path!r}: give a directory path")
    text = os.fspath(path)
    if not isinstance(text, str) or os.path.isfile(text):
        raise NbdistError(f"{name} {text!r}: is a file; give a directory")
    return text


def check_code(code: Any, what: str = "the cell") -> str:
    if not isinstance(code, str):
        raise NbdistError(f"{what} must be source text (a str), not {type(code).__name__}")
    return code


def check_pushed_values(values: Any) -> dict[str, Any]:
    """What `push` binds on the ranks: a non-empty mapping of Python names to values."""
    if not isinstance(values, Mapping) or not values:
        raise NbdistError(f"push: give a dict of names to values, e.g. {{'lr': 0.1}}, not {values!r}")
    for name in values:
        check_variable_name(name, "push")
    return dict(values)
