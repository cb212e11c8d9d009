"""How engines start: `launcher="local"|"mpi"|"slurm"|"ssh"` mapped onto ipyparallel's own launchers.

Pure functions from nbdist's options to a traitlets `Config` plus `ipyparallel.Cluster` keyword
arguments; nbdist never starts a remote process itself. Also says which launchers' PIDs are processes
on this machine (the only ones nbdist may signal or kill by PID).
"""

from __future__ import annotations

import socket
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from traitlets.config import Config

from nbdist.cluster.launcher_options import (
    address_option,
    as_list,
    check_passthrough,
    flag,
    slurm_options_into_template,
    ssh_engine_hosts,
    text_option,
    whole_option,
)
from nbdist.errors import NbdistError, NbdistWarning
from nbdist.worker import net

__all__ = ["LAUNCHERS", "LauncherPlan", "MultiHostWarning", "build_launcher_plan",
           "engine_command", "has_local_pid", "ssh_engine_hosts"]

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
    "VLAN) and pin it with --interface IFACE (Cluster(interface=...)). nbdist's cell channel "
    "(cells, their output, pdb, widgets) is signed and CurveZMQ-encrypted; ipyparallel's "
    "connection is signed, and launcher_options={'curve': True} (--curve) encrypts it too."
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

    curve: bool = False
    """Encrypt with CurveZMQ (`--curve`): ipyparallel's traffic, and the cell channel on one host
    too (across hosts it always is)."""


def engine_command(python: str | None = None) -> list[str]:
    """The command that starts one nbdist engine (an ipyparallel engine that preloads torch)."""
    return [python or sys.executable, "-m", "nbdist.worker.engine"]


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
    engine_python = (text_option(opts.pop("engine_python"), "engine_python")
                     if "engine_python" in opts else None)
    passthrough = check_passthrough({k: opts.pop(k) for k in list(opts) if "." in k})
    _set_friendly_options(launcher, opts, cfg[engine_set])
    placement = _PLACEMENTS[launcher](cfg, opts, n, engine_python)
    spans_hosts = flag(opts.pop("spans_hosts")) if "spans_hosts" in opts else placement.spans_hosts
    if interface is not None:
        spans_hosts = True

    command = engine_command(placement.engine_python)
    cfg[engine_set].engine_cmd = command
    if launcher in ("local", "ssh"):  # their per-engine launchers take the command too
        cfg[f"{'Local' if launcher == 'local' else 'SSH'}EngineLauncher"].engine_cmd = command
    if "environment" in opts:
        environment = opts.pop("environment")
        if not isinstance(environment, Mapping):
            raise NbdistError(f"launcher option environment={environment!r}: give a dict of "
                              "variable names to values (Cluster(launcher_options=...))")
        cfg[engine_set].environment = {str(k): str(v) for k, v in environment.items()}

    curve = flag(opts.pop("curve", False))
    controller_args = _controller_args(opts, spans_hosts, curve)
    cluster_kwargs: dict[str, Any] = {"engine_launcher_class": f"ipyparallel.cluster.launcher.{engine_set}"}
    cluster_kwargs.update(_controller_address(opts, spans_hosts, interface, launcher, cfg[engine_set]))
    assert opts == {}, opts  # every option was consumed above

    for key, value in passthrough.items():
        cls_name, trait = key.split(".", 1)
        cfg[cls_name][trait] = value
    cluster_kwargs["controller_args"] = controller_args
    return LauncherPlan(launcher, cfg, cluster_kwargs, spans_hosts, placement.engine_pids_local,
                        curve)


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
            engine_set[trait] = as_list(value, key) if trait in _LIST_TRAITS else text_option(value, key)


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
        slurm_options_into_template(slurm)
    return _Placement(spans_hosts=True, engine_pids_local=False, engine_python=python)


def _place_mpi(cfg: Config, opts: dict[str, Any], n: int | None, python: str | None) -> _Placement:
    mpi = cfg[ENGINE_SET_CLASS["mpi"]]
    spans_hosts = _mpi_spans_hosts(list(mpi.get("mpi_args", [])))
    if "hosts" in opts:
        hosts = opts.pop("hosts")
        names = as_list(hosts.replace(",", " ") if isinstance(hosts, str) else hosts, "hosts")
        if not names:
            raise NbdistError(f"mpi hosts={hosts!r}: name at least one host")
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


def _controller_args(opts: dict[str, Any], spans_hosts: bool, curve: bool) -> list[str]:
    """Log level, CurveZMQ and heartbeat settings for the controller (popped from `opts`)."""
    # ipyparallel's controller logs every request at INFO and warns about every telemetry
    # payload ("unhandled iopub msg_type: 'data_message'"): ~9 MB an hour of training on 8
    # ranks. Errors only, unless the user's own --log-level (later on the line) says otherwise.
    args: list[str] = ["--log-level=40"]
    args += as_list(opts.pop("controller_args", []), "controller_args")
    if curve:
        args.append("--IPController.enable_curve=True")
    if spans_hosts:
        # a dead host's engines are found by the controller's heartbeat (their PIDs are remote)
        period = whole_option(opts.pop("heartbeat_period_ms", 1000), "heartbeat_period_ms")
        misses = whole_option(opts.pop("heartbeat_misses", 5), "heartbeat_misses")
    else:
        # the hub completes an engine's registration on a heartbeat: at ipyparallel's 3 s period
        # the engines of a local cluster waited up to 3 s for it (at 500 ms: 0.25 s on average of
        # every start and restart). Same tolerance (30 s) as its default; the pings are answered
        # by a C thread, so a busy engine is never missed.
        period = whole_option(opts.pop("heartbeat_period_ms", 100), "heartbeat_period_ms")
        misses = whole_option(opts.pop("heartbeat_misses", max(10, 30_000 // period)),
                              "heartbeat_misses")
    return args + [f"--HeartMonitor.period={period}", f"--HeartMonitor.max_heartmonitor_misses={misses}"]


def _controller_address(opts: dict[str, Any], spans_hosts: bool, interface: str | None,
                        launcher: str, engine_set: Config) -> dict[str, str]:
    """Where the controller binds (controller_ip) and the name it advertises, if not its IP."""
    controller_ip, controller_location = (
        address_option(opts.pop(key), key) if key in opts else None
        for key in ("controller_ip", "controller_location"))
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
            # engines' hosts are unknown until the batch system places them: listen on the one
            # address they will look this host up by, never on every interface (0.0.0.0)
            controller_ip = net.host_address()
            if controller_ip is None:
                raise NbdistError(
                    f"--launcher {launcher}: cannot tell which network the engines reach this "
                    f"host by ({socket.gethostname()!r} resolves to loopback or to no address of "
                    f"it). Name it: --interface IFACE (interfaces here: "
                    f"{', '.join(sorted(net.ipv4_addresses()))}) or -o controller_ip=ADDR")
            controller_location = controller_location or controller_ip
    address = {"controller_ip": str(controller_ip)}
    if controller_location:
        address["controller_location"] = str(controller_location)
    return address


ENGINE_LOG_NOISE = "[IPEngine"  # "[IPEngine]", "[IPEngine.3]": its own chatter, left out of the log tails we show


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
