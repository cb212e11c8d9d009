"""`launcher="local"|"mpi"|"slurm"|"ssh"` and its options mapped onto ipyparallel's own launchers
(a traitlets `Config` and `ipyparallel.Cluster` arguments), and which launchers' PIDs are local."""

from __future__ import annotations

import socket
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from traitlets.config import Config

from nbdist.cluster.arguments import (
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

LAUNCHERS = ("local", "mpi", "slurm", "ssh")  # what launcher= (%dist_start --launcher) accepts

ENGINE_SET_CLASS = {"local": "LocalEngineSetLauncher", "mpi": "MPIEngineSetLauncher",
                    "slurm": "SlurmEngineSetLauncher", "ssh": "SSHEngineSetLauncher"}

# Friendly option names: the engine-set launcher's ipyparallel trait of that name, or of the name
# _ALIASES gives (set in this order: of two names for one trait, the later wins).
_OPTIONS: dict[str, tuple[str, ...]] = {
    "mpi": ("mpi_cmd", "mpi_args"),
    "slurm": ("partition", "queue", "account", "qos", "timelimit", "time", "options",
              "sbatch_args", "submit_command", "batch_template", "batch_template_file"),
    "ssh": ("ssh_cmd", "ssh_args", "scp_cmd", "scp_args", "remote_python", "remote_profile_dir",
            "user"),
    "local": (),
}
_ALIASES = {"partition": "queue", "time": "timelimit", "sbatch_args": "options"}
_LIST_TRAITS = {"mpi_cmd", "mpi_args", "ssh_cmd", "ssh_args", "scp_cmd", "scp_args",
                "submit_command"}
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
    """Once per start of a cluster whose sockets listen off loopback."""


@dataclass(frozen=True)
class LauncherPlan:
    """What nbdist hands ipyparallel for one cluster, and what it may do with the processes."""

    launcher: str  # one of LAUNCHERS
    config: Config  # for ipyparallel.Cluster: the engine-set launcher class and its traits
    cluster_kwargs: dict[str, Any]  # ipyparallel.Cluster's: controller address, launcher, args
    spans_hosts: bool  # engines may run elsewhere: bind off loopback, MASTER_ADDR among the ranks
    engine_pids_local: bool  # the engine-set launcher's PIDs are processes here (signalled by PID)
    curve: bool  # CurveZMQ (`--curve`) on ipyparallel's traffic and the cell channel


def engine_command(python: str | None = None) -> list[str]:
    """The command that starts one nbdist engine (an ipyparallel engine that preloads torch)."""
    return [python or sys.executable, "-m", "nbdist.worker.engine"]


def build_launcher_plan(launcher: str = "local", options: Mapping[str, Any] | None = None, *,
                        n: int | None = None, interface: str | None = None) -> LauncherPlan:
    """Map the launcher and its options onto ipyparallel, starting nothing. `options` take
    friendly names (mpi_args, partition, hosts...), the common ones (controller_ip, curve...), or
    any ipyparallel trait as ``"Class.trait"``, passed through verbatim."""
    if launcher not in LAUNCHERS:
        raise NbdistError(f"--launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    opts = dict(options or {})
    cfg = Config()
    engine_set = cfg[ENGINE_SET_CLASS[launcher]]
    python = opts.pop("engine_python", None)
    python = None if python is None else text_option(python, "engine_python")
    passthrough = check_passthrough({k: opts.pop(k) for k in list(opts) if "." in k})
    _set_friendly_options(launcher, opts, engine_set)
    spans_hosts, python = _place(launcher, cfg, opts, n, python)
    engine_pids_local = launcher == "local" or (launcher == "mpi" and not spans_hosts)
    spans_hosts = flag(opts.pop("spans_hosts", spans_hosts)) or interface is not None

    engine_set.engine_cmd = command = engine_command(python)
    if launcher in ("local", "ssh"):  # their per-engine launchers take the command too
        cfg[f"{'Local' if launcher == 'local' else 'SSH'}EngineLauncher"].engine_cmd = command
    if "environment" in opts:
        environment = opts.pop("environment")
        if not isinstance(environment, Mapping):
            raise NbdistError(f"launcher option environment={environment!r}: give a dict of "
                              "variable names to values (Cluster(launcher_options=...))")
        engine_set.environment = {str(k): str(v) for k, v in environment.items()}

    curve = flag(opts.pop("curve", False))
    cluster_kwargs: dict[str, Any] = {
        "engine_launcher_class": f"ipyparallel.cluster.launcher.{ENGINE_SET_CLASS[launcher]}",
        "controller_args": _controller_args(opts, spans_hosts, curve),
        **_controller_address(opts, spans_hosts, interface, launcher, engine_set)}
    assert opts == {}, opts  # every option was consumed above
    for key, value in passthrough.items():
        cls_name, trait = key.split(".", 1)
        cfg[cls_name][trait] = value
    return LauncherPlan(launcher, cfg, cluster_kwargs, spans_hosts, engine_pids_local, curve)


def _set_friendly_options(launcher: str, opts: dict[str, Any], engine_set: Config) -> None:
    """Friendly option names onto the engine-set launcher's traits (popped from `opts`)."""
    friendly = _OPTIONS[launcher]
    unknown = sorted(k for k in opts if k not in friendly and k not in _COMMON_OPTIONS)
    if unknown:
        raise NbdistError(
            f"launcher {launcher!r} does not take option(s) {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(set(friendly) | _COMMON_OPTIONS))} or any ipyparallel trait as "
            "'Class.trait'")
    for key in friendly:
        if key in opts:
            value = opts.pop(key)
            trait = _ALIASES.get(key, key)
            engine_set[trait] = (as_list(value, key) if trait in _LIST_TRAITS
                                 else text_option(value, key))


def _place(launcher: str, cfg: Config, opts: dict[str, Any], n: int | None,
           python: str | None) -> tuple[bool, str | None]:
    """Whether the engines may run on other machines, as far as the options tell, and the
    Python that runs them there."""
    engine_set = cfg[ENGINE_SET_CLASS[launcher]]
    if launcher in ("local", "slurm") and "hosts" in opts:
        raise NbdistError(f"launcher {launcher!r} does not take hosts (only ssh and mpi do)")
    if launcher == "slurm" and "options" in engine_set:
        slurm_options_into_template(engine_set)
    if launcher == "mpi":
        args = list(engine_set.get("mpi_args", []))
        if "hosts" in opts:
            hosts = opts.pop("hosts")
            names = as_list(hosts.replace(",", " ") if isinstance(hosts, str) else hosts, "hosts")
            if not names:
                raise NbdistError(f"mpi hosts={hosts!r}: name at least one host")
            engine_set.mpi_args = args = ["--host", ",".join(names), *args]
        return any(arg.split("=", 1)[0] in _MPI_HOST_FLAGS for arg in args), python
    if launcher == "ssh":
        if "hosts" not in opts:
            raise NbdistError(
                "--launcher ssh needs hosts: launcher_options={'hosts': ['node1', 'node2']} "
                "(or {'node1': 4, 'node2': 4}; %dist_start --hosts node1,node2)")
        engine_set.engines = ssh_engine_hosts(opts.pop("hosts"), n)
        engine_set.remote_python = engine_set.get("remote_python") or python or sys.executable
        # the engines get the controller's connection info in their environment (over ssh's
        # stdin, never argv), so no key file is copied to the remote hosts
        cfg.SSHEngineLauncher.to_send = []
        return True, engine_set.remote_python
    return launcher == "slurm", python


def _controller_args(opts: dict[str, Any], spans_hosts: bool, curve: bool) -> list[str]:
    """Log level, CurveZMQ and heartbeat settings for the controller (popped from `opts`)."""
    # the controller logs every request at INFO and warns about every telemetry payload: errors
    # only, unless the user's own --log-level (later on the line) says otherwise
    args: list[str] = ["--log-level=40", *as_list(opts.pop("controller_args", []),
                                                   "controller_args")]
    if curve:
        args.append("--IPController.enable_curve=True")
    # across hosts a dead host's engines are found by the heartbeat (their PIDs are remote); on
    # one, the hub completes a registration on a heartbeat, so a short period starts them sooner
    period = whole_option(opts.pop("heartbeat_period_ms", 1000 if spans_hosts else 100),
                          "heartbeat_period_ms")
    # ipyparallel's own 30 s tolerance on one host (a C thread answers the pings)
    misses = whole_option(opts.pop("heartbeat_misses", 5 if spans_hosts
                                   else max(10, 30_000 // period)), "heartbeat_misses")
    return [*args, f"--HeartMonitor.period={period}",
            f"--HeartMonitor.max_heartmonitor_misses={misses}"]


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
                    "(the controller binds there); pass controller_ip= explicitly")
        elif launcher == "ssh":
            first = next(iter(engine_set.engines)).rsplit("@", 1)[-1].split(":", 1)[0]
            try:
                controller_ip = net.route_source(first)
            except OSError as exc:
                raise NbdistError(
                    f"cannot tell how this machine reaches {first!r} ({exc}); pass "
                    "controller_ip= (the address the engines should connect to) or interface="
                ) from None
        else:
            # batch-placed engines: listen on the one address they look this host up by, never
            # on every interface (0.0.0.0)
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


ENGINE_LOG_NOISE = "[IPEngine"  # "[IPEngine]", "[IPEngine.3]": its chatter, left out of log tails


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
