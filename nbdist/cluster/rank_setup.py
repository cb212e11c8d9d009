"""The notebook's half of the rank bootstrap: how many ranks, probe the engines, give them ranks,
and send each the options `nbdist.worker.bootstrap.setup_rank` needs (env, threads, rendezvous).

The cluster's state (generation, rank table) stays in `ClusterCore`; these only compute and call.
"""

from __future__ import annotations

import gc
import os
import subprocess
import warnings
from collections.abc import Mapping
from typing import Any

from nbdist import torch_support
from nbdist.cluster.cell_channel import NotebookChannel
from nbdist.cluster.gather import gather
from nbdist.cluster.launchers import LauncherPlan
from nbdist.cluster.ranks import (
    EngineInfo,
    RankProcess,
    RankSpec,
    build_rank_map,
    choose_backend,
    default_threads,
    disjoint,
    gpu_shortfall,
)
from nbdist.cluster.rendezvous import Rendezvous, controller_host, is_local_engine
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterStartError, NbdistWarning
from nbdist.worker import bootstrap
from nbdist.worker.setup_message import RankReady, RankSetup


def rank_count(requested_n: int | None, plan: LauncherPlan | None) -> int:
    """-n if given, else the engines an ssh host list names, else one rank per GPU here."""
    if requested_n:
        return requested_n
    ssh_hosts = plan.config.get("SSHEngineSetLauncher", {}).get("engines") if plan else None
    if ssh_hosts:
        return int(sum(ssh_hosts.values()))
    return _default_rank_count()


def _default_rank_count() -> int:
    """The number of GPUs, else 2 CPU ranks (counted without importing CUDA in the notebook)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]) or 2
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        return count or 2
    except (OSError, subprocess.TimeoutExpired):
        return 2


def collect(asyncs: Mapping[int, Any], timeout: float, what: str, label: str = "engine") -> dict[int, Any]:
    """Every result, or one ClusterStartError that names each `label` that failed and why."""
    gathered = gather(asyncs, timeout)
    if gathered.failures:
        lines = [f"{label} {key}: {why}" for key, why in gathered.failures.items()]
        raise ClusterStartError(f"{what} failed:\n" + "\n".join(lines))
    return gathered.results


def probe_and_plan(client: Any, ids: list[int], requested_backend: str, gpus_per_rank: int,
                   host_order: list[str] | None, timeout: float) -> tuple[list[RankSpec], dict[int, Any]]:
    """Probe the engines, then the rank table for them (hosts in `host_order` first: ranks
    survive restarts); returns the table and the probes."""
    peer = controller_host(client)
    probes = collect({eid: client[eid].apply_async(bootstrap.probe, peer) for eid in ids},
                     timeout, "probing engines (torch import)")
    too_old = torch_support.floor_problem({eid: probe["torch"] for eid, probe in probes.items()})
    if too_old:
        raise ClusterStartError(too_old)
    infos = [
        EngineInfo(engine_id=eid, host=probes[eid]["host"], pid=probes[eid]["pid"],
                   gpu_count=probes[eid]["gpu_count"],
                   gpu_uuids=tuple(probes[eid].get("gpu_uuids") or ()),
                   local_id=probes[eid].get("local_id"))
        for eid in ids
    ]
    gpus_per_rank = gpus_or_cpu(infos, requested_backend, gpus_per_rank)
    backend = choose_backend(requested_backend, [i.gpu_count for i in infos], gpus_per_rank)
    return build_rank_map(infos, backend, gpus_per_rank, host_order=host_order), probes


def gpus_or_cpu(infos: list[EngineInfo], requested_backend: str, gpus_per_rank: int) -> int:
    """`gpus_per_rank`, or 0 (CPU ranks, gloo) with a warning when the backend was left to
    nbdist and some host has fewer GPUs than ranks: a tutorial's `-n 2` then runs on a one-GPU
    laptop or Colab. `--backend nccl` keeps it an error (build_rank_map says which host)."""
    shortfall = gpu_shortfall(infos, gpus_per_rank)
    if shortfall is None or requested_backend != "auto":
        return gpus_per_rank
    fits = max(min(i.gpu_count for i in infos) // gpus_per_rank, 1)
    warnings.warn(NbdistWarning(
        f"{shortfall}: every rank runs on the CPU (gloo). For one rank per GPU start -n {fits}; "
        "--backend nccl makes this an error."), stacklevel=2)
    return 0


def setup_ranks(client: Any, specs: list[RankSpec], probes: dict[int, Any], *, port: int,
                generation: int, rendezvous: Rendezvous, config: NbdistConfig, workdir: str,
                requested_threads: int | None, channel: NotebookChannel) -> list[RankProcess]:
    """Set every rank up (environment, device, telemetry, process group generation `generation`)."""
    own_cores = cores_of_their_own(specs, probes)
    asyncs = {}
    for spec in specs:
        probe = probes[spec.engine_id]
        threads = requested_threads or default_threads(probe["cpu_count"] or 1,
                                                       spec.local_world_size, own_cores[spec.host])
        setup = rank_setup_message(spec, probe, port=port, generation=generation,
                                   rendezvous=rendezvous, config=config, workdir=workdir,
                                   threads=threads, channel=channel)
        asyncs[spec.engine_id] = client[spec.engine_id].apply_async(bootstrap.setup_rank, setup)
    results = collect(asyncs, config.start.bootstrap_timeout,
                      "setting up ranks and the process group")
    return rank_processes(specs, probes, results)


def rank_setup_message(spec: RankSpec, probe: dict[str, Any], *, port: int, generation: int,
                       rendezvous: Rendezvous, config: NbdistConfig, workdir: str, threads: int,
                       channel: NotebookChannel) -> RankSetup:
    """What one rank's setup_rank call is told."""
    return RankSetup(
        spec=spec, master_addr=rendezvous.master_addr, port=port, generation=generation,
        store_path=rendezvous.store_path(workdir, generation), threads=threads,
        cwd=os.getcwd(), interface=rendezvous.rank_interface(probe),
        private_dir=workdir if is_local_engine(probe) else None,
        channel=channel.setup_for(rendezvous.channel_host(probe)), config=config)


def cores_of_their_own(specs: list[RankSpec], probes: dict[int, Any]) -> dict[str, bool]:
    """Host -> whether its engines' CPU affinities are disjoint (a launcher bound each task to
    its share already: dividing it again by the ranks on the host would starve them)."""
    by_host: dict[str, list[frozenset[int]]] = {}
    for spec in specs:
        cores = frozenset(probes[spec.engine_id].get("cpu_affinity") or ())
        by_host.setdefault(spec.host, []).append(cores)
    return {host: len(sets) > 1 and all(sets) and disjoint(sets) for host, sets in by_host.items()}


def rank_processes(specs: list[RankSpec], probes: dict[int, Any],
                   results: dict[int, RankReady]) -> list[RankProcess]:
    return [
        RankProcess(
            spec=spec,
            pid=probes[spec.engine_id]["pid"],
            create_time=probes[spec.engine_id]["create_time"],
            device=results[spec.engine_id].device,
            threads=results[spec.engine_id].threads,
            helper_pids=[tuple(c) for c in probes[spec.engine_id]["children"]],
            local=is_local_engine(probes[spec.engine_id]),
            release_signal=probes[spec.engine_id].get("release_signal"),
            report_signal=probes[spec.engine_id].get("report_signal"),
            endpoint=results[spec.engine_id].endpoint,
            notes=list(results[spec.engine_id].notes),
        )
        for spec in specs
    ]


def freeze_collectors(client: Any, ids: list[int], timeout: float) -> None:
    """Move everything alive now (torch, IPython: millions of objects) out of each engine's
    collector's reach: the engine's exit then skips a multi-second final gc.collect (%dist_stop),
    and full collections during training stop rescanning torch's own objects."""
    gather({eid: client[eid].apply_async(gc.freeze) for eid in ids}, timeout)
