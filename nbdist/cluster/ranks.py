"""Who is which rank: pure functions from registered engines to ranks and devices, and each
rank's record (`RankProcess`). Engine ids change across restarts: ranks come from (host, slot)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from nbdist.cluster.arguments import check_rank_selection
from nbdist.errors import NbdistError
from nbdist.protocol.handshake import ChannelEndpoint
from nbdist.worker.setup_message import RankSpec

BACKENDS = ("auto", "nccl", "gloo")


def validate_backend(requested: str, gpus_per_rank: int = 1) -> str:
    if requested not in BACKENDS:
        raise NbdistError(f"--backend {requested!r}: choose auto, nccl or gloo")
    if requested == "nccl" and gpus_per_rank == 0:
        raise NbdistError(
            "--backend nccl with --gpus-per-rank 0: NCCL moves only CUDA tensors, so every rank "
            "needs a GPU. Use --backend gloo for CPU ranks, or --gpus-per-rank 1 or more.")
    return requested


@dataclass(frozen=True)
class EngineInfo:
    engine_id: int
    host: str
    pid: int
    gpu_count: int = 0
    gpu_uuids: tuple[str, ...] = ()  # the GPUs it sees, in its own index order
    local_id: int | None = None  # its launcher's number on its host (SLURM_LOCALID...), if any


@dataclass
class RankProcess:
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
    """The ranks a call goes to (all by default), sorted, each checked to exist and be alive."""
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
    """``"0,2-3"`` -> ``[0, 2, 3]``, checked against `world_size`."""
    if not text.strip():
        raise NbdistError("--ranks is empty: give ranks like 0,2-3")
    selected: set[int] = set()
    for part in (part.strip() for part in text.split(",")):
        first_text, dash, last_text = part.partition("-")
        try:
            first = int(first_text)
            last = int(last_text) if dash else first
        except ValueError:
            raise NbdistError(
                f"--ranks {text!r}: {part!r} is not a rank or a range like 2-3") from None
        if last < first:
            raise NbdistError(f"--ranks range {part!r} runs backwards: write {last}-{first}")
        # only the part that exists is expanded: 0-99999999999 must not fill memory
        selected.update(range(first, min(last, world_size) + 1), {last})
    out_of_range = sorted(r for r in selected if r < 0 or r >= world_size)
    if out_of_range:
        raise NbdistError(f"--ranks {text!r}: rank(s) {out_of_range} do not exist "
                          f"(this cluster has ranks 0-{world_size - 1})")
    return sorted(selected)


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts = []
    for _, run in itertools.groupby(enumerate(sorted(ranks)), lambda pair: pair[1] - pair[0]):
        first, *rest = [r for _, r in run]
        parts.append(f"{first}-{rest[-1]}" if rest else str(first))
    return ",".join(parts)


def choose_backend(requested: str, gpu_counts: list[int], gpus_per_rank: int) -> str:
    """'auto' -> nccl when every rank can have its own GPU(s), else gloo; others checked."""
    validate_backend(requested, gpus_per_rank)
    have_gpus = bool(gpu_counts) and all(count > 0 for count in gpu_counts)
    if requested == "nccl" and not have_gpus:
        raise NbdistError(
            "--backend nccl needs a CUDA GPU on every rank's host, and torch sees none here. "
            "Use --backend gloo (CPU ranks) or start on a machine with GPUs.")
    if requested == "auto":
        return "nccl" if have_gpus and gpus_per_rank > 0 else "gloo"
    return requested


def each_its_own(sets: list[frozenset[str]] | list[frozenset[int]]) -> bool:
    """Several sets, none empty and no two sharing a member: each engine has GPUs (or cores) of
    its own (Slurm --gpus-per-task, cgroup device limits, one MIG instance each)."""
    seen: set[object] = set()
    for one in sets:
        if not one or seen & one:
            return False
        seen |= one
    return len(sets) > 1


def _by_host(engines: list[EngineInfo]) -> dict[str, list[EngineInfo]]:
    hosts: dict[str, list[EngineInfo]] = {}
    for engine in engines:
        hosts.setdefault(engine.host, []).append(engine)
    return hosts


def gpu_shortfall(engines: list[EngineInfo], gpus_per_rank: int) -> str | None:
    """Why not every rank can have its own `gpus_per_rank` GPUs, on the first host where its
    engines share too few; None when they can (or CPU ranks are asked for, or there are no GPUs)."""
    if gpus_per_rank == 0 or not any(e.gpu_count for e in engines):
        return None
    for host, members in _by_host(engines).items():
        visible = min(e.gpu_count for e in members)
        own = each_its_own([frozenset(e.gpu_uuids) for e in members])
        if not own and len(members) * gpus_per_rank > visible:
            return (f"host {host}: {len(members)} ranks x {gpus_per_rank} GPU(s) per rank, "
                    f"{visible} GPU(s) visible")
    return None


def build_rank_map(engines: list[EngineInfo], backend: str, gpus_per_rank: int = 1,
                   host_order: list[str] | None = None, share_gpu: bool = False) -> list[RankSpec]:
    """Group engines by host (`host_order` first, then first-seen), each host's in launch order;
    with GPUs, local rank r on a host owns GPUs r*k ... r*k+k-1 (k = gpus_per_rank), or with
    `share_gpu`, where those run out, the visible GPUs again from the first (round-robin)."""
    if not engines:
        raise NbdistError("no engines registered: nothing to give ranks to")
    grouped = _by_host(engines)
    hosts = dict.fromkeys([h for h in host_order or [] if h in grouped] + list(grouped))
    use_gpus = backend == "nccl" or (gpus_per_rank > 0 and all(e.gpu_count > 0 for e in engines))
    specs: list[RankSpec] = []
    for host in hosts:
        members = _launch_order(grouped[host])
        per_rank = _host_gpus(host, members, gpus_per_rank if use_gpus else 0, share_gpu)
        firsts = [gpus[0] for gpus in per_rank if gpus]
        for local_rank, (engine, gpus) in enumerate(zip(members, per_rank, strict=True)):
            specs.append(RankSpec(rank=len(specs), local_rank=local_rank, world_size=len(engines),
                                  local_world_size=len(members), host=host,
                                  engine_id=engine.engine_id, backend=backend, gpus=gpus,
                                  shares_gpu=bool(gpus) and firsts.count(gpus[0]) > 1))
    return specs


def _launch_order(members: list[EngineInfo]) -> list[EngineInfo]:
    """The launcher's own local numbering when every engine has one (Slurm, MPI: DeepSpeed
    asserts LOCAL_RANK equals it), else the order the engines registered in."""
    if all(e.local_id is not None for e in members):
        return sorted(members, key=lambda e: (e.local_id, e.engine_id))
    return sorted(members, key=lambda e: e.engine_id)


def _host_gpus(host: str, members: list[EngineInfo], per_rank: int,
               share_gpu: bool = False) -> list[tuple[int, ...]]:
    """Each member's GPUs, as indices it sees: engines that see the same GPUs split them (with
    `share_gpu`, round-robin once they run out), those that see GPUs of their own own the first
    `per_rank` of them."""
    if per_rank == 0:
        return [() for _ in members]
    sets = [frozenset(e.gpu_uuids) for e in members]
    if each_its_own(sets):
        short = [e for e in members if e.gpu_count < per_rank]
        if short:
            raise NbdistError(
                f"host {host}: each engine sees GPUs of its own, and engine {short[0].engine_id} "
                f"sees {short[0].gpu_count}, fewer than --gpus-per-rank {per_rank}. Give each "
                f"task {per_rank} GPU(s) (e.g. --gpus-per-task={per_rank}) or lower "
                "--gpus-per-rank.")
        return [tuple(range(per_rank)) for _ in members]
    if all(sets) and len(set(sets)) > 1:
        raise NbdistError(
            f"host {host}: its engines see different but overlapping sets of GPUs, so nbdist "
            "cannot tell which GPU is whose. Give every task the same GPUs, or each its own.")
    needed = len(members) * per_rank
    visible = min(e.gpu_count for e in members)
    if share_gpu and needed > visible > 0:
        return [tuple((r * per_rank + j) % visible for j in range(per_rank))
                for r in range(len(members))]
    if needed > visible:
        raise NbdistError(
            f"host {host}: {len(members)} ranks x {per_rank} GPU(s) per rank needs {needed} "
            f"GPUs, but {visible} are visible. Start fewer ranks (-n "
            f"{max(visible // per_rank, 1)}), lower --gpus-per-rank, or let ranks share GPUs "
            "(--share-gpu).")
    return [tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(len(members))]


def default_threads(cpu_count: int, local_world_size: int, own_cores: bool = False) -> int:
    """Cores divided by the ranks on the host, at least one; all of them when each rank's affinity
    is its own already (Slurm binds each task to its share)."""
    return max(1, cpu_count if own_cores else cpu_count // max(1, local_world_size))
