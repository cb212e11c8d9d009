"""Raw ipyparallel, by hand as docs/BENCHMARKS.md describes: B1–B3 (view.execute and %%px), B7–B9.

``ipp.Cluster(n).start_and_connect_sync()``, then RANK/WORLD_SIZE/MASTER_* per engine and
``init_process_group("gloo")`` in a cell. Prints one ``NBDIST_BENCH`` line.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import tempfile
import time
from typing import Any

from tests.benchmarks import common

SETUP = (
    "import os, sys\n"
    "os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),\n"
    "                  MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))\n"
    "sys.path.insert(0, root)\n"
    "import torch, torch.distributed as dist\n"
    "torch.set_num_threads(threads)\n"
    "dist.init_process_group('gloo')\n"
)


def main() -> None:
    args = common.parse_args()
    want = common.figures(args)
    import ipyparallel as ipp
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    out: dict[str, Any] = {"tool": "ipyparallel", "ranks": args.ranks,
                           "versions": common.versions("ipyparallel", "torch", "ipykernel")}
    workdir = tempfile.mkdtemp(prefix="nbdist-bench-ipp-")
    pids: list[tuple[int, float]] = []
    cluster = None
    try:
        started = time.perf_counter()
        with common.quiet():
            cluster = ipp.Cluster(n=args.ranks, profile_dir=os.path.join(workdir, "profile"),
                                  controller_ip="127.0.0.1", log_level=40)
            rc = cluster.start_and_connect_sync()
            rc.wait_for_engines(args.ranks, timeout=120)
            ids = sorted(rc.ids)[: args.ranks]
            port = _free_port()
            for rank, eid in enumerate(ids):
                rc[eid].push({"rank": rank, "world_size": args.ranks, "port": port,
                              "root": common.ROOT, "threads": args.threads}, block=False)
            view = rc[ids]
            view.execute(SETUP, block=True)
            view.execute(common.ALL_REDUCE, block=True)
        out["B1"] = {"seconds": time.perf_counter() - started}
        pids = common.descendants()
        out["pids"] = [p for p, _ in pids]
        if "B2" in want:
            out["B2"] = common.summary(common.series(lambda: view.execute(common.NOOP, block=True), args.reps))
            rc.activate()
            with common.quiet():
                out["B2_px"] = common.summary(
                    common.series(lambda: shell.run_cell_magic("px", "", common.NOOP), args.reps))
        if "B3" in want:
            out["B3"] = common.summary(common.series(lambda: view.execute(common.ALL_REDUCE, block=True), args.reps))
        usable = True
        if "B8" in want:
            ar = view.execute("from tests.benchmarks.train_loop import train\ntrain(100000)", block=False)
            time.sleep(3.0)
            sent = time.perf_counter()
            cluster.signal_engines_sync(signal.SIGINT)
            ended = _wait(ar, args.cap)
            out["B8"] = {"seconds": None if ended is None else ended - sent, "cap": args.cap}
            if ended is None:
                usable = False
            else:
                ar2 = view.execute(common.ALL_REDUCE, block=False)
                ok = _wait(ar2, args.cap)
                out["B8"]["next_cell_ok"] = ok is not None and not _failed(ar2)
                usable = ok is not None and not _failed(ar2)
        if "B7" in want and usable:
            started = time.perf_counter()
            ar = view.execute(common.RAISE_BEFORE_BARRIER, block=False)
            ended = _wait(ar, args.cap)
            out["B7"] = {"seconds": None if ended is None else ended - started, "cap": args.cap}
        started = time.perf_counter()
        with common.quiet():
            cluster.stop_cluster_sync()
        out["B9"] = {"seconds": time.perf_counter() - started, "left": common.alive(pids)}
        cluster = None
    finally:
        if cluster is not None:  # a peer wedged by B7/B8: the orchestrator kills its PIDs
            out.setdefault("B9", {"seconds": None, "left": common.alive(pids), "note": "not stopped (wedged)"})
        shutil.rmtree(workdir, ignore_errors=True)
    common.emit(out)
    if cluster is not None:
        os._exit(0)  # do not let ipyparallel's atexit wait on wedged engines


def _wait(ar: Any, cap: float) -> float | None:
    try:
        ar.wait(timeout=cap)
    except Exception:
        pass
    return time.perf_counter() if ar.ready() else None


def _failed(ar: Any) -> bool:
    try:
        ar.get(timeout=0)
        return False
    except Exception:
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    asyncio.set_event_loop(asyncio.new_event_loop())
    main()
