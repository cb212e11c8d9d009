"""Cost of the straggler view on the DDP benchmark loop (B4's 4×1024 MLP), measured like B5.

    .venv/bin/python -m tests.benchmarks.bench_stragglers            # print the figures
    .venv/bin/python -m tests.benchmarks.bench_stragglers --write    # and update its RESULTS.md section

On each of 4 gloo ranks (1 thread each), two DDP copies of the same model: one built with step
timing off, one with it on (a post-accumulate-grad hook per parameter, optimizer-step hooks,
timing records and payloads; DDP's own C++ all-reduce either way). Both arms log() every step with the dashboard subscribed, so "without" is
the dashboard as it was. Rounds alternate the order; per round and rank the figure is CPU time per
step (the process's, every thread included) with ÷ without; the result is the median.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.common import write_section

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "benchmarks" / "RESULTS.md"
SECTION = "## Straggler view cost (issue 15): DDP loop, step timing on ÷ off"

SETUP = """
import json, time, torch, nbdist
from torch.nn.parallel import DistributedDataParallel as _DDP
from nbdist.worker.metrics import TIMING as _TIMING

def _build(enabled, width={width}, depth=4, batch=64):
    _TIMING.enabled = enabled  # read when DDP is built (hook or not) and at every record
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = _DDP(torch.nn.Sequential(*layers))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(batch, width)

_arms = {{False: _build(False), True: _build(True)}}

def _arm(enabled, steps):
    _TIMING.enabled = enabled
    model, opt, data = _arms[enabled]
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for index in range(steps):
        loss = model(data).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        nbdist.log(step=index, loss=loss)
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps

def _round(blocks, steps):
    # short blocks in alternating order: a change in the machine's load hits both arms alike
    totals = {{False: [0.0, 0.0], True: [0.0, 0.0]}}
    for block in range(blocks):
        for arm in ((False, True) if block % 2 == 0 else (True, False)):
            cpu, wall = _arm(arm, steps)
            totals[arm][0] += cpu / blocks
            totals[arm][1] += wall / blocks
    return json.dumps({{str(arm): value for arm, value in totals.items()}})

_arm(False, 3); _arm(True, 3)
_hooks = lambda m: sum(len(p._post_accumulate_grad_hooks or {{}}) for p in m.parameters())
f"{{_hooks(_arms[False][0])}} parameter hooks off, {{_hooks(_arms[True][0])}} on; comm hooks: {{len(_arms[True][0]._comm_hooks)}}"
"""


def measure(ranks: int = 4, steps: int = 5, blocks: int = 6, rounds: int = 9,
            width: int = 1024) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from nbdist import Cluster
    from nbdist.dashboard import Dashboard

    load = [os.getloadavg()[0]]
    cluster = Cluster(n=ranks, threads=1).start()
    dashboard = Dashboard(ranks)
    cluster.telemetry.subscribe(dashboard)
    try:
        setup = cluster.run(SETUP.format(width=width), timeout=300)
        setup.raise_for_errors()
        hooks = setup.value_text(0)
        cpu_ratios: list[float] = []
        wall_ratios: list[float] = []
        step_ms: list[float] = []
        step_cpu_ms: list[float] = []
        started = time.perf_counter()
        cpu_on = cpu_off = 0.0
        for _ in range(rounds):
            result = cluster.run(f"_round({blocks}, {steps})", timeout=600)
            result.raise_for_errors()
            for rank in result.ranks:
                arms = json.loads(ast.literal_eval(result.value_text(rank) or "''"))
                cpu_ratios.append(arms["True"][0] / arms["False"][0])
                cpu_on, cpu_off = cpu_on + arms["True"][0], cpu_off + arms["False"][0]
                wall_ratios.append(arms["True"][1] / arms["False"][1])
                step_ms.append(1e3 * arms["False"][1])
                step_cpu_ms.append(1e3 * arms["False"][0])
            load.append(os.getloadavg()[0])
        seconds = time.perf_counter() - started
        flagged = dashboard.model.stragglers.summary(list(range(ranks)))
    finally:
        cluster.telemetry.unsubscribe(dashboard)
        dashboard.close()
        cluster.stop()
    return {
        "ranks": ranks, "steps": steps * blocks, "blocks": blocks, "rounds": rounds,
        "width": width, "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_ratio_pooled": cpu_on / cpu_off,
        "cpu_ratio_quartiles": statistics.quantiles(cpu_ratios, n=4),
        "wall_ratio": statistics.median(wall_ratios),
        "step_ms_wall_off": statistics.median(step_ms),
        "step_ms_cpu_off": statistics.median(step_cpu_ms), "params": 2 * 4,  # 4 Linear layers
        "pairs": len(cpu_ratios), "seconds": seconds, "load": load, "hooks": hooks,
        "collectives_seen": flagged["collectives"],
    }


def cost_model(params: int = 400, rounds: int = 15) -> dict[str, float]:
    """CPU µs of each piece, in this process (1 thread, a 1-rank gloo group): a parameter's
    grad-ready hook (backward of ``params`` tiny layers, hooked ÷ not, paired), the two
    optimizer-step hooks with a DDP record, and one drain + pickle of a step's records."""
    import pickle
    import tempfile
    import types

    import torch
    import torch.distributed as dist

    from nbdist.worker.metrics import StepTiming

    torch.set_num_threads(1)
    timing = StepTiming()
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                            world_size=1)
    try:
        def layers() -> Any:
            torch.manual_seed(0)
            return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(params // 2)])

        plain, hooked = layers(), layers()
        timing.watch(types.SimpleNamespace(module=hooked, process_group=None))
        data = torch.randn(2, 4)

        def backward(model: Any, n: int = 20) -> float:
            started = time.process_time()
            for _ in range(n):
                model(data).sum().backward()
            return (time.process_time() - started) / n

        backward(plain), backward(hooked)
        extra = [backward(hooked) - backward(plain) for _ in range(rounds)]
        hook_us = 1e6 * max(0.0, statistics.median(extra)) / params
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.0)
        started = time.process_time()
        for _ in range(2000):
            timing._ddp_ready = (None, time.perf_counter())
            timing.on_optimizer_step_begin(optimizer)
            timing.on_optimizer_step(optimizer)
        step_us = 1e6 * (time.process_time() - started) / 2000
        started = time.process_time()
        for _ in range(2000):
            timing.after(("0", 1, 4, time.perf_counter() - 0.001), "all_reduce")
            timing.steps.append((1.0, 0.1, 0.01))
            pickle.dumps(timing.drain())
        drain_us = 1e6 * (time.process_time() - started) / 2000
    finally:
        dist.destroy_process_group()
    return {"hook_us": hook_us, "step_hooks_us": step_us, "drain_us": drain_us}


def render(out: dict[str, Any]) -> str:
    q1, _, q3 = out["cpu_ratio_quartiles"]
    cost, params = out["cost"], out["params"]
    per_step_us = params * cost["hook_us"] + cost["step_hooks_us"] + cost["drain_us"]
    model_pct = 100 * per_step_us / (1e3 * out["step_ms_cpu_off"])
    verdict = "met" if out["cpu_ratio"] <= 1.01 else "**missed**"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in out["load"])
    return "\n".join([
        SECTION,
        "",
        f"Measured {now} by `.venv/bin/python -m tests.benchmarks.bench_stragglers --write` "
        f"({out['seconds'] / 60:.1f} min); machine: {platform.machine()}, {os.cpu_count()} CPUs "
        f"(shared), {platform.platform()}; load average (1 min) before and after each round: {load}.",
        "",
        "| figure | value | target |",
        "| --- | --- | --- |",
        f"| CPU per step, timing on ÷ off (median of {out['pairs']} rank-rounds; quartiles) "
        f"| {out['cpu_ratio']:.3f} ({q1:.3f}–{q3:.3f}) | ≤ 1.01: {verdict} |",
        f"| CPU per step, timing on ÷ off, pooled over all ranks and rounds "
        f"| {out['cpu_ratio_pooled']:.3f} | |",
        f"| same, wall time (noisy on shared cores) | {out['wall_ratio']:.3f} | |",
        f"| DDP step, timing off (wall, median) | {out['step_ms_wall_off']:.0f} ms | |",
        f"| cost model: {cost['hook_us']:.2f} µs per parameter hook × {params}, "
        f"{cost['step_hooks_us']:.1f} µs for the step hooks, {cost['drain_us']:.1f} µs drain + "
        f"pickle per step, ÷ the step's CPU | {model_pct:.3f} % | |",
        "",
        f"{out['ranks']} gloo ranks × 1 thread, {out['width']}-wide 4-layer MLP, batch 64, SGD, "
        f"log() every step in both arms, {out['steps']} steps per arm and round in blocks of "
        f"{out['steps'] // out['blocks']} in alternating order, {out['rounds']} rounds. Timing "
        f"adds post-accumulate-grad hooks only: {out['hooks'].strip(chr(39))}.",
    ])



if __name__ == "__main__":
    figures = measure()
    figures["cost"] = cost_model()
    print(json.dumps(figures, indent=1))
    section = render(figures)
    print(section)
    if "--write" in sys.argv[1:]:
        write_section(RESULTS, SECTION, section)
        print(f"wrote {RESULTS}")
