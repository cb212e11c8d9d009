"""Every argument a user passes (to `Cluster(...)`, its methods, the magics, launcher options),
checked before anything starts: each bad value an NbdistError naming it and what would fit."""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from traitlets.config import Config

from nbdist.config import NbdistConfig, check_seconds, check_whole
from nbdist.errors import NbdistError


def check_cluster_arguments(*, n: Any, gpus_per_rank: Any, threads: Any, config: Any,
                            master_addr: Any, launcher: Any, launcher_options: Any, profile: Any,
                            interface: Any) -> dict[str, Any]:
    """Cluster's arguments but the backend (`ranks.validate_backend`) and what the launcher plan
    checks itself; returns the launcher options as a plain dict."""
    if n is not None:
        check_whole(n, "-n", minimum=1)
    check_whole(gpus_per_rank, "--gpus-per-rank", minimum=0)
    if threads is not None:
        check_whole(threads, "--threads", minimum=1)
    if config is not None and not isinstance(config, NbdistConfig):
        raise NbdistError(f"config={config!r}: give an nbdist.config.NbdistConfig "
                          "(e.g. NbdistConfig(cell_timeout=60))")
    for name, value in (("--master-addr", master_addr), ("--interface", interface),
                        ("--profile", profile)):
        if value is not None and (not isinstance(value, str) or not value
                                  or any(c.isspace() for c in value)):
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


def check_code(code: Any) -> str:
    if not isinstance(code, str):
        raise NbdistError(f"the cell must be source text (a str), not {type(code).__name__}")
    return code


def check_pushed_values(values: Any) -> dict[str, Any]:
    """What `push` binds on the ranks: a non-empty mapping of Python names to values."""
    if not isinstance(values, Mapping) or not values:
        raise NbdistError(
            f"push: give a dict of names to values, e.g. {{'lr': 0.1}}, not {values!r}")
    for name in values:
        check_variable_name(name, "push")
    return dict(values)


def flag(value: Any) -> bool:
    """A yes/no option; from %dist_start -o it is text ("false", "0", "no" mean no)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


SHARE_GPU_VARIABLE = "NBDIST_SHARE_GPU"
"""--share-gpu's default, read from the notebook's environment at each start (.ci/gpu-check)."""


def share_gpu_chosen(configured: bool | None) -> bool:
    """`StartConfig.share_gpu`, or where that is None, NBDIST_SHARE_GPU (1/0, yes/no, ...)."""
    if configured is not None:
        return configured
    return flag(os.environ.get(SHARE_GPU_VARIABLE, ""))


def as_list(value: Any, name: str) -> list[str]:
    """A list of strings, or one string split into shell-like words."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise NbdistError(f"launcher option {name}={value!r}: {exc}") from None
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return [str(v) for v in value]
    raise NbdistError(f"launcher option {name}={value!r}: give a list of strings or one string")


def text_option(value: Any, name: str) -> str:
    """An option ipyparallel takes as text (partition, time limit, user, ...)."""
    if value is None or isinstance(value, (Mapping, Sequence, set, bytes)) and not isinstance(
            value, str):
        raise NbdistError(f"launcher option {name}={value!r}: give it as text")
    return str(value)


def address_option(value: Any, name: str) -> str:
    """An address or host name: text without spaces."""
    text = text_option(value, name)
    if not text or any(c.isspace() for c in text):
        raise NbdistError(f"launcher option {name}={value!r}: give an address, without spaces")
    return text


def whole_option(value: Any, name: str, minimum: int = 1) -> int:
    """A whole-number option, also from text ("500")."""
    if isinstance(value, str) and value.strip().isdecimal():
        value = int(value)
    return check_whole(value, f"launcher option {name}", minimum)


def check_passthrough(options: dict[str, Any]) -> dict[str, Any]:
    """'Class.trait' options, passed to ipyparallel verbatim: both parts must be names."""
    for key in options:
        cls_name, _, trait = key.partition(".")
        if not (cls_name.isidentifier() and trait.isidentifier()):
            raise NbdistError(f"launcher option {key!r}: an ipyparallel trait is written "
                              "'Class.trait' (e.g. 'SlurmEngineSetLauncher.batch_file_name')")
    return options


def ssh_engine_hosts(hosts: Any, n: int | None) -> dict[str, int]:
    """`hosts` as ipyparallel's SSHEngineSetLauncher.engines: {"[user@]host[:port]": engines}.
    A dict is taken as is; a list (or comma-separated string) of hosts shares `n` engines out
    round-robin (one each without n); "host*3" gives one host 3 engines."""
    if isinstance(hosts, Mapping):
        out = {text_option(h, "hosts"): whole_option(c, f"hosts[{h!r}]", minimum=0)
               for h, c in hosts.items()}
    else:
        names = hosts.split(",") if isinstance(hosts, str) else as_list(hosts, "hosts")
        names = [h.strip() for h in names if h.strip()]
        out = {}
        for name in names:
            host, star, count = name.rpartition("*")
            if star and (not host or not count.strip().isdecimal()):
                raise NbdistError(f"hosts={hosts!r}: {name!r} is not host*COUNT (e.g. node1*2)")
            out[host or name] = out.get(host or name, 0) + (int(count) if star else 0)
        plain = [h for h in names if "*" not in h]
        if plain and len(plain) < len(names):
            raise NbdistError(f"hosts={hosts!r}: give every host a count (host*2) or none")
        for i in range(n if n is not None and plain else len(plain)):
            out[plain[i % len(plain)]] += 1
    if not out or any(c < 1 for c in out.values()):
        raise NbdistError(f"ssh hosts {hosts!r}: every host needs at least one engine")
    return out


_SLURM_CONTEXT_LINES = (("queue", "--partition={queue}"), ("account", "--account={account}"),
                        ("qos", "--qos={qos}"), ("timelimit", "--time={timelimit}"))


def slurm_options_into_template(slurm: Config) -> None:
    """Extra sbatch options as #SBATCH lines of a job script of our own: ipyparallel's
    SlurmLauncher.options reaches only a template that says {options}, and its default does
    not; a template of our own gets none of its automatic lines, so this one carries them."""
    options = as_list(str(slurm.pop("options")), "options")
    if not options:
        return
    if "batch_template" in slurm or "batch_template_file" in slurm:
        raise NbdistError("slurm: give extra sbatch options either as options= or inside your "
                          "own batch_template, not both")
    lines = ["--export=ALL", "--job-name=ipengine-{cluster_id}", "--ntasks={n}",
             "--output={output_file}"]
    lines += [line for key, line in _SLURM_CONTEXT_LINES if slurm.get(key)]
    pending = list(options)
    while pending:
        opt = pending.pop(0)
        if not opt.startswith("-"):
            raise NbdistError(f"slurm options {options!r}: {opt!r} is not an sbatch option")
        if "=" not in opt and pending and not pending[0].startswith("-"):
            opt = f"{opt} {pending.pop(0)}"  # "-c 8" -> "#SBATCH -c 8"
        lines.append(opt.replace("{", "{{").replace("}", "}}"))
    body = "\n".join(f"#SBATCH {line}" for line in lines)
    slurm.batch_template = f"#!/bin/sh\n{body}\nsrun {{program_and_args}}\n"
