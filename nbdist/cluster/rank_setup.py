"""The notebook's half of the rank bootstrap: how many ranks, probe the engines, give them ranks
and send each its `RankSetup`. The state (generation, rank table) stays in `ClusterCore`."""

from __future__ import annotations

import gc
import os
import subprocess
import time
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nbdist import torch_support
from nbdist.cluster.gather import collect, gather
from nbdist.cluster.launchers import LauncherPlan
from nbdist.cluster.ranks import (
    EngineInfo,
    RankProcess,
    RankSpec,
    build_rank_map,
    choose_backend,
    default_threads,
    each_its_own,
    gpu_shortfall,
)
from nbdist.cluster.rendezvous import controller_host, is_local_engine
from nbdist.errors import ClusterStartError, NbdistWarning
from nbdist.protocol import wire
from nbdist.protocol.handshake import ProbeReply, version_mismatch
from nbdist.worker import bootstrap
from nbdist.worker.setup_message import RankSetup

if TYPE_CHECKING:  # pragma: no cover
    from nbdist.cluster import ClusterCore


def rank_count(requested_n: int | None, plan: LauncherPlan | None) -> int:
    """-n if given, else the engines an ssh host list names, else one rank per GPU here (else
    2 CPU ranks), counted without importing CUDA in the notebook."""
    if requested_n:
        return requested_n
    ssh_hosts = plan.config.get("SSHEngineSetLauncher", {}).get("engines") if plan else None
    if ssh_hosts:
        return int(sum(ssh_hosts.values()))
    return local_gpu_count() or 2


# where a CUDA driver shows its devices (NVIDIA), ROCm its one (AMD), WSL its GPU bridge
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def local_gpu_count() -> int | None:
    """The GPUs an engine started here would see, without importing CUDA in the notebook:
    CUDA_VISIBLE_DEVICES, else nvidia-smi's list; None when neither can tell (no nvidia-smi on
    a machine with a GPU driver's device files)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return None if any(map(os.path.exists, _GPU_DEVICE_FILES)) else 0


def require_gpu_to_share(gpu_counts: dict[str, int]) -> None:
    """--share-gpu's one-line error for hosts (name -> GPUs seen) without a GPU."""
    empty = sorted(host for host, count in gpu_counts.items() if count == 0)
    if empty:
        raise ClusterStartError(
            f"--share-gpu (share_gpu=True) puts the ranks on a GPU, and {', '.join(empty)} has "
            "none that CUDA sees: start without it for CPU ranks (gloo).")


def sharing_note(specs: list[RankSpec]) -> str | None:
    """The line a start prints when ranks share a GPU; None when none do."""
    shared = [s for s in specs if s.shares_gpu]
    if not shared:
        return None
    devices = ", ".join(sorted({s.device for s in shared}))
    return (f"{len(shared)} ranks share {devices} (--share-gpu), NCCL between them over "
            "loopback sockets: for learning and testing, not speed")


def probe(client: Any, ids: Iterable[int], timeout: float) -> dict[int, ProbeReply]:
    """What each engine is, once both ends said which protocol they speak."""
    peer = controller_host(client)
    asyncs = {eid: client[eid].apply_async(bootstrap.probe, peer, wire.VERSION) for eid in ids}
    probes = collect(asyncs, timeout, "probing engines (torch import)")
    for eid, found in sorted(probes.items()):
        where = f"engine {eid} (host {getattr(found, 'host', '?')})"
        # a dict: an nbdist from before protocol versions
        mismatch = version_mismatch(found.protocol if isinstance(found, ProbeReply) else 0,
                                    getattr(found, "nbdist", ""), where)
        if mismatch:
            raise ClusterStartError(mismatch)
    too_old = torch_support.floor_problem({eid: found.torch for eid, found in probes.items()})
    if too_old:
        raise ClusterStartError(too_old)
    return probes


def plan_ranks(probes: dict[int, ProbeReply], requested_backend: str, gpus_per_rank: int,
               host_order: list[str] | None, share_gpu: bool = False) -> list[RankSpec]:
    """The rank table (hosts in `host_order` first: ranks survive restarts)."""
    infos = [EngineInfo(engine_id=eid, host=found.host, pid=found.pid,
                        gpu_count=found.gpu_count, gpu_uuids=tuple(found.gpu_uuids),
                        local_id=found.local_id)
             for eid, found in sorted(probes.items())]
    if share_gpu:
        require_gpu_to_share({i.host: i.gpu_count for i in infos})
    else:
        gpus_per_rank = gpus_or_cpu(infos, requested_backend, gpus_per_rank)
    backend = choose_backend(requested_backend, [i.gpu_count for i in infos], gpus_per_rank)
    return build_rank_map(infos, backend, gpus_per_rank, host_order=host_order,
                          share_gpu=share_gpu)


def gpus_or_cpu(infos: list[EngineInfo], requested_backend: str, gpus_per_rank: int) -> int:
    """`gpus_per_rank`, or 0 (CPU ranks, with a warning) when the backend was left to nbdist and
    a host has too few GPUs: a tutorial's `-n 2` runs on a one-GPU laptop. nccl keeps the error."""
    shortfall = gpu_shortfall(infos, gpus_per_rank)
    if shortfall is None or requested_backend != "auto":
        return gpus_per_rank
    fits = max(min(i.gpu_count for i in infos) // gpus_per_rank, 1)
    warnings.warn(NbdistWarning(
        f"{shortfall}: every rank runs on the CPU (gloo). For one rank per GPU start -n {fits}; "
        "--share-gpu puts them on the GPU(s) with NCCL (slow; for learning and testing); "
        "--backend nccl makes this an error."), stacklevel=2)
    return 0


def rank_threads(specs: list[RankSpec], probes: dict[int, ProbeReply],
                 requested: int | None) -> dict[int, int]:
    """Each rank's threads: `requested`, else its host's cores shared out among the ranks there."""
    own_cores = cores_of_their_own(specs, probes)
    return {s.rank: requested or default_threads(probes[s.engine_id].cpu_count or 1,
                                                 s.local_world_size, own_cores[s.host])
            for s in specs}


def cores_of_their_own(specs: list[RankSpec], probes: dict[int, ProbeReply]) -> dict[str, bool]:
    """Host -> whether its engines' CPU affinities are disjoint (a launcher bound each task to its
    share: dividing that again by the ranks on the host would starve them)."""
    cores: dict[str, list[frozenset[int]]] = {}
    for spec in specs:
        affinity = probes[spec.engine_id].cpu_affinity
        cores.setdefault(spec.host, []).append(frozenset(affinity))
    return {host: each_its_own(sets) for host, sets in cores.items()}


def new_generation(cluster: ClusterCore, specs: list[RankSpec], probes: dict[int, ProbeReply],
                   threads: dict[int, int], living: list[RankProcess]) -> list[RankProcess]:
    """The cluster's next process-group generation, on a fresh port: the ranks of `specs` set up
    and join it while the `living` ones rebuild into it; returns the new ranks."""
    cluster.generation += 1
    client, config, rendezvous = cluster.launch_mode.client, cluster.config, cluster.rendezvous
    generation, timeout = cluster.generation, config.start.bootstrap_timeout
    rank0 = next((s for s in specs if s.rank == 0), None) or cluster.ranks[0].spec
    port = rendezvous.port(client, rank0.engine_id, timeout)
    store_path = rendezvous.store_path(cluster.workdir, generation)
    ends_with_kernel = cluster.launch_mode.owns_engines  # new ranks end with this kernel
    asyncs = {}
    for spec in specs:
        probed = probes[spec.engine_id]
        setup = RankSetup(
            spec=spec, master_addr=rendezvous.master_addr, port=port, generation=generation,
            store_path=store_path, threads=threads[spec.rank], cwd=os.getcwd(),
            interface=rendezvous.rank_interface(probed),
            private_dir=cluster.workdir if is_local_engine(probed) else None,
            channel=cluster.channel().setup_for(rendezvous.channel_host(probed), ends_with_kernel),
            config=config)
        asyncs[spec.engine_id] = client[spec.engine_id].apply_async(bootstrap.setup_rank, setup)
    rebuild = (bootstrap.rebuild_process_group, port, generation, rendezvous.master_addr,
               store_path)
    rebuilds = {p.spec.engine_id: client[p.spec.engine_id].apply_async(*rebuild) for p in living}
    started = time.monotonic()
    ready = collect(asyncs, timeout, "setting up ranks and the process group")
    collect(rebuilds, max(1.0, config.start.rebuild_timeout - (time.monotonic() - started)),
            "rebuilding the process group")
    # everything alive now in the new engines (torch, IPython: millions of objects) out of their
    # collector's reach: exit skips a multi-second final gc.collect, training's full ones are cheap
    gather({eid: client[eid].apply_async(gc.freeze) for eid in ready}, timeout)
    ranks = []
    for spec in specs:
        found, done = probes[spec.engine_id], ready[spec.engine_id]
        ranks.append(RankProcess(
            spec, found.pid, found.create_time, done.device, done.threads,
            helper_pids=[tuple(c) for c in found.children], local=is_local_engine(found),
            release_signal=found.release_signal, report_signal=found.report_signal,
            endpoint=done.endpoint, notes=list(done.notes)))
    return ranks
