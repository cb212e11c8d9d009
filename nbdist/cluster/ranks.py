"""Who is which rank: pure functions from the engines that registered to ranks, devices and env,
and the record of each rank's process (`RankProcess`).

Nothing here talks to a process. Engine ids change across restarts, so ranks are derived from
(host, a stable per-host slot) and never from engine ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from nbdist.cluster.arguments import check_rank_selection
from nbdist.errors import NbdistError
from nbdist.worker.cell_channel import ChannelEndpoint
from nbdist.worker.setup_message import RankSpec

BACKENDS = ("auto", "nccl", "gloo")
"""The values `backend=` (and `%dist_start --backend`) accept."""


def validate_backend(requested: str, gpus_per_rank: int = 1) -> str:
    """`requested` if it names a backend nbdist knows and the GPUs per rank allow, else a
    clear error."""
    if requested not in BACKENDS:
        raise NbdistError(f"--backend {requested!r}: choose auto, nccl or gloo")
    if requested == "nccl" and gpus_per_rank == 0:
        raise NbdistError(
            "--backend nccl with --gpus-per-rank 0: NCCL moves only CUDA tensors, so every rank "
            "needs a GPU. Use --backend gloo for CPU ranks, or --gpus-per-rank 1 or more."
        )
    return requested


@dataclass(frozen=True)
class EngineInfo:
    """What an engine reported about itself before it got a rank."""

    engine_id: int
    host: str
    pid: int
    gpu_count: int = 0
    gpu_uuids: tuple[str, ...] = ()
    """The GPUs it sees, in its own index order (empty when unknown)."""
    local_id: int | None = None
    """Its place among the tasks on its host as the launcher numbered them (SLURM_LOCALID,
    OMPI_COMM_WORLD_LOCAL_RANK), if any."""


@dataclass
class RankProcess:
    """A rank as the notebook knows it: its engine, process and state."""

    spec: RankSpec
    pid: int
    create_time: float
    device: str
    threads: int
    helper_pids: list[tuple[int, float]]
    state: str = "alive"  # alive | dead
    exit_detail: str = ""
    local: bool = True  # a process on this machine (signalled by PID); else through the controller
    release_signal: int | None = None  # the engine's "fail your blocked collective" signal, if any
    report_signal: int | None = None  # its "say where you are now" signal (nbdist.worker.release)
    endpoint: ChannelEndpoint | None = None  # where its cells go (nbdist.worker.cell_channel)
    notes: list[str] = field(default_factory=list)  # what the rank said at setup (kept settings)


def check_targets(ranks: list[RankProcess], selection: Iterable[int] | None) -> list[int]:
    """The ranks a call goes to (all by default), sorted; each must exist and be alive."""
    world_size = len(ranks)
    chosen = check_rank_selection(selection)
    targets = list(range(world_size)) if chosen is None else sorted(set(chosen))
    bad = [r for r in targets if r < 0 or r >= world_size]
    if bad:
        raise NbdistError(f"rank(s) {bad} do not exist (ranks 0-{world_size - 1})")
    dead = [r for r in targets if ranks[r].state == "dead"]
    if dead:
        raise NbdistError(f"rank(s) {dead} are dead; run %dist_restart (Cluster.restart())")
    return targets


def parse_ranks(text: str, world_size: int) -> list[int]:
    """Parse a rank selection such as ``"0,2-3"`` into a sorted list, checking bounds."""
    selected: set[int] = set()
    cleaned = text.strip()
    if not cleaned:
        raise NbdistError("--ranks is empty: give ranks like 0,2-3")
    for part in cleaned.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first_text, last_text = part.split("-", 1)
                first, last = int(first_text), int(last_text)
                if last < first:
                    raise NbdistError(f"--ranks range {part!r} runs backwards: write {last}-{first}")
                # only the part that exists is expanded: 0-99999999999 must not fill memory
                selected.update(range(first, min(last, world_size) + 1), {last})
            else:
                selected.add(int(part))
        except ValueError:
            raise NbdistError(
                f"--ranks {text!r}: {part!r} is not a rank or a range like 2-3"
            ) from None
    out_of_range = sorted(r for r in selected if r < 0 or r >= world_size)
    if out_of_range:
        raise NbdistError(
            f"--ranks {text!r}: rank(s) {out_of_range} do not exist "
            f"(this cluster has ranks 0-{world_size - 1})"
        )
    return sorted(selected)


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    if not ranks:
        return ""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = prev = ordered[0]
    for r in ordered[1:]:
        if r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = r
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)


def choose_backend(requested: str, gpu_counts: list[int], gpus_per_rank: int) -> str:
    """'auto' -> nccl when every rank can have its own GPU(s), else gloo; explicit choices checked."""
    validate_backend(requested, gpus_per_rank)
    have_gpus = bool(gpu_counts) and all(count > 0 for count in gpu_counts)
    if requested == "nccl" and not have_gpus:
        raise NbdistError(
            "--backend nccl needs a CUDA GPU on every rank's host, and torch sees none here. "
            "Use --backend gloo (CPU ranks) or start on a machine with GPUs."
        )
    if requested == "auto":
        return "nccl" if have_gpus and gpus_per_rank > 0 else "gloo"
    return requested


def gpu_shortfall(engines: list[EngineInfo], gpus_per_rank: int) -> str | None:
    """Why one rank per `gpus_per_rank` GPUs cannot be, on the first host where it cannot (its
    engines share GPUs and there are too few), or None when every rank can have its own."""
    if gpus_per_rank == 0 or not any(e.gpu_count for e in engines):
        return None  # CPU ranks asked for, or a machine without GPUs: nothing falls short
    by_host: dict[str, list[EngineInfo]] = {}
    for engine in engines:
        by_host.setdefault(engine.host, []).append(engine)
    for host, members in by_host.items():
        sets = [frozenset(e.gpu_uuids) for e in members]
        if len(members) > 1 and all(sets) and disjoint(sets):
            continue
        visible = min(e.gpu_count for e in members)
        if len(members) * gpus_per_rank > visible:
            return (f"host {host}: {len(members)} ranks x {gpus_per_rank} GPU(s) per rank, "
                    f"{visible} GPU(s) visible")
    return None


def build_rank_map(
    engines: list[EngineInfo],
    backend: str,
    gpus_per_rank: int = 1,
    host_order: list[str] | None = None,
) -> list[RankSpec]:
    """Group engines by host (first-seen or given order), order within a host by engine id.

    With GPUs, local rank r on a host owns GPUs r*k ... r*k+k-1 (k = gpus_per_rank).
    """
    if not engines:
        raise NbdistError("no engines registered: nothing to give ranks to")
    hosts: list[str] = []
    present = {engine.host for engine in engines}
    for host in host_order or []:  # earlier order first (one entry per rank there: dedupe)
        if host in present and host not in hosts:
            hosts.append(host)
    for engine in engines:
        if engine.host not in hosts:
            hosts.append(engine.host)
    by_host: dict[str, list[EngineInfo]] = {h: [] for h in hosts}
    for engine in engines:
        by_host[engine.host].append(engine)

    use_gpus = backend == "nccl" or (
        gpus_per_rank > 0 and all(e.gpu_count > 0 for e in engines)
    )
    specs: list[RankSpec] = []
    world_size = len(engines)
    for host in hosts:
        members = _launch_order(by_host[host])
        per_rank = _host_gpus(host, members, gpus_per_rank if use_gpus else 0)
        for local_rank, (engine, gpus) in enumerate(zip(members, per_rank, strict=True)):
            specs.append(
                RankSpec(
                    rank=len(specs),
                    local_rank=local_rank,
                    world_size=world_size,
                    local_world_size=len(members),
                    host=host,
                    engine_id=engine.engine_id,
                    backend=backend,
                    gpus=gpus,
                )
            )
    return specs


def _launch_order(members: list[EngineInfo]) -> list[EngineInfo]:
    """The launcher's own local numbering when every engine has one (Slurm, MPI: DeepSpeed
    asserts LOCAL_RANK equals it), else the order the engines registered in."""
    if all(e.local_id is not None for e in members):
        return sorted(members, key=lambda e: (e.local_id, e.engine_id))
    return sorted(members, key=lambda e: e.engine_id)


def disjoint(sets: list[frozenset[str]] | list[frozenset[int]]) -> bool:
    """No two of `sets` share a member (each engine has devices or cores of its own)."""
    seen: set[object] = set()
    for one in sets:
        if seen & one:
            return False
        seen |= one
    return True


def _host_gpus(host: str, members: list[EngineInfo], per_rank: int) -> list[tuple[int, ...]]:
    """Each member's GPUs, as indices it sees. Engines that all see the same GPUs split them:
    local rank r owns r*k ... r*k+k-1. Engines that see disjoint sets (Slurm --gpus-per-task,
    cgroup device limits, one MIG instance each) own the first k of their own."""
    if per_rank == 0:
        return [() for _ in members]
    sets = [frozenset(e.gpu_uuids) for e in members]
    own = len(members) > 1 and all(sets) and disjoint(sets)
    if own:
        short = [e for e in members if e.gpu_count < per_rank]
        if short:
            raise NbdistError(
                f"host {host}: each engine sees GPUs of its own, and engine {short[0].engine_id} "
                f"sees {short[0].gpu_count}, fewer than --gpus-per-rank {per_rank}. Give each "
                f"task {per_rank} GPU(s) (e.g. --gpus-per-task={per_rank}) or lower --gpus-per-rank."
            )
        return [tuple(range(per_rank)) for _ in members]
    if all(sets) and len(set(sets)) > 1:
        raise NbdistError(
            f"host {host}: its engines see different but overlapping sets of GPUs, so nbdist "
            "cannot tell which GPU is whose. Give every task the same GPUs, or each its own."
        )
    needed = len(members) * per_rank
    visible = min(e.gpu_count for e in members)
    if needed > visible:
        raise NbdistError(
            f"host {host}: {len(members)} ranks x {per_rank} GPU(s) per rank "
            f"needs {needed} GPUs, but {visible} are visible. "
            f"Start fewer ranks (-n {max(visible // per_rank, 1)}) "
            f"or lower --gpus-per-rank."
        )
    return [tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(len(members))]


def default_threads(cpu_count: int, local_world_size: int, own_cores: bool = False) -> int:
    """Cores divided by the ranks on this host, at least one; all of `cpu_count` when each
    rank's affinity is its own already (Slurm binds each task to its share)."""
    if own_cores:
        return max(1, cpu_count)
    return max(1, cpu_count // max(1, local_world_size))
