"""The notebook half of `%dist_env`: asks every rank's `env.collect` and builds the table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from nbdist.features.env.env_table import EnvTable


def cluster_env(cluster: Any, ranks: Iterable[int] | None = None) -> EnvTable:
    """Each alive rank's environment (`ranks`: all by default); a rank that cannot answer is
    named in the table's notes."""
    targets = cluster.targets(ranks)
    gathered = cluster.call("env.collect", ranks=targets,
                            timeout=cluster.config.start.bootstrap_timeout)
    return EnvTable([gathered.results[r] for r in sorted(gathered.results)],
                    dict(gathered.failures))


def register_magic(ipython: Any, current: Callable[[], Any]) -> None:
    """`%dist_env [--ranks R]` on the cluster `current()` returns."""
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

    from nbdist.cluster.ranks import parse_ranks
    from nbdist.errors import NbdistError

    @magic_arguments()
    @argument("--ranks", default=None, metavar="R", help="e.g. 0,2-3 (default: every rank)")
    def dist_env(line: str) -> EnvTable:
        """%dist_env: each rank's host, Python, torch, CUDA, NCCL, devices and the environment
        variables that differ between ranks, differing cells marked."""
        args = parse_argstring(dist_env, line)
        cluster = current()
        if cluster is None or not cluster.running:
            raise UsageError("no cluster is running: run %dist_start first (e.g. %dist_start -n 2)")
        try:
            ranks = None if args.ranks is None else parse_ranks(args.ranks, cluster.world_size)
            return cluster_env(cluster, ranks)
        except NbdistError as exc:
            raise UsageError(f"%dist_env: {exc}") from None

    ipython.register_magic_function(dist_env, "line", "dist_env")
