"""Cost of torch's flight recorder (every rank records each collective) and of check_collectives
(TORCH_DISTRIBUTED_DEBUG=DETAIL) on a DDP loop, side by side in one run.

    .venv/bin/python -m tests.benchmarks.bench_flight_recorder            # print the figures
    .venv/bin/python -m tests.benchmarks.bench_flight_recorder --write    # and update RESULTS.md

Both settings are read once per process, when its first group is made, so each arm is its own
cluster of 2 gloo ranks (1 thread each), all three started at once: recorder off
(``flight_recorder_entries=0``), on (nbdist's default), and on with check_collectives. Rounds
run the arms one after the other, in a rotating order; each arm runs the same DDP loop
(4 Linear layers) and then a burst of 1-float all_reduces (the cost per collective, with no
compute to hide it). Figures are medians over rounds of the per-round ratios to "off": wall
steps/s (the slower rank's), and steps per CPU second of both ranks (less moved by what else
the shared machine runs, since the arms are different processes).
"""

from __future__ import annotations

import datetime
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
SECTION = "## Flight recorder and check_collectives cost: DDP steps/s, on ÷ off"

SETUP = """
import time, torch
from torch.nn.parallel import DistributedDataParallel as _DDP
torch.manual_seed(0)
_model = torch.nn.Sequential(*[torch.nn.Linear({width}, {width}) for _ in range(4)])
_model = _DDP(_model) if {ddp} else _model
_opt = torch.optim.SGD(_model.parameters(), lr=1e-3)
_data = torch.randn(32, {width})

def _arm(steps, calls):
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps if {ddp} else 0):
        loss = _model(_data).pow(2).mean()
        _opt.zero_grad(set_to_none=True)
        loss.backward()
        _opt.step()
    done = max(steps, 1)
    step = ((time.perf_counter() - wall) / done, (time.process_time() - cpu) / done)
    one = torch.ones(1)
    dist.barrier()
    wall = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(one)
    return step, (time.perf_counter() - wall) / calls

_arm(3, 20)
"""

ARMS = ("off", "on", "check")


def measure(steps: int = 60, calls: int = 300, rounds: int = 15, width: int = 256
            ) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from nbdist import Cluster
    from nbdist.config import NbdistConfig
    from nbdist.worker.process_group import ddp_survives

    # torch 2.13 crashes building a DDP model under DETAIL: that arm then runs the burst only
    ddp_under_detail = ddp_survives()
    configs = {"off": NbdistConfig(flight_recorder_entries=0), "on": NbdistConfig(),
               "check": NbdistConfig(check_collectives=True)}
    clusters: dict[str, Any] = {}
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    try:
        for arm in ARMS:
            clusters[arm] = Cluster(n=2, threads=1, config=configs[arm]).start()
            clusters[arm].run(SETUP.format(width=width, ddp=arm != "check" or ddp_under_detail),
                              timeout=300).raise_for_errors()
        samples: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in ARMS}
        for index in range(rounds):
            order = ARMS[index % 3:] + ARMS[:index % 3]
            for arm in order:
                result = clusters[arm].run(f"_arm({steps}, {calls})", timeout=600)
                result.raise_for_errors()
                per_rank = [eval(result.value_text(r) or "()") for r in result.ranks]
                samples[arm].append((max(s[0] for s, _ in per_rank), max(c for _, c in per_rank),
                                     sum(s[1] for s, _ in per_rank)))
            load.append(os.getloadavg()[0])
    finally:
        for cluster in clusters.values():
            cluster.stop()

    def ratio(arm: str, which: int) -> float | None:
        if which != 1 and arm == "check" and not ddp_under_detail:
            return None
        return statistics.median(off[which] / mine[which]
                                 for off, mine in zip(samples["off"], samples[arm], strict=True))

    return {
        "rounds": rounds, "steps": steps, "calls": calls, "width": width,
        "step_ms_off": 1e3 * statistics.median(s[0] for s in samples["off"]),
        "call_us_off": 1e6 * statistics.median(s[1] for s in samples["off"]),
        "steps_ratio_on": ratio("on", 0), "steps_ratio_check": ratio("check", 0),
        "cpu_ratio_on": ratio("on", 2),
        "calls_ratio_on": ratio("on", 1), "calls_ratio_check": ratio("check", 1),
        "seconds": time.perf_counter() - started, "load": load,
        "ddp_under_detail": ddp_under_detail,
    }


def render(out: dict[str, Any]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in out["load"])
    verdict = "met" if out["steps_ratio_on"] >= 0.99 else "**missed**"
    check_steps = (f"{out['steps_ratio_check']:.3f}" if out["ddp_under_detail"] else
                   "DDP crashes (SIGSEGV) under DETAIL on this torch")
    return "\n".join([
        SECTION,
        "",
        f"Measured {now} by `.venv/bin/python -m tests.benchmarks.bench_flight_recorder --write` "
        f"({out['seconds'] / 60:.1f} min); machine: {platform.machine()}, {os.cpu_count()} CPUs "
        f"(shared), {platform.platform()}; torch {_torch_version()}; 2 gloo ranks per arm, "
        f"1 thread each; load average (1 min) before and after each round: {load}.",
        "",
        f"DDP loop: 4 Linear({out['width']}, {out['width']}), batch 32, {out['steps']} steps per "
        f"arm and round ({out['step_ms_off']:.1f} ms per step with the recorder off); then "
        f"{out['calls']} all_reduces of 1 float ({out['call_us_off']:.0f} µs each, off). "
        f"Ratios are throughput ÷ the recorder-off arm's, median of {out['rounds']} rounds.",
        "",
        "| figure | recorder on (256 entries) | check_collectives (DETAIL) | target |",
        "| --- | --- | --- | --- |",
        f"| DDP steps/s ÷ off | {out['steps_ratio_on']:.3f} | {check_steps} "
        f"| recorder ≥ 0.99: {verdict} |",
        f"| DDP steps per CPU second (both ranks) ÷ off | {out['cpu_ratio_on']:.3f} | | |",
        f"| 1-float all_reduces/s ÷ off | {out['calls_ratio_on']:.3f} "
        f"| {out['calls_ratio_check']:.3f} | |",
        "",
    ])


def _torch_version() -> str:
    import torch

    return str(torch.__version__)



if __name__ == "__main__":
    figures = measure()
    section = render(figures)
    print(section)
    if "--write" in sys.argv:
        write_section(RESULTS, SECTION, section)
