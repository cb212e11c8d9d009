"""The values of launcher options (`launcher_options=`, `%dist_start -o KEY=VALUE`) read as what
ipyparallel needs: yes/no, lists, text, whole numbers, ssh host lists, sbatch lines. Each bad value
is an NbdistError naming the option, before anything starts."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from traitlets.config import Config

from nbdist.errors import NbdistError


def flag(value: Any) -> bool:
    """A yes/no option; from %dist_start -o it is text ("false", "0", "no" mean no)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


def split_words(text: str, name: str) -> list[str]:
    """Shell-like words (quotes group them), or a clear error for an unclosed quote."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise NbdistError(f"launcher option {name}={text!r}: {exc}") from None


def as_list(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return split_words(value, name)
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return [str(v) for v in value]
    raise NbdistError(f"launcher option {name}={value!r}: give a list of strings or one string")


def text_option(value: Any, name: str) -> str:
    """An option ipyparallel takes as text (partition, time limit, user, ...)."""
    if value is None or isinstance(value, (Mapping, Sequence, set, bytes)) and not isinstance(value, str):
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
    try:
        number = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
        raise NbdistError(f"launcher option {name}={value!r}: give a whole number, "
                          f"{minimum} or more")
    return number


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
    round-robin (one each when n is not given). Write "host*3" to give one host 3 engines.
    """
    if isinstance(hosts, Mapping):
        out = {text_option(h, "hosts"): whole_option(c, f"hosts[{h!r}]", minimum=0)
               for h, c in hosts.items()}
    else:
        names = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else as_list(hosts, "hosts")
        names = [h for h in names if h]
        explicit: dict[str, int] = {}
        for name in names:
            if "*" in name:
                host, count = name.rsplit("*", 1)
                if not host or not count.strip().isdecimal():
                    raise NbdistError(f"hosts={hosts!r}: {name!r} is not host*COUNT (e.g. node1*2)")
                explicit[host] = explicit.get(host, 0) + int(count)
        plain = [h for h in names if "*" not in h]
        if explicit and plain:
            raise NbdistError(f"hosts={hosts!r}: give every host a count (host*2) or none")
        if explicit:
            out = explicit
        else:
            out = {h: 0 for h in plain}
            for i in range(n if n is not None and plain else len(plain)):
                out[plain[i % len(plain)]] += 1
    if not out or any(c < 1 for c in out.values()):
        raise NbdistError(f"ssh hosts {hosts!r}: every host needs at least one engine")
    return out


_SLURM_CONTEXT_LINES = (("queue", "--partition={queue}"), ("account", "--account={account}"),
                        ("qos", "--qos={qos}"), ("timelimit", "--time={timelimit}"))


def slurm_options_into_template(slurm: Config) -> None:
    """Extra sbatch options as #SBATCH lines of the engine job's script.

    ipyparallel 9.2's SlurmLauncher.options reaches only the template context (a template must
    say {options} to use it), so its default script silently drops them; and a template of our
    own gets none of ipyparallel's automatic lines, so this one carries them all.
    """
    options = split_words(str(slurm.pop("options")), "options")
    if not options:
        return
    if "batch_template" in slurm or "batch_template_file" in slurm:
        raise NbdistError(
            "slurm: give extra sbatch options either as options= or inside your own "
            "batch_template, not both"
        )
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
