"""Calls the notebook makes on a set of ranks between cells: push and pull values (over the cell
channel, encrypted wherever cells are), tear down or rebuild the process group (ipyparallel's
apply). Each waits under one deadline.

`views` are ipyparallel views by rank (or by engine id), as `ClusterCore` hands them over.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from nbdist.cluster.arguments import check_pushed_values, check_variable_name
from nbdist.cluster.cell_channel import ChannelEndpoint, NotebookChannel
from nbdist.cluster.gather import gather
from nbdist.cluster.rank_setup import collect
from nbdist.cluster.ranks import RankProcess
from nbdist.errors import ClusterStartError, Interrupted, NbdistError
from nbdist.worker import bootstrap


def push(channel: NotebookChannel, ranks: Sequence[RankProcess], values: dict[str, Any],
         timeout: float) -> None:
    """Bind names on the ranks; tensors go to CPU for the trip and to each rank's device."""
    values = check_pushed_values(values)
    try:
        gathered = channel.call(_endpoints(ranks), "push", (values,), timeout)
    except KeyboardInterrupt:
        raise Interrupted(f"the push of {', '.join(values)} was interrupted: some ranks may have "
                          "the new values and others not; push again before using them") from None
    if gathered.failures:
        lines = [f"rank {rank}: {why}" for rank, why in sorted(gathered.failures.items())]
        raise ClusterStartError("push failed:\n" + "\n".join(lines))


def pull(channel: NotebookChannel, ranks: Sequence[RankProcess], name: str,
         timeout: float) -> dict[int, Any]:
    """One name from each rank: {rank: value} (tensors arrive on CPU)."""
    check_variable_name(name, "pull")
    try:
        gathered = channel.call(_endpoints(ranks), "pull", ([name], notebook_classes()), timeout)
    except KeyboardInterrupt:
        raise Interrupted(f"the pull of {name!r} was interrupted: nothing was fetched; the ranks "
                          "still hold it") from None
    if gathered.failures:
        first = min(gathered.failures)
        raise NbdistError(f"pull {name!r} from rank {first}: {gathered.failures[first]}")
    # rank order, whatever order the answers came in (the dict is what %dist_pull shows)
    return {r: gathered.results[r][name] for r in sorted(gathered.results)}


def notebook_classes() -> list[str]:
    """The classes this process's `__main__` defines (a notebook's: its cells' namespace), by
    which a pulled value's cell-defined classes are rebuilt here."""
    main = sys.modules.get("__main__")
    if main is None:
        return []
    return sorted(name for name, value in vars(main).items() if isinstance(value, type))


def _endpoints(ranks: Sequence[RankProcess]) -> dict[int, ChannelEndpoint]:
    missing = [p.spec.rank for p in ranks if p.endpoint is None]
    if missing:
        raise NbdistError(f"rank(s) {missing} have no cell channel (their setup did not finish)")
    return {p.spec.rank: p.endpoint for p in ranks if p.endpoint is not None}


def teardown_process_groups(views: Mapping[int, Any], timeout: float) -> list[int]:
    """Destroy the group on these (idle) ranks; returns the ranks where that finished in time."""
    asyncs = {r: view.apply_async(bootstrap.teardown_process_group) for r, view in views.items()}
    return list(gather(asyncs, timeout).results)


def rebuild_process_groups(engines: Mapping[int, Any], *, port: int, generation: int,
                           master_addr: str, store_path: str | None, timeout: float) -> None:
    """Every engine joins the new generation on a fresh port (or store file)."""
    asyncs = {eid: view.apply_async(bootstrap.rebuild_process_group, port, generation, master_addr,
                                    store_path)
              for eid, view in engines.items()}
    collect(asyncs, timeout, "rebuilding the process group")
