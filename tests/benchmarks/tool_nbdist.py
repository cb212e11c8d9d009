"""nbdist through its magics in an IPython shell (the user's path): B1–B4, B6–B9.

Run by ``tests.benchmarks.run`` with the project's ``.venv``; prints one ``NBDIST_BENCH`` line.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tests.benchmarks import common


def main() -> None:
    args = common.parse_args()
    want = common.figures(args)
    from IPython.core.interactiveshell import InteractiveShell

    from nbdist.errors import DistributedCellError
    from nbdist.notebook import magics as nbmagics

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    out: dict[str, Any] = {"tool": "nbdist", "ranks": args.ranks,
                           "versions": common.versions("nbdist", "ipyparallel", "torch", "ipykernel")}
    cell = shell.run_cell_magic

    started = time.perf_counter()
    with common.quiet():
        shell.run_line_magic("dist_start", f"-n {args.ranks} --threads {args.threads}")
        cell("distributed", "", common.ALL_REDUCE)
    b1 = time.perf_counter() - started
    cluster = nbmagics.current_cluster()
    assert cluster is not None
    pids = [(pid, _ct(pid)) for pid in cluster.all_pids()]
    out["pids"] = [p for p, _ in pids]
    out["B1"] = {"seconds": b1, "start_seconds": cluster.start_seconds}

    if "B2" in want:
        with common.quiet():
            out["B2"] = common.summary(common.series(lambda: cell("distributed", "", common.NOOP), args.reps))
            out["B2_api"] = common.summary(common.series(lambda: cluster.run(common.NOOP), args.reps))
    if "B3" in want:
        with common.quiet():
            out["B3"] = common.summary(common.series(lambda: cell("distributed", "", common.ALL_REDUCE), args.reps))
    if "B10" in want:  # %dist_restart -> first collective (issue 14: warm restart)
        out["B10"] = common.summary([_timed_restart(shell, "") for _ in range(args.restarts)])
        pids += [(pid, _ct(pid)) for pid in cluster.all_pids()]
    if "B11" in want:  # rank 1 SIGKILLed -> %dist_restart --dead -> first collective
        samples = []
        for _ in range(args.restarts):
            _kill_and_wait(cluster, 1)
            samples.append(_timed_restart(shell, "--dead"))
        out["B11"] = common.summary(samples)
        pids += [(pid, _ct(pid)) for pid in cluster.all_pids()]
    if "B4" in want or "B6" in want:
        dashboard = cluster.dashboard()  # dashboard on: the widget model ingests every payload
        code = (
            "import nbdist\nfrom tests.benchmarks.train_loop import train\n"
            f"_bench_out = train({args.train_steps}, log=nbdist.log)\n"
            "_bench_out"
        )
        with common.quiet():
            cell("distributed", "", code)
        result = shell.user_ns["_dist_result"]
        values = cluster.pull("_bench_out")
        out["B4"] = {"steps_per_s": values[0]["steps_per_s"], "threads": values[0]["threads"],
                     "steps": values[0]["steps"], "records_logged": len(dashboard.log_latency)}
        latency = list(dashboard.log_latency)
        if latency:
            out["B6"] = {"median": statistics.median(latency), "min": min(latency), "max": max(latency),
                         "n": len(latency), "p90": sorted(latency)[int(0.9 * (len(latency) - 1))],
                         "telemetry_interval": cluster.config.telemetry_interval}
        del result
    if "B8" in want:
        code = ("from tests.benchmarks.train_loop import train\n"
                "import nbdist\ntrain(100000, log=nbdist.log)")
        when = common.interrupt_main_after(3.0)
        with common.quiet():
            try:
                cell("distributed", "", code)
            except (DistributedCellError, KeyboardInterrupt, Exception):
                pass
        ended = time.perf_counter()
        last = shell.user_ns.get("_dist_result")
        dead = [p.spec.rank for p in cluster.ranks if p.state == "dead"]
        out["B8"] = {"seconds": ended - when["t"], "dead_ranks": dead,
                     "actions": list(last.actions) if last is not None else []}
        idle_started = time.perf_counter()
        try:
            with common.quiet():
                cell("distributed", "", common.ALL_REDUCE)  # every rank idle, the group usable
            out["B8"]["next_cell_ok_seconds"] = time.perf_counter() - idle_started
        except Exception as exc:
            out["B8"]["next_cell_error"] = str(exc)[:300]
            with common.quiet():
                shell.run_line_magic("dist_restart", "")
            pids += [(pid, _ct(pid)) for pid in cluster.all_pids()]
    if "B7" in want:
        started = time.perf_counter()
        with common.quiet():
            try:
                cell("distributed", "", common.RAISE_BEFORE_BARRIER)
                root = False
            except DistributedCellError as exc:
                root = "rank 1 raised RuntimeError" in str(exc)
        b7 = time.perf_counter() - started
        last = shell.user_ns.get("_dist_result")
        out["B7"] = {"seconds": b7, "root_cause_shown": root,
                     "dead_ranks": [p.spec.rank for p in cluster.ranks if p.state == "dead"],
                     "actions": list(last.actions) if last is not None else []}
        try:
            with common.quiet():
                cell("distributed", "", common.ALL_REDUCE)
        except Exception as exc:
            out["B7"]["next_cell_error"] = str(exc)[:300]
    started = time.perf_counter()
    with common.quiet():
        shell.run_line_magic("dist_stop", "")
    out["B9"] = {"seconds": time.perf_counter() - started, "left": common.alive(pids)}
    common.emit(out)


def _timed_restart(shell: Any, line: str) -> float:
    started = time.perf_counter()
    with common.quiet():
        shell.run_line_magic("dist_restart", line)
        shell.run_cell_magic("distributed", "", common.ALL_REDUCE)
    return time.perf_counter() - started


def _kill_and_wait(cluster: Any, rank: int, within: float = 10.0) -> None:
    """SIGKILL one rank and wait until nbdist knows it is dead (what a user sees first)."""
    import os
    import signal

    os.kill(cluster.ranks[rank].pid, signal.SIGKILL)
    deadline = time.monotonic() + within
    while cluster.ranks[rank].state != "dead":
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank} not seen dead within {within} s")
        cluster.poll_dead()
        time.sleep(0.01)


def _ct(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return 0.0


if __name__ == "__main__":
    main()
