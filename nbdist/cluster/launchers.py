"""How engines start: `launcher="local"|"mpi"|"slurm"|"ssh"` mapped onto ipyparallel's own launchers.

Pure functions from nbdist's options to a traitlets `Config` plus `ipyparallel.Cluster` keyword
arguments; nbdist never starts a remote process itself. Also says which launchers' PIDs are processes
on this machine (the only ones nbdist may signal or kill by PID).
"""

from __future__ import annotations

import ipaddress
import shlex
import socket
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from traitlets.config import Config

from nbdist.errors import NbdistError, NbdistWarning
from nbdist.worker import net

LAUNCHERS = ("local", "mpi", "slurm", "ssh")
"""The values `launcher=` (and `%dist_start --launcher`) accept."""

ENGINE_SET_CLASS = {
    "local": "LocalEngineSetLauncher",
    "mpi": "MPIEngineSetLauncher",
    "slurm": "SlurmEngineSetLauncher",
    "ssh": "SSHEngineSetLauncher",
}

# Friendly option names -> the ipyparallel trait they set on the engine-set launcher.
_OPTION_TRAITS: dict[str, dict[str, str]] = {
    "mpi": {"mpi_cmd": "mpi_cmd", "mpi_args": "mpi_args"},
    "slurm": {
        "partition": "queue", "queue": "queue", "account": "account", "qos": "qos",
        "timelimit": "timelimit", "time": "timelimit", "options": "options",
        "sbatch_args": "options", "submit_command": "submit_command",
        "batch_template": "batch_template", "batch_template_file": "batch_template_file",
    },
    "ssh": {
        "ssh_cmd": "ssh_cmd", "ssh_args": "ssh_args", "scp_cmd": "scp_cmd",
        "scp_args": "scp_args", "remote_python": "remote_python",
        "remote_profile_dir": "remote_profile_dir", "user": "user",
    },
    "local": {},
}
_LIST_TRAITS = {"mpi_cmd", "mpi_args", "ssh_cmd", "ssh_args", "scp_cmd", "scp_args", "submit_command"}
# Options every launcher understands (consumed by nbdist, not handed to an engine set).
_COMMON_OPTIONS = {
    "controller_ip", "controller_location", "controller_args", "curve", "engine_python",
    "heartbeat_period_ms", "heartbeat_misses", "hosts", "spans_hosts", "environment",
}
# mpiexec arguments that place ranks on other machines.
_MPI_HOST_FLAGS = ("--host", "-host", "-H", "--hostfile", "-hostfile", "--machinefile",
                   "-machinefile", "-f", "--default-hostfile")

RENDEZVOUS_WARNING = (
    "nbdist: this cluster spans hosts, so its sockets listen off loopback. torch.distributed's "
    "rendezvous store (MASTER_ADDR:MASTER_PORT on rank 0) and gloo/NCCL connections are "
    "unauthenticated and unencrypted: anyone who can reach those ports can join or disturb the "
    "process group. Keep the ranks on a private network (a cluster fabric, a VPN, a firewalled "
    "VLAN) and pin it with --interface IFACE (Cluster(interface=...)); the ipyparallel connection "
    "itself is HMAC-signed, and launcher_options={'curve': True} (--curve) encrypts it too."
)


class MultiHostWarning(NbdistWarning):
    """Emitted once per start of a cluster whose sockets listen off loopback."""


@dataclass(frozen=True)
class LauncherPlan:
    """What nbdist hands ipyparallel for one cluster, and what it may do with the processes."""

    launcher: str
    """One of LAUNCHERS."""

    config: Config
    """traitlets config for ipyparallel.Cluster (engine-set launcher class and its traits)."""

    cluster_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ipyparallel.Cluster (controller address, engine launcher, args)."""

    spans_hosts: bool = False
    """Engines may run on other machines: bind off loopback, find MASTER_ADDR among the ranks."""

    engine_pids_local: bool = True
    """The engine-set launcher's PIDs are processes on this machine (safe to signal by PID)."""


def engine_command(python: str | None = None) -> list[str]:
    """The command that starts one nbdist engine (an ipyparallel engine that preloads torch)."""
    return [python or sys.executable, "-m", "nbdist.worker.engine"]


def _flag(value: Any) -> bool:
    """A yes/no option; from %dist_start -o it is text ("false", "0", "no" mean no)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


def _as_list(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, Sequence):
        return [str(v) for v in value]
    raise NbdistError(f"launcher option {name}={value!r}: give a list of strings or one string")


def ssh_engine_hosts(hosts: Any, n: int | None) -> dict[str, int]:
    """`hosts` as ipyparallel's SSHEngineSetLauncher.engines: {"[user@]host[:port]": engines}.

    A dict is taken as is; a list (or comma-separated string) of hosts shares `n` engines out
    round-robin (one each when n is not given). Write "host*3" to give one host 3 engines.
    """
    if isinstance(hosts, Mapping):
        out = {str(h): int(c) for h, c in hosts.items()}
    else:
        names = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else [str(h) for h in hosts]
        names = [h for h in names if h]
        explicit: dict[str, int] = {}
        for name in names:
            if "*" in name:
                host, count = name.rsplit("*", 1)
                explicit[host] = explicit.get(host, 0) + int(count)
        plain = [h for h in names if "*" not in h]
        if explicit and plain:
            raise NbdistError(f"hosts={hosts!r}: give every host a count (host*2) or none")
        if explicit:
            out = explicit
        else:
            out = {h: 0 for h in plain}
            for i in range(n if n is not None else len(plain)):
                out[plain[i % len(plain)]] += 1
    if not out or any(c < 1 for c in out.values()):
        raise NbdistError(f"ssh hosts {hosts!r}: every host needs at least one engine")
    return out


_SLURM_CONTEXT_LINES = (("queue", "--partition={queue}"), ("account", "--account={account}"),
                        ("qos", "--qos={qos}"), ("timelimit", "--time={timelimit}"))


def _slurm_options_into_template(slurm: Config) -> None:
    """Extra sbatch options as #SBATCH lines of the engine job's script.

    ipyparallel 9.2's SlurmLauncher.options reaches only the template context (a template must
    say {options} to use it), so its default script silently drops them; and a template of our
    own gets none of ipyparallel's automatic lines, so this one carries them all.
    """
    options = shlex.split(str(slurm.pop("options")))
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


def _mpi_spans_hosts(mpi_args: list[str]) -> bool:
    return any(arg.split("=", 1)[0] in _MPI_HOST_FLAGS for arg in mpi_args)


def route_source(peer: str) -> str:
    """The local address the kernel would use to reach `peer` (no packet is sent)."""
    try:
        return net.route_source(peer)
    except OSError as exc:
        raise NbdistError(
            f"cannot tell how this machine reaches {peer!r} ({exc}); pass "
            "controller_ip= (the address the engines should connect to) or interface="
        ) from None


def _host_part(location: str) -> str:
    host = location.rsplit("@", 1)[-1]
    return host.split(":", 1)[0]


def build_launcher_plan(
    launcher: str = "local",
    options: Mapping[str, Any] | None = None,
    *,
    n: int | None = None,
    interface: str | None = None,
) -> LauncherPlan:
    """Map nbdist's launcher choice and options onto ipyparallel (no process is started).

    `options` take friendly names (mpi_args, partition, hosts, ...), the common ones
    (controller_ip, curve, heartbeat_period_ms, ...), or any ipyparallel trait spelled
    ``"Class.trait"`` (e.g. ``"SlurmEngineSetLauncher.batch_template"``), passed through verbatim.
    """
    if launcher not in LAUNCHERS:
        raise NbdistError(f"--launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    opts = dict(options or {})
    engine_set = ENGINE_SET_CLASS[launcher]
    cfg = Config()
    engine_python = str(opts.pop("engine_python", "") or "") or None
    passthrough = {k: opts.pop(k) for k in list(opts) if "." in k}
    _set_friendly_options(launcher, opts, cfg[engine_set])
    placement = _PLACEMENTS[launcher](cfg, opts, n, engine_python)
    spans_hosts = _flag(opts.pop("spans_hosts")) if "spans_hosts" in opts else placement.spans_hosts
    if interface is not None:
        spans_hosts = True

    command = engine_command(placement.engine_python)
    cfg[engine_set].engine_cmd = command
    if launcher in ("local", "ssh"):  # their per-engine launchers take the command too
        cfg[f"{'Local' if launcher == 'local' else 'SSH'}EngineLauncher"].engine_cmd = command
    if "environment" in opts:
        cfg[engine_set].environment = {str(k): str(v) for k, v in dict(opts.pop("environment")).items()}

    controller_args = _controller_args(opts, spans_hosts)
    cluster_kwargs: dict[str, Any] = {"engine_launcher_class": f"ipyparallel.cluster.launcher.{engine_set}"}
    cluster_kwargs.update(_controller_address(opts, spans_hosts, interface, launcher, cfg[engine_set]))
    assert opts == {}, opts  # every option was consumed above

    for key, value in passthrough.items():
        cls_name, trait = key.split(".", 1)
        cfg[cls_name][trait] = value
    cluster_kwargs["controller_args"] = controller_args
    return LauncherPlan(launcher, cfg, cluster_kwargs, spans_hosts, placement.engine_pids_local)


def _set_friendly_options(launcher: str, opts: dict[str, Any], engine_set: Config) -> None:
    """Friendly option names onto the engine-set launcher's traits (popped from `opts`)."""
    friendly = _OPTION_TRAITS[launcher]
    unknown = sorted(k for k in opts if k not in friendly and k not in _COMMON_OPTIONS)
    if unknown:
        known = sorted(set(friendly) | _COMMON_OPTIONS)
        raise NbdistError(
            f"launcher {launcher!r} does not take option(s) {', '.join(unknown)}; it takes "
            f"{', '.join(known)} or any ipyparallel trait as 'Class.trait'"
        )
    for key, trait in friendly.items():
        if key in opts:
            value = opts.pop(key)
            if trait in _LIST_TRAITS:
                value = _as_list(value, key)
            elif trait == "timelimit" or isinstance(value, str):
                value = str(value)
            engine_set[trait] = value


@dataclass(frozen=True)
class _Placement:
    """Where one launcher's engines run, as far as the options tell."""

    spans_hosts: bool
    engine_pids_local: bool
    engine_python: str | None


def _no_hosts(launcher: str, opts: dict[str, Any]) -> None:
    if "hosts" in opts:
        raise NbdistError(f"launcher {launcher!r} does not take hosts (only ssh and mpi do)")


def _place_local(cfg: Config, opts: dict[str, Any], n: int | None, python: str | None) -> _Placement:
    _no_hosts("local", opts)
    return _Placement(spans_hosts=False, engine_pids_local=True, engine_python=python)


def _place_slurm(cfg: Config, opts: dict[str, Any], n: int | None, python: str | None) -> _Placement:
    _no_hosts("slurm", opts)
    slurm = cfg[ENGINE_SET_CLASS["slurm"]]
    if "options" in slurm:
        _slurm_options_into_template(slurm)
    return _Placement(spans_hosts=True, engine_pids_local=False, engine_python=python)


def _place_mpi(cfg: Config, opts: dict[str, Any], n: int | None, python: str | None) -> _Placement:
    mpi = cfg[ENGINE_SET_CLASS["mpi"]]
    spans_hosts = _mpi_spans_hosts(list(mpi.get("mpi_args", [])))
    if "hosts" in opts:
        hosts = opts.pop("hosts")
        names = hosts.split(",") if isinstance(hosts, str) else [str(h) for h in hosts]
        mpi.mpi_args = ["--host", ",".join(names), *mpi.get("mpi_args", [])]
        spans_hosts = True
    # mpiexec's PID is local; the ranks it placed on other machines are not
    return _Placement(spans_hosts=spans_hosts, engine_pids_local=not spans_hosts, engine_python=python)


def _place_ssh(cfg: Config, opts: dict[str, Any], n: int | None, python: str | None) -> _Placement:
    if "hosts" not in opts:
        raise NbdistError(
            "--launcher ssh needs hosts: launcher_options={'hosts': ['node1', 'node2']} "
            "(or {'node1': 4, 'node2': 4}; %dist_start --hosts node1,node2)"
        )
    ssh = cfg[ENGINE_SET_CLASS["ssh"]]
    ssh.engines = ssh_engine_hosts(opts.pop("hosts"), n)
    remote_python = ssh.get("remote_python") or python or sys.executable
    ssh.remote_python = remote_python
    # the engines get the controller's connection info in their environment (sent over
    # ssh's stdin, never argv), so no key file is copied to the remote hosts
    cfg.SSHEngineLauncher.to_send = []
    return _Placement(spans_hosts=True, engine_pids_local=False, engine_python=remote_python)


_PLACEMENTS = {"local": _place_local, "mpi": _place_mpi, "slurm": _place_slurm, "ssh": _place_ssh}


def _controller_args(opts: dict[str, Any], spans_hosts: bool) -> list[str]:
    """Log level, CurveZMQ and heartbeat settings for the controller (popped from `opts`)."""
    # ipyparallel's controller logs every request at INFO and warns about every telemetry
    # payload ("unhandled iopub msg_type: 'data_message'"): ~9 MB an hour of training on 8
    # ranks. Errors only, unless the user's own --log-level (later on the line) says otherwise.
    args: list[str] = ["--log-level=40"]
    args += _as_list(opts.pop("controller_args", []), "controller_args")
    if _flag(opts.pop("curve", False)):
        args.append("--IPController.enable_curve=True")
    if spans_hosts:
        # a dead host's engines are found by the controller's heartbeat (their PIDs are remote)
        period = int(opts.pop("heartbeat_period_ms", 1000))
        misses = int(opts.pop("heartbeat_misses", 5))
    else:
        # the hub completes an engine's registration on a heartbeat: at ipyparallel's 3 s period
        # the engines of a local cluster waited up to 3 s for it. Same tolerance (30 s) as its
        # default; the pings are answered by a C thread, so a busy engine is never missed.
        period = int(opts.pop("heartbeat_period_ms", 500))
        misses = int(opts.pop("heartbeat_misses", max(10, 30_000 // max(period, 1))))
    return args + [f"--HeartMonitor.period={period}", f"--HeartMonitor.max_heartmonitor_misses={misses}"]


def _controller_address(opts: dict[str, Any], spans_hosts: bool, interface: str | None,
                        launcher: str, engine_set: Config) -> dict[str, str]:
    """Where the controller binds (controller_ip) and the name it advertises, if not its IP."""
    controller_ip = opts.pop("controller_ip", None)
    controller_location = opts.pop("controller_location", None)
    if controller_ip is None:
        if not spans_hosts:
            controller_ip = "127.0.0.1"
        elif interface is not None:
            controller_ip = net.interface_ipv4(interface)
            if controller_ip is None:
                raise NbdistError(
                    f"--interface {interface}: this machine has no IPv4 address on it "
                    "(the controller binds there); pass controller_ip= explicitly"
                )
        elif launcher == "ssh":
            controller_ip = route_source(_host_part(next(iter(engine_set.engines))))
        else:
            # engines' hosts are unknown until the batch system places them: listen everywhere,
            # advertise this host's name (pin it with interface= or controller_ip=)
            controller_ip = "0.0.0.0"
            controller_location = controller_location or socket.gethostname()
    address = {"controller_ip": str(controller_ip)}
    if controller_location:
        address["controller_location"] = str(controller_location)
    return address


ENGINE_LOG_NOISE = "[IPEngine]"  # an engine's own log chatter, left out of the log tails we show


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def warn_unauthenticated_rendezvous() -> None:
    warnings.warn(RENDEZVOUS_WARNING, MultiHostWarning, stacklevel=3)


def engine_set_launchers(engine_set: Any) -> list[Any]:
    """The per-process launchers of an engine set (a local or ssh set has one per engine; an
    mpiexec or batch launcher is itself the one process nbdist knows)."""
    children = getattr(engine_set, "launchers", None)
    if isinstance(children, dict):
        return list(children.values())
    return [engine_set]


def has_local_pid(launcher: Any) -> bool:
    """True when `launcher.pid` is a process on this machine (local engine or mpiexec);
    false for ssh (a remote PID) and batch launchers (a job id)."""
    from ipyparallel.cluster.launcher import LocalProcessLauncher, SSHLauncher

    return isinstance(launcher, LocalProcessLauncher) and not isinstance(launcher, SSHLauncher)
