"""Functions the notebook sends to engines: probe, set a rank up, rebuild its group, push/pull.

Each runs inside an engine through ipyparallel's apply, so each takes and returns plain data.
State that must outlive one call lives in :data:`RUNTIME`.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from nbdist import torch_support
from nbdist.config import NbdistConfig
from nbdist.worker import (
    collective_checks,
    collectives,
    devices,
    flight_recorder,
    init_calls,
    launcher_calls,
    net,
    non_interactive,
    process_group,
    profiling,
    release,
    tracebacks,
)
from nbdist.worker.agent import TelemetryAgent, install_agent
from nbdist.worker.breakpoints import install as install_breakpoint_hook
from nbdist.worker.cell_channel import CALLS, open_channel
from nbdist.worker.memory_limit import apply_memory_limit, lifted
from nbdist.worker.memory_sampler import install_memory_sampler
from nbdist.worker.metrics import install_metrics
from nbdist.worker.nccl_env import nccl_environment
from nbdist.worker.setup_message import RankReady, RankSetup, RankSpec
from nbdist.worker.values import cell_classes, move_tensors


@dataclass
class RankRuntime:
    spec: RankSpec | None = None
    generation: int = -1
    pg_timeout: float = 60.0
    cell_end_collective_wait: float = 0.0
    """Seconds this rank waits at a cell's end for collectives left in flight (gloo only)."""
    agent: TelemetryAgent | None = None
    hooks_installed: bool = False


RUNTIME = RankRuntime()

RANK_DEVICE_VAR = "NBDIST_DEVICE"
"""The rank's own device ("cuda:3", "cpu"), for nbdist.strategies in this process."""

LOCAL_SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
"""Where gloo, NCCL and TensorPipe (torch.distributed.rpc) open their sockets."""


def probe(peer: str | None = None) -> dict[str, Any]:
    """What this engine is: host, pid, GPUs, cores (imports torch; the engine preloads it), and
    for multi-host rendezvous its IPv4 addresses and the address/interface it reaches `peer` by."""
    import psutil
    import torch

    me = psutil.Process()
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    route_address, route_interface = net.route_to(peer) if peer else (None, None)
    return {
        "boot_id": net.boot_id(),
        "addresses": net.ipv4_addresses(),
        "route_address": route_address,
        "route_interface": route_interface,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "create_time": me.create_time(),
        "children": [(c.pid, c.create_time()) for c in me.children(recursive=True)],
        "gpu_count": gpu_count,
        "gpu_uuids": devices.gpu_uuids(gpu_count),
        "local_id": devices.launcher_local_id(os.environ),
        "cpu_count": len(affinity) or os.cpu_count(),
        "cpu_affinity": affinity,
        "torch": str(torch.__version__),  # a TorchVersion would import torch in the notebook (2 s)
        "python": sys.executable,
        "release_signal": int(release.RELEASE_SIGNAL) if release.INSTALLED else None,
        "report_signal": release.REPORT_SIGNAL if release.INSTALLED else None,
    }


def setup_rank(setup: RankSetup) -> RankReady:
    """Environment, threads, device, notebook names, hooks, telemetry, then the process group."""
    from IPython import get_ipython

    spec, config = setup.spec, setup.config
    RUNTIME.spec = spec
    threads = _apply_environment(setup)
    notes = _apply_nccl_environment() if spec.backend == "nccl" else []
    notes += _apply_collective_checks(setup)
    non_interactive.present_as_torchrun_worker(spec)  # what Lightning & co. check
    device = _pin_device(setup)
    shell = get_ipython()
    _define_names(shell, spec, device)
    _install_hooks(shell)
    RUNTIME.agent = _start_telemetry(shell, spec.rank, config, device)
    install_breakpoint_hook(RUNTIME.agent)
    endpoint = open_channel(spec.rank, setup.channel)
    RUNTIME.pg_timeout = setup.process_group_timeout
    if spec.backend == "gloo":  # NCCL's record completes when its watchdog looks: no wait
        RUNTIME.cell_end_collective_wait = config.faults.cell_end_collective_wait
    _join_generation(setup.generation, setup.master_addr, setup.port, setup.store_path)
    # last: torch, the engine and the group are the baseline the budget is counted from
    apply_memory_limit(config.start.memory_limit, device)
    return RankReady(device=str(device), threads=threads, endpoint=endpoint, notes=tuple(notes))


def _apply_nccl_environment() -> list[str]:
    """Errors instead of process exits from NCCL's watchdog (nbdist.worker.nccl_env)."""
    to_set, notes = nccl_environment(os.environ)
    os.environ.update(to_set)
    return notes


def _apply_collective_checks(setup: RankSetup) -> list[str]:
    """The flight recorder's buffer and dump file, and torch's cross-rank checks of every
    collective when asked (read when a group is created, so before the first one)."""
    faults = setup.config.faults
    to_set, notes = flight_recorder.buffer_environment(faults.flight_recorder_entries, os.environ)
    os.environ.update(to_set)
    os.environ.update(flight_recorder.dump_environment(
        os.environ, setup.spec.rank, setup.private_dir))
    return notes + collective_checks.apply(faults.check_collectives)


def _apply_environment(setup: RankSetup) -> int:
    """The rank's environment, thread count and working directory; returns the thread count."""
    import torch

    os.environ.update(setup.spec.env(setup.master_addr, setup.port))
    os.environ["OMP_NUM_THREADS"] = str(setup.threads)
    torch.set_num_threads(setup.threads)
    if os.path.isdir(setup.cwd):
        os.chdir(setup.cwd)
        if setup.cwd not in sys.path:
            sys.path.insert(0, setup.cwd)
    return setup.threads


def _pin_device(setup: RankSetup) -> Any:
    """This rank's device (its first GPU, else the CPU) and the interface its sockets use."""
    import torch

    gpus = setup.spec.gpus
    if gpus:
        torch.cuda.set_device(gpus[0])
        device = torch.device("cuda", gpus[0])
    else:
        device = torch.device("cpu")
        # DeepSpeed would see the host's GPUs and set_device(LOCAL_RANK): invalid on a CPU rank
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # nbdist.prepare() computes here too: a CPU rank on a GPU host must not land on cuda:0
    os.environ[RANK_DEVICE_VAR] = str(device)
    if setup.master_addr.startswith("127."):
        # a local cluster: gloo, NCCL's bootstrap and TensorPipe (rpc) would otherwise listen on
        # the interface the host name resolves to, or the first non-loopback one (NCCL); a name
        # the user exported stays theirs
        for name in LOCAL_SOCKET_IFNAME_VARS:
            os.environ.setdefault(name, "lo")
    if setup.interface:  # multi-host: the interface that reaches the other ranks, on every rank
        os.environ.update(dict.fromkeys(LOCAL_SOCKET_IFNAME_VARS, setup.interface))
    return device


def _define_names(shell: Any, spec: RankSpec, device: Any) -> None:
    """The names every distributed cell can use without defining them."""
    import torch
    import torch.distributed as dist

    collectives.install()
    release.watch_new_groups()  # a sub-group's collective is released like the world's
    init_calls.install()  # a pasted script's init/destroy_process_group and rpc.init_rpc
    launcher_calls.install(spec.rank, spec.world_size, shell)  # mp.spawn, !torchrun, ...
    shell.user_ns.update(
        rank=spec.rank,
        world_size=spec.world_size,
        local_rank=spec.local_rank,
        device=device,
        gpus=[torch.device("cuda", index) for index in spec.gpus],
        dist=dist,
        torch=torch,
    )


def _start_telemetry(shell: Any, rank: int, config: NbdistConfig, device: Any) -> TelemetryAgent:
    agent = install_agent(TelemetryAgent(
        rank, config.telemetry.telemetry_interval, shell.data_pub.publish_data,
        log_spacing=config.internal.telemetry_log_spacing,
        start_delay=config.internal.telemetry_start_delay,
        collective_interval=config.telemetry.collective_report_interval,
    ))
    agent.blocked_since = collectives.TRACKER.blocked_since
    release.report_hook = _report_where
    agent.register("where", _where)
    agent.register("group", init_calls.group_state)  # the cell destroyed the world group?
    # Both providers are part of nbdist and never raise: one that cannot work on this rank
    # records why in agent.provider_errors, and the rank comes up without it. The genuinely
    # optional piece (pynvml, for GPU memory beyond torch's allocator) is the sampler's to skip.
    install_memory_sampler(agent, device)
    install_metrics(agent)
    agent.start()
    return agent


def _join_generation(generation: int, master_addr: str, port: int,
                     store_path: str | None) -> dict[str, Any]:
    spec = RUNTIME.spec
    assert spec is not None, "setup_rank first"
    result = process_group.init_generation(
        backend=spec.backend,
        master_addr=master_addr,
        port=port,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout_s=RUNTIME.pg_timeout,
        gpus=list(spec.gpus),
        generation=generation,
        store_path=store_path,
    )
    RUNTIME.generation = generation
    return result


def _where() -> dict[str, Any] | None:
    agent = RUNTIME.agent
    if agent is None or not agent.cell_running:
        return None
    where = collectives.TRACKER.snapshot()
    where["flight"] = flight_recorder.WATCHER.sample()
    return where


def _report_where() -> None:
    """The notebook asks where this running rank is now (release.REPORT_SIGNAL, on a thread of
    its own: a main thread blocked in a collective still answers), with the flight recorder's
    reading as of now rather than as of the groups' last settled progress."""
    agent = RUNTIME.agent
    if agent is not None and agent.cell_running:
        flight_recorder.WATCHER.sample(fresh=True)
        agent.publish_now("asked", only=("where",))


def _pre_run_cell(*_: Any) -> None:
    collectives.TRACKER.reset_cell()
    init_calls.cell_started()
    launcher_calls.cell_started()
    profiling.cell_started()  # a profiled cell's window starts here, not at the profiler's start
    if RUNTIME.agent is not None:
        RUNTIME.agent.cell_started()


def _post_run_cell(result: Any = None, *_: Any) -> None:
    # a breakpoint() stepped past the cell's end must not stop in what nbdist does after it:
    # pdb skips nbdist's frames, not the torch and standard-library code they call
    tracer = sys.gettrace()
    sys.settrace(None)
    try:
        _after_cell(result)
    finally:
        sys.settrace(tracer)


def _after_cell(result: Any) -> None:
    flight_recorder.wait_for_in_flight(RUNTIME.cell_end_collective_wait)
    error = getattr(result, "error_in_exec", None)
    tracker = collectives.TRACKER
    if tracker.failed_in is None and collectives.is_transport_failure(error):
        collectives.record_implicit_failure(tracker, error)
    profiling.cell_finished()
    if RUNTIME.agent is not None:
        RUNTIME.agent.cell_finished()


def _install_hooks(shell: Any) -> None:
    if RUNTIME.hooks_installed:
        return
    shell.events.register("pre_run_cell", _pre_run_cell)
    shell.events.register("post_run_cell", _post_run_cell)
    tracebacks.install(shell)
    RUNTIME.hooks_installed = True


def rebuild_process_group(
    port: int, generation: int, master_addr: str, store_path: str | None = None
) -> dict[str, Any]:
    """Tear the current group down and join a new generation on a fresh port (outside the
    rank's --memory-limit: its new threads must start even when a cell filled the budget)."""
    with lifted():
        process_group.teardown()
        return _join_generation(generation, master_addr, port, store_path)


def teardown_process_group() -> bool:
    """Close this rank's group so peers blocked on it fail now instead of at the timeout."""
    return process_group.teardown()


def cell_report() -> dict[str, Any]:
    """After a cell: the collective the rank failed in (if any), the count, the group's state
    and, from the flight recorder, per group the collective the rank last entered."""
    tracker = collectives.TRACKER
    failed = tracker.failed_in
    return {
        "rank": RUNTIME.spec.rank if RUNTIME.spec else None,
        "failed_in": None if failed is None else {"name": failed.name, "location": failed.location},
        "collectives_entered": tracker.count,
        "pg_initialized": process_group.is_initialized(),
        "group_broken": tracker.group_broken,
        "generation": RUNTIME.generation,
        "sequence": process_group.sequence_numbers(),
        "flight": _flight_latest(),
    }


def recent_collectives(limit: int) -> list[flight_recorder.EnteredCollective] | None:
    """The last `limit` collectives this rank entered (None without the flight recorder)."""
    if not flight_recorder.available():
        return None
    return flight_recorder.entries()[-limit:]


def collectives_trace(stacks: bool) -> bytes:
    """This rank's flight-recorder trace, as torch's analyser reads it."""
    torch_support.require("flight-recorder")
    return flight_recorder.analyser_trace(stacks)


def _flight_latest() -> list[flight_recorder.EnteredCollective] | None:
    """Per group the collective this (idle) rank last entered, from torch's flight recorder."""
    if not flight_recorder.available():
        return None
    try:
        return flight_recorder.latest(flight_recorder.entries())
    except Exception:  # a group torn down under the dump: the report goes without it
        return None


def receive_values(values: dict[str, Any]) -> list[str]:
    """Push: bind names in the rank's namespace, tensors moved to the rank's device."""
    from IPython import get_ipython

    device = get_ipython().user_ns.get("device")
    moved = {name: value if device is None else move_tensors(value, device)
             for name, value in values.items()}
    get_ipython().user_ns.update(moved)
    return sorted(moved)


def send_values(names: list[str], loadable: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Pull: the named values, tensors moved to CPU for the trip. `loadable`: the classes the
    notebook's `__main__` has; a value naming another cell-defined class is refused here, since
    the notebook could not unpickle it (ipyparallel would drop the reply, not report it)."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    missing = [name for name in names if name not in namespace]
    if missing:
        raise NameError(f"not defined on this rank: {', '.join(missing)}")
    values = {name: move_tensors(namespace[name], "cpu") for name in names}
    unknown = sorted(cell_classes(values) - set(loadable))
    if unknown:
        raise TypeError(
            f"the value holds {', '.join(unknown)}, defined in a cell on the ranks, which the "
            "notebook does not define: it could not rebuild the value. Run the same definition "
            "in a plain notebook cell too, or pull plain types (dicts, lists, tuples, tensors).")
    return values


CALLS.update(push=receive_values, pull=send_values)  # what the notebook calls over the channel


def shutdown_rank() -> None:
    """Stop telemetry and leave the group before the engine is stopped."""
    if RUNTIME.agent is not None:
        RUNTIME.agent.stop()
    process_group.teardown()
