"""What survives a re-formed process group, said in the action line that reports the re-form:
each rank's tensors, models and optimizers stay; DDP models nbdist.prepare made are wrapped
again on the new group; every other object made on the old group is named."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore

KEPT = ("every rank keeps its variables, tensors, models and optimizer state, and dist works on "
        "the new group")


def after_reform(cluster: ClusterCore) -> str:
    """Rewrap what can be on every rank at once (only when every living rank names the same
    models: DDP's construction is a collective) and say what survives, within the rebuild's
    timeout per step."""
    timeout = cluster.config.start.rebuild_timeout
    alive = [p.spec.rank for p in cluster.ranks if p.state == "alive"]
    scans = cluster.call("survivors.scan", ranks=alive, timeout=timeout).results
    if not scans:
        return KEPT
    candidates = {tuple(scan["rewrap"]) for scan in scans.values()}
    wanted = list(next(iter(candidates))) if len(candidates) == 1 else []
    rewrapped: list[str] = []
    if wanted and sorted(scans) == alive:
        done = cluster.call("survivors.rewrap", wanted, ranks=alive, timeout=timeout)
        rewrapped = wanted if not done.failures else []
    stale = sorted({item for scan in scans.values() for item in scan["stale"]}
                   | {f"{name} (DDP model)" for scan in scans.values() for name in scan["rewrap"]
                      if name not in rewrapped})
    parts = [KEPT]
    if rewrapped:
        parts.append(f"DDP model(s) {', '.join(rewrapped)} wrapped again on the new group (rank "
                     "0's parameters broadcast to every rank, as DDP does when it is made)")
    if stale:
        parts.append(f"made on the old group, these fail if used: {', '.join(stale)}; make them "
                     "again (nbdist.prepare, dist.new_group, init_device_mesh)")
    return "; ".join(parts)
