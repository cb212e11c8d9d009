"""Replace only the dead ranks: new engines for them (forked warm when the cluster has a fork
server), then one new process-group generation that the new ranks join as they set up and the
living ranks join by rebuilding, so the living ranks keep every variable they hold.

`ClusterCore.restart` replaces every rank; this is the quicker way back after one rank was
killed (out of memory, SIGKILL) while the others hold a trained model.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from nbdist.cluster import rank_setup
from nbdist.cluster.rank_setup import collect, rank_processes, rank_setup_message
from nbdist.cluster.ranks import RankProcess, RankSpec
from nbdist.errors import NbdistError
from nbdist.worker import bootstrap

if TYPE_CHECKING:  # pragma: no cover
    from nbdist.cluster.core import ClusterCore, Progress


def replace_dead_ranks(cluster: ClusterCore, say: Progress) -> list[int]:
    """New engines for the dead ranks, same rank numbers and devices, and a new process-group
    generation on every rank; returns the ranks replaced ([] when none was dead)."""
    cluster.poll_dead()
    dead = [p for p in cluster.ranks if p.state == "dead"]
    if not dead:
        return []
    mode, client, config = cluster.launch_mode, cluster.client, cluster.config
    mode.check_replaceable(cluster.controller_lost)
    if len(dead) == len(cluster.ranks):
        raise NbdistError("every rank is dead: nothing is left to keep; run %dist_restart "
                          "(Cluster.restart())")
    alive = [p for p in cluster.ranks if p.state == "alive"]
    say(f"replacing rank(s) {', '.join(str(p.spec.rank) for p in dead)}; "
        f"rank(s) {', '.join(str(p.spec.rank) for p in alive) or 'none'} keep their state")
    # the living ranks' group waits for a dead peer: end it so they can join the new one
    cluster.teardown_process_group([p.spec.rank for p in alive],
                                   timeout=config.start.rebuild_timeout)
    new_ids = mode.start_replacements(len(dead), cluster.ranks, say)
    probes = collect({eid: client[eid].apply_async(bootstrap.probe, None) for eid in new_ids},
                     config.start.bootstrap_timeout, "probing the new engines")
    specs = [dataclasses.replace(p.spec, engine_id=eid)
             for p, eid in zip(dead, new_ids, strict=True)]
    cluster.generation += 1
    rank0 = next((s.engine_id for s in specs if s.rank == 0), cluster.ranks[0].spec.engine_id)
    port = cluster.rendezvous.port(client, rank0, config.start.bootstrap_timeout)
    results = _join_together(cluster, specs, probes, alive, port)
    for proc in rank_processes(specs, probes, results):
        cluster.ranks[proc.spec.rank] = proc
        cluster.telemetry.rank_state(proc.spec.rank, "restarted", f"pid {proc.pid}")
    mode.write_pidfile(cluster.ranks)
    rank_setup.freeze_collectors(client, new_ids, config.start.bootstrap_timeout)
    return [s.rank for s in specs]


def _join_together(cluster: ClusterCore, specs: list[RankSpec], probes: dict[int, Any],
                   alive: list[RankProcess], port: int) -> dict[int, Any]:
    """The new ranks set up and the living ones rebuild at once: both sides of one rendezvous."""
    client, config, generation = cluster.client, cluster.config, cluster.generation
    store_path = cluster.rendezvous.store_path(cluster.workdir, generation)
    asyncs = {}
    for spec in specs:
        setup = rank_setup_message(
            spec, probes[spec.engine_id], port=port, generation=generation,
            rendezvous=cluster.rendezvous, config=config, workdir=cluster.workdir,
            # the rank it replaces had its host's share worked out already
            threads=cluster.requested_threads or cluster.ranks[spec.rank].threads,
            channel=cluster.channel())
        asyncs[spec.engine_id] = client[spec.engine_id].apply_async(bootstrap.setup_rank, setup)
    rebuilds = {p.spec.engine_id: client[p.spec.engine_id].apply_async(
        bootstrap.rebuild_process_group, port, generation, cluster.master_addr, store_path)
        for p in alive}
    started = time.monotonic()
    results = collect(asyncs, config.start.bootstrap_timeout, "setting up the new ranks")
    collect(rebuilds, max(1.0, config.start.rebuild_timeout - (time.monotonic() - started)),
            "rebuilding the process group on the living ranks")
    return results
