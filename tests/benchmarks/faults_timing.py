"""Seconds to get the notebook back in fault rows 1, 2, 4, 5 and 6 (docs/FAULTS.md): nbdist beside raw
ipyparallel on the same machine, in one run; writes tests/benchmarks/FAULTS_RESULTS.md.

    .venv/bin/python -m tests.benchmarks.faults_timing             # 5 repetitions per row (~6 min)
    .venv/bin/python -m tests.benchmarks.faults_timing --reps 2    # shorter

What is timed (4 gloo ranks, 1 thread each):

- row 1: rank 1 raises while the others wait in all_reduce: cell sent -> cell returned.
- row 2: rank 2 is killed (SIGKILL, by PID) while the others wait in all_reduce: kill -> returned.
- row 4: every rank spins in pure Python; at a 2 s deadline the tool is asked to stop (nbdist:
  ``timeout=2``; ipyparallel: ``wait(2)`` then SIGINT to the engines): deadline -> returned.
- row 5: the stop button during a Python training loop: stop -> returned.
- row 6: the stop button while ranks 0-2 wait in a barrier for rank 3 (sleeping): stop -> returned.

Raw ipyparallel gets the same cells through ``view.execute`` and, for the stop button, what
``%%px`` does on KeyboardInterrupt (SIGINT to the engines). Where it is still blocked after
``--cap`` seconds the row says so and that cluster is abandoned and stopped by PID; each row runs
in its own process so a wedged peer never spoils the next row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tests.benchmarks import common
from tests.benchmarks.run import MARKER, VENV_PY, _env, reap

ROWS = {
    "1": "rank 1 raises while others wait in all_reduce (cell sent -> returned)",
    "2": "rank 2 SIGKILLed during all_reduce (kill -> returned)",
    "4": "pure-Python hang, 2 s deadline (deadline -> returned)",
    "5": "stop button in a Python training loop (stop -> returned)",
    "6": "stop button while ranks wait in a barrier (stop -> returned)",
}
ROW1 = "x = torch.ones(1)\nif rank == 1:\n    raise ValueError('rank 1 broke')\ndist.all_reduce(x)\n"
ROW2 = "import time\nx = torch.ones(1)\nif rank == 2:\n    time.sleep(600)\ndist.all_reduce(x)\n"
ROW4 = "while True:\n    pass\n"
ROW5_SETUP = ("model = torch.nn.Linear(32, 32)\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n")
ROW5 = ("while True:\n"
        "    loss = model(torch.randn(16, 32)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n")
ROW6 = "import time\nif rank == 3:\n    time.sleep(600)\ndist.barrier()\n"
DEADLINE = 2.0
STOP_AFTER = 1.5


# ---------------------------------------------------------------- drivers (one process per row)
def drive_nbdist(row: str, reps: int, ranks: int) -> dict[str, Any]:
    from nbdist import Cluster

    out: dict[str, Any] = {"seconds": [], "next_cell_ok": [], "killed_by_ladder": []}
    with common.quiet(), Cluster(n=ranks, threads=1) as cluster:
        if row == "5":
            cluster.run(ROW5_SETUP).raise_for_errors()
        for _ in range(reps):
            if any(p.state != "alive" for p in cluster.ranks):
                cluster.restart()
                if row == "5":
                    cluster.run(ROW5_SETUP).raise_for_errors()
            if row == "1":
                started = time.perf_counter()
                cluster.run(ROW1, timeout=60)
                seconds = time.perf_counter() - started
            elif row == "2":
                pid = cluster.ranks[2].pid
                import threading

                when: dict[str, float] = {}

                def kill(pid: int = pid, when: dict[str, float] = when) -> None:
                    when["t"] = time.perf_counter()
                    os.kill(pid, signal.SIGKILL)

                threading.Timer(1.0, kill).start()
                cluster.run(ROW2, timeout=60)
                seconds = time.perf_counter() - when["t"]
            elif row == "4":
                started = time.perf_counter()
                cluster.run(ROW4, timeout=DEADLINE)
                seconds = time.perf_counter() - started - DEADLINE
            else:
                when = common.interrupt_main_after(STOP_AFTER)
                try:
                    cluster.run(ROW5 if row == "5" else ROW6, timeout=120)
                except KeyboardInterrupt:  # a stop that lands after the cell returned
                    pass
                seconds = time.perf_counter() - when["t"]
            out["seconds"].append(seconds)
            killed = [p.spec.rank for p in cluster.ranks if p.state == "dead" and row != "2"]
            out["killed_by_ladder"].append(killed)
            if any(p.state != "alive" for p in cluster.ranks):
                cluster.restart()
                if row == "5":
                    cluster.run(ROW5_SETUP).raise_for_errors()
            ok = not cluster.run(common.ALL_REDUCE, timeout=30).errors
            out["next_cell_ok"].append(ok)
    return out


def drive_ipyparallel(row: str, reps: int, ranks: int, cap: float) -> dict[str, Any]:
    import tempfile

    import ipyparallel as ipp

    from tests.benchmarks.tool_ipp import SETUP, _free_port

    out: dict[str, Any] = {"seconds": [], "capped": False}
    workdir = tempfile.mkdtemp(prefix="nbdist-bench-faults-")
    with common.quiet():
        cluster = ipp.Cluster(n=ranks, profile_dir=os.path.join(workdir, "profile"),
                              controller_ip="127.0.0.1", log_level=40)
        rc = cluster.start_and_connect_sync()
        rc.wait_for_engines(ranks, timeout=120)
        ids = sorted(rc.ids)[:ranks]
        port = _free_port()
        for rank, eid in enumerate(ids):
            rc[eid].push({"rank": rank, "world_size": ranks, "port": port, "root": common.ROOT,
                          "threads": 1}, block=True)
        view = rc[ids]
        view.execute(SETUP, block=True)
        if row == "5":
            view.execute(ROW5_SETUP, block=True)
        pids = {r: rc[eid].apply_sync(os.getpid) for r, eid in enumerate(ids)}
    for _ in range(reps):
        if row == "1":
            started = time.perf_counter()
            ar = view.execute(ROW1, block=False)
        elif row == "2":
            ar = view.execute(ROW2, block=False)
            time.sleep(1.0)
            started = time.perf_counter()
            os.kill(pids[2], signal.SIGKILL)
        elif row == "4":
            ar = view.execute(ROW4, block=False)
            _wait(ar, DEADLINE)
            started = time.perf_counter()
            cluster.signal_engines_sync(signal.SIGINT)
        else:
            ar = view.execute(ROW5 if row == "5" else ROW6, block=False)
            time.sleep(STOP_AFTER)
            started = time.perf_counter()
            cluster.signal_engines_sync(signal.SIGINT)
        if not _wait(ar, cap):
            out["capped"] = True
            break
        out["seconds"].append(time.perf_counter() - started)
    common.emit(out)  # before stopping: a wedged cluster may not stop cleanly
    os._exit(0)


def _wait(ar: Any, seconds: float) -> bool:
    try:
        ar.wait(timeout=seconds)
    except Exception:
        pass
    return bool(ar.ready())


# ---------------------------------------------------------------- orchestration and the table
def run_row(tool: str, row: str, reps: int, ranks: int, cap: float) -> dict[str, Any]:
    marker = uuid.uuid4().hex
    cmd = [VENV_PY, "-m", "tests.benchmarks.faults_timing", "--driver", tool, "--row", row,
           "--reps", str(reps), "--ranks", str(ranks), "--cap", str(cap)]
    env = _env(False, marker)
    env[MARKER] = marker
    try:
        proc = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True,
                              timeout=120 + reps * (cap + 30), stdin=subprocess.DEVNULL,
                              start_new_session=True)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"timed out\n{exc.stdout or ''}"
    reap(marker)
    for line in text.splitlines():
        if line.startswith("NBDIST_BENCH "):
            return json.loads(line[len("NBDIST_BENCH "):])
    return {"error": text[-1500:]}


def _cell(values: list[float], capped: bool, cap: float) -> str:
    if not values:
        return f"> {cap:g} s (still blocked; stopped by PID)" if capped else "—"
    text = f"{statistics.median(values):.2f} s ({min(values):.2f}–{max(values):.2f}, n={len(values)})"
    if capped:
        text += f"; then > {cap:g} s"
    return text


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace, minutes: float) -> str:
    load = os.getloadavg()[0]
    lines = [
        "# Fault rows: seconds until the notebook is back, nbdist beside raw ipyparallel",
        "",
        f"Generated by `.venv/bin/python -m tests.benchmarks.faults_timing --reps {args.reps}` on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC in {minutes:.1f} min; "
        f"{platform.platform()}, {os.cpu_count()} CPUs, load average at the end {load:.1f}. "
        f"{args.ranks} gloo ranks, 1 thread each; CPU only. Medians (min–max, n).",
        "",
        "| row | scenario | nbdist | raw ipyparallel | nbdist: next collective works, ranks killed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row, label in ROWS.items():
        mine = results.get(f"nbdist/{row}", {})
        theirs = results.get(f"ipyparallel/{row}", {})
        ok = mine.get("next_cell_ok", [])
        killed = sorted({r for ks in mine.get("killed_by_ladder", []) for r in ks})
        extra = f"{sum(ok)}/{len(ok)} ok; killed: {killed or 'none'}" if ok else mine.get("error", "")[:120]
        lines.append(
            f"| {row} | {label} | {_cell(mine.get('seconds', []), False, args.cap)} | "
            f"{_cell(theirs.get('seconds', []), bool(theirs.get('capped')), args.cap)} | {extra} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cap", type=float, default=20.0)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", default=str(Path(common.ROOT) / "tests" / "benchmarks" / "FAULTS_RESULTS.md"))
    parser.add_argument("--driver", choices=("nbdist", "ipyparallel"), help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.driver == "nbdist":
        common.emit(drive_nbdist(args.row, args.reps, args.ranks))
        return 0
    if args.driver == "ipyparallel":
        drive_ipyparallel(args.row, args.reps, args.ranks, args.cap)
        return 0
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
        for tool in ("nbdist", "ipyparallel"):
            print(f"[faults] row {row}: {tool} ...", flush=True)
            results[f"{tool}/{row}"] = run_row(tool, row, args.reps, args.ranks, args.cap)
            print(f"[faults]   {json.dumps(results[f'{tool}/{row}'])[:300]}", flush=True)
    text = render(results, args, (time.perf_counter() - started) / 60)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
