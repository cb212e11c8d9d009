"""nbdistributed (PyPI): ``%load_ext nbdistributed``, ``%dist_init -n N``, ``%%distributed`` cells.

Runs with the peers' ``.bench-venv`` (its workers start ``python`` from PATH, which the
orchestrator points at that venv). It has no interrupt, and docs/BENCHMARKS.md says not to call its
shutdown helpers: its workers are killed by PID (B8, B9: not measured).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from tests.benchmarks import common


def main() -> None:
    args = common.parse_args()
    want = common.figures(args)
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    out: dict[str, Any] = {"tool": "nbdistributed", "ranks": args.ranks,
                           "versions": common.versions("nbdistributed", "torch", "pyzmq")}
    with common.quiet():
        shell.run_line_magic("load_ext", "nbdistributed")
    cell = shell.run_cell_magic
    started = time.perf_counter()
    with common.quiet() as text:
        shell.run_line_magic("dist_init", f"-n {args.ranks} -a 127.0.0.1")
        # A cell sent before every worker has connected is dropped by its ZMQ ROUTER (and then
        # times out after 30 s), so poll with a no-op until all answer, as a user would retry.
        comm = shell.magics_manager.registry["DistributedMagic"]._comm_manager
        deadline = time.monotonic() + 120
        while True:
            try:
                comm.send_to_all("execute", common.NOOP, timeout=0.25)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        cell("distributed", "", common.ALL_REDUCE)
    out["B1"] = {"seconds": time.perf_counter() - started}
    if "Error" in text.getvalue() or "Failed" in text.getvalue():
        out["B1"]["output"] = text.getvalue()[-500:]
    pids = common.descendants()
    out["pids"] = [p for p, _ in pids]
    if "B2" in want:
        with common.quiet():
            out["B2"] = common.summary(common.series(lambda: cell("distributed", "", common.NOOP), args.reps))
    if "B3" in want:
        with common.quiet():
            out["B3"] = common.summary(common.series(lambda: cell("distributed", "", common.ALL_REDUCE), args.reps))
    out["B8"] = {"seconds": None, "note": "no interrupt in nbdistributed"}
    if "B7" in want:
        buf: dict[str, Any] = {}

        def failing_cell() -> None:
            with common.quiet() as captured:
                cell("distributed", "", common.RAISE_BEFORE_BARRIER)
            buf["text"] = captured.getvalue()

        started = time.perf_counter()
        worker = threading.Thread(target=failing_cell, daemon=True)
        worker.start()
        worker.join(args.cap)
        ended = None if worker.is_alive() else time.perf_counter()
        out["B7"] = {"seconds": None if ended is None else ended - started, "cap": args.cap}
        if ended is not None:
            out["B7"]["root_cause_shown"] = "rank 1 fails before the barrier" in buf.get("text", "")
            out["B7"]["timed_out_internally"] = "Timeout" in buf.get("text", "")
    out["B9"] = {"seconds": None, "left": common.alive(pids),
                 "note": "not measured: docs/BENCHMARKS.md says do not call its shutdown helpers"}
    common.emit(out)
    os._exit(0)  # its workers are the orchestrator's to kill, by PID


if __name__ == "__main__":
    main()
