"""Using the engines of an ipyparallel cluster nbdist did not start (`ipcluster start`, a Slurm
job): finding it, waiting for its engines, and leaving them as they were found.

nbdist never starts or kills a process of such a cluster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from nbdist.cluster.gather import gather
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterStartError
from nbdist.worker import bootstrap


def attach_target(profile: str | None, cluster_id: str, profile_dir: str | None,
                  url_file: str | None) -> dict[str, Any]:
    """ipyparallel.Client's arguments for the cluster `Cluster.attach` was pointed at."""
    if url_file:
        return {"url_file": url_file}
    target: dict[str, Any] = {"cluster_id": cluster_id}
    if profile_dir:
        target["profile_dir"] = profile_dir
    else:
        target["profile"] = profile or "default"
    return target


def attach_engines(target: dict[str, Any], n: int | None, config: NbdistConfig,
                   say: Callable[[str], None]) -> tuple[Any, list[int]]:
    """A client of the cluster `target` names, and the ids of the engines to use (n, or all)."""
    client = connect(target)
    started = engines_started(target) if n is None else None
    if started is None:
        ids = wait_for_registered(client, n, config)
    else:  # all that were started, or as many as registered in time
        try:
            ids = wait_for_registered(client, started, config)
        except ClusterStartError:
            ids = wait_for_registered(client, None, config)
            say(f"only {len(ids)} of the {started} engine(s) the cluster file lists registered "
                f"within {config.start.engine_start_timeout:.0f} s; using those")
    say(f"attached to {len(ids)} engine(s) of an existing cluster ({target})")
    return client, ids


def engines_started(target: dict[str, Any]) -> int | None:
    """How many engines the cluster's file says were started (`ipcluster start` writes one), so
    attaching right after a start waits for all of them; None without a readable file."""
    if "url_file" in target:
        return None
    import ipyparallel as ipp

    try:
        path = ipp.Cluster(shutdown_atexit=False, **target).cluster_file
        with open(path) as file:
            sets = json.load(file)["engines"]["sets"].values()
        return sum(int(engine_set["n"]) for engine_set in sets) or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def connect(target: dict[str, Any]) -> Any:
    import ipyparallel as ipp

    options = dict(target)
    # positionally: ipyparallel 9 silently ignores a url_file= keyword (and then connects to the
    # default profile's cluster instead of the one named)
    connection_file = options.pop("url_file", None)
    try:
        return ipp.Client(connection_file, **options)
    except (OSError, ValueError) as exc:
        raise ClusterStartError(
            f"no running ipyparallel cluster found for {target}: {exc}. "
            "Start one first (ipcluster start --profile P), or check profile/cluster_id."
        ) from None


def wait_for_registered(client: Any, n: int | None, config: NbdistConfig,
                        exclude: Iterable[int] = ()) -> list[int]:
    """Engines of an attached cluster: n of them (all there are when n is None)."""
    skip = set(exclude)
    deadline = time.monotonic() + config.start.engine_start_timeout
    while True:
        ids = sorted(set(client.ids) - skip)
        if ids and (n is None or len(ids) >= n):
            return ids if n is None else ids[:n]
        if time.monotonic() > deadline:
            raise ClusterStartError(
                f"{len(ids)} engine(s) registered with the attached cluster within "
                f"{config.start.engine_start_timeout:.0f} s; {n or 'at least one'} needed"
            )
        time.sleep(config.internal.startup_poll_interval)


def leave_engines(client: Any, engine_ids: list[int], timeout: float) -> None:
    """Stop telemetry and leave the process group on each engine still registered; the engines
    stay (best effort)."""
    registered = [eid for eid in engine_ids if eid in client.ids]
    gather({eid: client[eid].apply_async(bootstrap.shutdown_rank) for eid in registered}, timeout)
