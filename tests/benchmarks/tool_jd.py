"""jupyter-distributed (PyPI): ``DistributedKernelGroup(N)``, ``await g.start()``, ``await g.execute``.

Runs with the peers' ``.bench-venv``. It starts plain kernels with RANK/WORLD_SIZE/MASTER_* set and no
process group, so B1 adds the same ``init_process_group("gloo")`` cell raw ipyparallel runs.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from tests.benchmarks import common

SETUP = (
    "import torch, torch.distributed as dist\n"
    "import os\nrank = int(os.environ['RANK'])\n"
    "torch.set_num_threads(int(os.environ.get('OMP_NUM_THREADS', '1')))\n"
    "dist.init_process_group('gloo')\n"
)


async def run(args: Any) -> dict[str, Any]:
    from jupyter_distributed.kernel_group import DistributedKernelGroup

    want = common.figures(args)
    out: dict[str, Any] = {"tool": "jupyter-distributed", "ranks": args.ranks,
                           "versions": common.versions("jupyter-distributed", "torch", "ipykernel",
                                                       "jupyter_client")}
    group = DistributedKernelGroup(args.ranks, cwd=common.ROOT)
    started = time.perf_counter()
    await group.start()
    out["B1_start_only"] = time.perf_counter() - started
    _check(await group.execute(SETUP))
    _check(await group.execute(common.ALL_REDUCE))
    out["B1"] = {"seconds": time.perf_counter() - started}
    pids = common.descendants()
    out["pids"] = [p for p, _ in pids]

    async def series(code: str) -> list[float]:
        samples = []
        for index in range(args.reps + 3):
            t0 = time.perf_counter()
            await group.execute(code)
            if index >= 3:
                samples.append(time.perf_counter() - t0)
        return samples

    if "B2" in want:
        out["B2"] = common.summary(await series(common.NOOP))
    if "B3" in want:
        out["B3"] = common.summary(await series(common.ALL_REDUCE))
    usable = True
    if "B8" in want:
        task = asyncio.create_task(group.execute("from tests.benchmarks.train_loop import train\ntrain(100000)"))
        await asyncio.sleep(3.0)
        sent = time.perf_counter()
        await group.interrupt()
        done, _ = await asyncio.wait({task}, timeout=args.cap)
        out["B8"] = {"seconds": time.perf_counter() - sent if done else None, "cap": args.cap}
        if done:
            try:
                result = await asyncio.wait_for(group.execute(common.ALL_REDUCE), args.cap)
                out["B8"]["next_cell_ok"] = result.status == "ok"
                usable = result.status == "ok"
            except Exception as exc:
                out["B8"]["next_cell_ok"] = False
                out["B8"]["next_cell_error"] = repr(exc)[:200]
                usable = False
        else:
            usable = False
    if "B7" in want and usable:
        started = time.perf_counter()
        task = asyncio.create_task(group.execute(common.RAISE_BEFORE_BARRIER))
        done, _ = await asyncio.wait({task}, timeout=args.cap)
        out["B7"] = {"seconds": time.perf_counter() - started if done else None, "cap": args.cap}
        if done and not task.exception():
            text = str(task.result().as_dict())
            out["B7"]["root_cause_shown"] = "rank 1 fails before the barrier" in text
        if not done:
            usable = False
    if usable:
        started = time.perf_counter()
        await group.shutdown()
        out["B9"] = {"seconds": time.perf_counter() - started, "left": common.alive(pids)}
    else:
        out["B9"] = {"seconds": None, "left": common.alive(pids), "note": "not stopped (wedged)"}
    return out


def _check(result: Any) -> None:
    if result.status != "ok":
        raise RuntimeError(f"jupyter-distributed setup failed: {result.as_dict()}")


def main() -> None:
    args = common.parse_args()
    out = asyncio.run(asyncio.wait_for(run(args), 600))
    common.emit(out)
    os._exit(0)  # wedged kernels are the orchestrator's to kill, by PID


if __name__ == "__main__":
    main()
