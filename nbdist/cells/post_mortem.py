"""`%dist_debug`: IPython's `%debug`, but on a rank. The notebook asks for each command
(`ask(prompt)`, `input` in a kernel) and shows what the rank's post-mortem pdb printed (`show`);
the debugger itself runs on the rank (its `post_mortem.*` commands), so tensors stay there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbdist.cells.result import CellResult
from nbdist.errors import NbdistError

Ask = Callable[[str], str]
Show = Callable[[str], None]


def pick_rank(result: CellResult | None, rank: int | None = None) -> int:
    """The rank to debug: the one asked for, else the first root cause of the last failed cell."""
    if rank is not None:
        return rank
    if result is None or not result.errors:
        raise NbdistError("no failed %%distributed cell to debug (give a rank: %dist_debug 1)")
    raised = [e.rank for e in result.root_causes() if e.kind == "root"]
    if not raised:
        raise NbdistError("the last cell's failure raised on no rank (interrupted, dead or "
                          "released from a collective); give a rank: %dist_debug RANK")
    return raised[0]


def debug_rank(cluster: Any, rank: int, ask: Ask, show: Show) -> int:
    """Run a post-mortem session on `rank` until a quit command (q, quit, c, exit) or the end of
    input; returns how many commands ran there. The rank, its namespace and the process group
    are left as they were."""
    timeout = cluster.config.start.bootstrap_timeout
    opened = _call(cluster, rank, timeout, "post_mortem.start")
    if not opened["ok"]:
        show(f"nbdist: rank {rank}: {opened['text']}")
        return 0
    show(f"nbdist: post-mortem on rank {rank} ({opened['error']}); q quits\n"
         f"{opened['text'].rstrip()}")
    prompt = f"(rank {rank} pdb) "
    count = 0
    try:
        while True:
            try:
                line = ask(prompt)
            except (EOFError, KeyboardInterrupt):
                line = "q"
            reply = _call(cluster, rank, timeout, "post_mortem.command", line)
            if reply["text"]:
                show(reply["text"].rstrip("\n"))
            if reply["done"]:
                return count
            count += 1
    finally:
        # a failed ask (or an error here) must not leave the rank holding the session's frames
        _call(cluster, rank, timeout, "post_mortem.stop")


def _call(cluster: Any, rank: int, timeout: float, command: str, *args: Any) -> Any:
    gathered = cluster.call(command, *args, ranks=[rank], timeout=timeout)
    if gathered.failures:
        raise NbdistError(f"%dist_debug: rank {rank}: {gathered.failures[rank]}")
    return gathered.results[rank]
