"""What the notebook calls on a rank: probe, set-up, group teardown and rebuild, reports. A rank
looks like a torchrun worker to the libraries it runs, not like an interactive session."""

from __future__ import annotations

import os
import socket
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from nbdist.protocol.handshake import ProbeReply
from nbdist.protocol.wire import VERSION as PROTOCOL
from nbdist.protocol.wire import ProtocolError
from nbdist.worker import (
    collectives,
    flight_recorder,
    group_health,
    net,
    pasted_code,
    process_group,
    profiling,
    release,
    tracebacks,
)
from nbdist.worker.agent import TelemetryAgent
from nbdist.worker.breakpoints import install as install_breakpoint_hook
from nbdist.worker.cell_channel import open_channel, send_telemetry
from nbdist.worker.metrics import TIMING, install_metrics, install_step_timing
from nbdist.worker.pinning import pin_device
from nbdist.worker.rank_memory import apply_memory_limit, install_memory_sampler, lifted
from nbdist.worker.rank_service import command, load_command_modules
from nbdist.worker.setup_message import RankReady, RankSetup
from nbdist.worker.thread_device import bind_thread


@dataclass
class RankRuntime:
    setup: RankSetup | None = None  # the current generation's
    agent: TelemetryAgent | None = None


RUNTIME = RankRuntime()

# which task on the host this is, per launcher (Slurm, Open MPI, MPICH/Intel MPI)
LOCAL_ID_VARS = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                 "PMI_LOCAL_RANK")


def probe(peer: str | None = None, notebook_protocol: int | None = None) -> ProbeReply:
    """What this engine is; for a multi-host rendezvous also the address and interface it reaches
    `peer` by. The notebook compares the protocol it names with its own."""
    import psutil
    import torch

    from nbdist._version import __version__

    if notebook_protocol is not None and notebook_protocol != PROTOCOL:  # the notebook says so
        print(f"nbdist: the notebook speaks protocol {notebook_protocol}, this rank {PROTOCOL}",
              file=sys.stderr)

    me = psutil.Process()
    gpu_count = torch.cuda.device_count()  # 0 without CUDA
    affinity = sorted(os.sched_getaffinity(0))
    route_address, route_interface = net.route_to(peer) if peer else (None, None)
    return ProbeReply(
        protocol=PROTOCOL, nbdist=__version__, host=socket.gethostname(), boot_id=net.boot_id(),
        pid=os.getpid(), create_time=me.create_time(),
        children=tuple((c.pid, c.create_time()) for c in me.children(recursive=True)),
        addresses=net.ipv4_addresses(), route_address=route_address,
        route_interface=route_interface, gpu_count=gpu_count,
        gpu_uuids=tuple(gpu_uuids(gpu_count)), local_id=launcher_local_id(os.environ),
        cpu_count=len(affinity) or os.cpu_count(), cpu_affinity=tuple(affinity),
        torch=str(torch.__version__),
        release_signal=int(release.RELEASE_SIGNAL) if release.INSTALLED else None,
        report_signal=release.REPORT_SIGNAL if release.INSTALLED else None)


def gpu_uuids(count: int) -> list[str]:
    """The UUIDs of this process's GPUs: two engines that see one card report the same UUID,
    whatever CUDA_VISIBLE_DEVICES numbering each was given."""
    import torch

    try:
        return [str(torch.cuda.get_device_properties(index).uuid) for index in range(count)]
    except (RuntimeError, AssertionError, AttributeError):
        return []  # unknown: the rank map then assumes the engines share their GPUs


def launcher_local_id(environ: Mapping[str, str]) -> int | None:
    values = (environ.get(name, "").strip() for name in LOCAL_ID_VARS)
    return next((int(value) for value in values if value.isdigit()), None)


def setup_rank(setup: RankSetup) -> RankReady:
    """Environment, threads, device, notebook names, telemetry, hooks, then the process group."""
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    spec, config = setup.spec, setup.config
    if setup.protocol != PROTOCOL:
        raise ProtocolError(f"the notebook speaks nbdist protocol {setup.protocol}, this rank "
                            f"{PROTOCOL}: install the same nbdist on every host")
    RUNTIME.setup = setup
    os.environ.update(spec.env(setup.master_addr, setup.port))
    os.environ["OMP_NUM_THREADS"] = str(setup.threads)
    torch.set_num_threads(setup.threads)
    if os.path.isdir(setup.cwd):
        os.chdir(setup.cwd)
        if setup.cwd not in sys.path:
            sys.path.insert(0, setup.cwd)
    notes = process_group.apply_environment(setup)
    _present_as_torchrun_worker()
    device, placed = pin_device(setup)
    notes += placed
    collectives.install()
    release.watch_new_groups()  # a sub-group's collective is released like the world's
    shell = get_ipython()
    pasted_code.install(spec.rank, spec.world_size, shell)  # init_process_group, mp.spawn, ...
    shell.user_ns.update(
        rank=spec.rank, world_size=spec.world_size, local_rank=spec.local_rank, device=device,
        gpus=[torch.device("cuda", index) for index in spec.gpus], dist=dist, torch=torch)
    tracebacks.install(shell)
    RUNTIME.agent = _start_telemetry(shell, spec.rank, config, device)
    install_breakpoint_hook(RUNTIME.agent)
    # registered once RUNTIME has its setup and agent: the hooks never see None there
    for event, hook in (("pre_run_cell", _pre_run_cell), ("post_run_cell", _post_run_cell)):
        if hook not in shell.events.callbacks[event]:
            shell.events.register(event, hook)
    load_command_modules()  # their commands, before the first call can name one
    endpoint = open_channel(spec.rank, setup.channel, config.internal.orphan_kill_grace)
    process_group.init_generation(setup)
    # last: torch, the engine and the group are the baseline the budget is counted from
    apply_memory_limit(config.start.memory_limit, device, _rank_gpus(spec))
    return RankReady(device=str(device), threads=setup.threads, endpoint=endpoint,
                     notes=tuple(notes))


def _rank_gpus(spec: Any) -> list[Any]:
    import torch

    return [torch.device("cuda", index) for index in spec.gpus]


def _present_as_torchrun_worker() -> None:
    """No prompts (IPython's `sys.ps1` makes Lightning refuse its multi-process strategies), no
    engine options in argv (a pasted `parse_args()`), tqdm's console bar."""
    for name in ("ps1", "ps2", "ps3"):
        if hasattr(sys, name):
            delattr(sys, name)
    sys.argv[1:] = []
    # tqdm.auto picks the console bar: N ranks' widget bars would not say which rank drew them,
    # nor show without widget state; the notebook shows each rank's console bar in place
    from tqdm.std import tqdm, trange

    sys.modules.setdefault("tqdm.autonotebook", types.ModuleType("tqdm.autonotebook"))
    for name in ("tqdm.autonotebook", "tqdm.auto"):
        module = sys.modules.get(name)
        if module is not None:
            module.tqdm, module.trange = tqdm, trange  # type: ignore[attr-defined]


def _start_telemetry(shell: Any, rank: int, config: Any, device: Any) -> TelemetryAgent:
    if RUNTIME.agent is not None:  # a previous setup's
        RUNTIME.agent.stop()
    agent = TelemetryAgent(
        rank, config.telemetry.telemetry_interval, send_telemetry,
        log_spacing=config.internal.telemetry_log_spacing,
        start_delay=config.internal.telemetry_start_delay,
        collective_interval=config.telemetry.collective_report_interval, device=device)
    agent.blocked_since = collectives.TRACKER.blocked_since
    release.report_hook = _report_where
    agent.register("where", _where)
    agent.register("group", pasted_code.group_state)  # the cell destroyed the world group?
    agent.register("health", group_health.health)  # checked after every cell
    install_memory_sampler(agent, device, _rank_gpus(RUNTIME.setup.spec))
    install_metrics(agent)
    install_step_timing(agent)
    agent.start()
    return agent


def _where() -> dict[str, Any] | None:
    agent = RUNTIME.agent
    if agent is None or not agent.cell_running:
        return None
    return {**collectives.TRACKER.snapshot(), "flight": flight_recorder.WATCHER.sample()}


def _report_where() -> None:
    """REPORT_SIGNAL, on the release thread (a main thread blocked in a collective still answers),
    with the flight recorder read now rather than once the groups' progress settled."""
    agent = RUNTIME.agent
    if agent is not None and agent.cell_running:
        bind_thread(agent.device_index)  # the flight recorder's read may query CUDA events
        flight_recorder.WATCHER.sample(fresh=True)
        agent.publish_now("asked", only=("where",))


def _pre_run_cell(*_: Any) -> None:
    collectives.TRACKER.reset_cell()
    TIMING.cell_started()
    pasted_code.STATE.cell_started()
    profiling.cell_started()  # a profiled cell's window starts here, not at the profiler's start
    RUNTIME.agent.cell_started()


def _post_run_cell(result: Any = None, *_: Any) -> None:
    # a breakpoint() stepped past the cell's end must not stop in what nbdist does after it:
    # pdb skips nbdist's frames, not the torch and standard-library code they call
    tracer = sys.gettrace()
    sys.settrace(None)
    try:
        setup = RUNTIME.setup
        # gloo only: NCCL's record completes when its watchdog looks, nothing to wait for
        if setup.spec.backend == "gloo":
            flight_recorder.wait_for_in_flight(setup.config.faults.cell_end_collective_wait)
        collectives.TRACKER.cell_failed(getattr(result, "error_in_exec", None))
        profiling.cell_finished()
        RUNTIME.agent.cell_finished()
    finally:
        sys.settrace(tracer)


def rebuild_process_group(port: int, generation: int, master_addr: str,
                          store_path: str | None) -> None:
    """Join a new generation on a fresh port, outside the rank's --memory-limit: its new threads
    must start even when a cell filled the budget."""
    assert RUNTIME.setup is not None, "setup_rank first"
    RUNTIME.setup = replace(RUNTIME.setup, port=port, generation=generation,
                            master_addr=master_addr, store_path=store_path)
    with lifted():
        process_group.teardown()
        process_group.init_generation(RUNTIME.setup)


# closes this rank's group so peers blocked on it fail now instead of at the timeout
teardown_process_group = command("group.teardown", main_thread=True)(process_group.teardown)


@command("cell.report", main_thread=True)
def cell_report() -> dict[str, Any]:
    """After a cell: the collective the rank failed in, the count, the group's state and, from
    the flight recorder, per group the collective the rank last entered."""
    tracker = collectives.TRACKER
    failed = tracker.failed_in
    return {
        "failed_in": None if failed is None else {"name": failed.name, "location": failed.location},
        "collectives_entered": tracker.count,
        "pg_initialized": process_group.is_initialized(),
        "group_broken": tracker.group_broken,
        "sequence": process_group.sequence_numbers(),
        "flight": flight_recorder.WATCHER.sample(fresh=True),
    }


@command("collectives.recent", main_thread=True)
def recent_collectives(limit: int) -> list[flight_recorder.EnteredCollective]:
    """The last `limit` collectives this rank entered: torch's flight recorder where it can be
    read, else those its cells called (nbdist's own record)."""
    if flight_recorder.available():
        return flight_recorder.entries()[-limit:]
    return collectives.TRACKER.entries()[-limit:]


# the rank's trace for torch's analyser
collectives_trace = command("collectives.trace", main_thread=True)(flight_recorder.analyser_trace)


def shutdown_rank() -> None:
    """Stop telemetry and leave the group before the engine is stopped."""
    if RUNTIME.agent is not None:
        RUNTIME.agent.stop()
    process_group.teardown()
