"""The faults the soak draws from, each as a person meets it in a notebook: the cell they ran (or
the command), when they pressed stop or what killed a rank, and what the report must say.

A fault returns a `Fault`: what happened (`Outcome`) and the patterns the text shown under the cell
must contain for the report to count as specific (which rank, what happened)."""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from nbdist.cluster.ranks import format_ranks
from tests.soak.kernel import Outcome, SoakKernel

RANKS = 4


@dataclass
class Fault:
    name: str
    detail: str
    outcome: Outcome
    expect: list[str] = field(default_factory=list)  # regexes the shown text must match
    rank_state_kept: bool = True  # False where losing the ranks' variables is the expected result


@dataclass
class Draw:
    """Everything random about one fault, from the soak's seeded generator."""

    rng: random.Random
    rank: int
    tag: str  # unique per fault, so a report is matched to the fault that caused it

    def seconds(self, low: float, high: float) -> float:
        return round(self.rng.uniform(low, high), 2)


def _cell(code: str, line: str = "") -> str:
    return f"%%distributed {line}\n{code}"


def raise_outside_collective(kernel: SoakKernel, d: Draw) -> Fault:
    code = f"x = rank\nif rank == {d.rank}:\n    raise ValueError('{d.tag}')\nx"
    return Fault("raise", f"rank {d.rank} raises", kernel.run(_cell(code)),
                 [rf"rank {d.rank} raised ValueError: {d.tag}"])


def raise_inside_collective(kernel: SoakKernel, d: Draw) -> Fault:
    op = d.rng.choice(["dist.all_reduce(x)", "dist.barrier()", "dist.broadcast(x, src=0)"])
    code = f"x = torch.ones(1)\nif rank == {d.rank}:\n    raise ValueError('{d.tag}')\n{op}"
    return Fault("raise_in_collective", f"rank {d.rank} raises while others wait in {op}",
                 kernel.run(_cell(code)), [rf"rank {d.rank} raised ValueError: {d.tag}"])


def sigkill_mid_cell(kernel: SoakKernel, d: Draw) -> Fault:
    pid = int(kernel.value(f"nbdist.notebook.magics.current_cluster().ranks[{d.rank}].pid"))
    delay = d.seconds(0.2, 1.5)
    timer = threading.Timer(delay, os.kill, args=(pid, signal.SIGKILL))
    code = "import time\nfor _ in range(40):\n    time.sleep(0.05)\ndist.barrier()"
    timer.start()
    try:
        outcome = kernel.run(_cell(code))
    finally:
        timer.join()
    return Fault("sigkill", f"SIGKILL to rank {d.rank} (pid {pid}) {delay} s into a cell", outcome,
                 [rf"rank {d.rank} died: killed by SIGKILL"], rank_state_kept=False)


def rank_exits(kernel: SoakKernel, d: Draw) -> Fault:
    code = f"import os\nif rank == {d.rank}:\n    os._exit(7)\ndist.barrier()"
    return Fault("exit", f"rank {d.rank} calls os._exit(7)", kernel.run(_cell(code)),
                 [rf"rank {d.rank} died: exited with code 7"], rank_state_kept=False)


def stop_in_python_loop(kernel: SoakKernel, d: Draw) -> Fault:
    delay = d.seconds(0.3, 1.5)
    code = ("while True:\n    loss = model(torch.randn(8, 16)).pow(2).mean()\n"
            "    loss.backward()\n    steps += 1")
    return Fault("stop_loop", f"stop button {delay} s into a training loop",
                 kernel.run(_cell(code), interrupt_after=delay),
                 ["distributed cell interrupted",
                  *(rf"{_among(r)}: interrupted at cell line" for r in range(RANKS))])


def _among(rank: int) -> str:
    """A regex for a headline naming `rank`, alone or with others that failed alike."""
    others = [r for r in range(RANKS) if r != rank]
    named = [f"rank {rank}"] + [
        f"ranks {format_ranks(sorted([rank, *group]))}"
        for size in range(1, RANKS) for group in itertools.combinations(others, size)]
    return "(?:" + "|".join(re.escape(name) for name in named) + ")"


def stop_in_collective(kernel: SoakKernel, d: Draw) -> Fault:
    delay = d.seconds(0.5, 1.5)
    code = f"import time\nif rank == {d.rank}:\n    time.sleep(600)\ndist.barrier()"
    return Fault("stop_collective", f"stop button {delay} s in, rank {d.rank} late to a barrier",
                 kernel.run(_cell(code), interrupt_after=delay),
                 ["distributed cell interrupted", rf"rank {d.rank}: interrupted at cell line 3"])


def stop_during_push(kernel: SoakKernel, d: Draw) -> Fault:
    delay = d.seconds(0.02, 0.15)
    code = "payload = torch.randn(1_000_000)\n%dist_push payload"
    return Fault("stop_push", f"stop button {delay} s into %dist_push of 4 MB",
                 kernel.run(code, interrupt_after=delay), [r"pushed payload to 4 rank|the push of payload was interrupted|----> 1 payload = "])


# The stop button may also land just before the push or just after the pull, in the cell's own
# Python line: a plain KeyboardInterrupt there (its frames are the cell's, never nbdist's).


def stop_during_pull(kernel: SoakKernel, d: Draw) -> Fault:
    kernel.run(_cell("big = torch.randn(1_000_000)"))
    delay = d.seconds(0.02, 0.15)
    code = "pulled = %dist_pull big\nlen(pulled)"
    return Fault("stop_pull", f"stop button {delay} s into %dist_pull of 4 x 4 MB",
                 kernel.run(code, interrupt_after=delay), [r"(?m)^4$|the pull of 'big' was interrupted|----> 2 len\(pulled\)"])


def stop_during_restart(kernel: SoakKernel, d: Draw) -> Fault:
    delay = d.seconds(0.3, 5.0)
    return Fault("stop_restart", f"stop button {delay} s into %dist_restart",
                 kernel.run("%dist_restart", interrupt_after=delay),
                 [r"restarted 4 rank|the restart was interrupted|the ranks restarted, but setup cell"], rank_state_kept=False)


def hang_to_deadline(kernel: SoakKernel, d: Draw) -> Fault:
    limit = d.seconds(0.8, 2.0)
    code = f"if rank == {d.rank}:\n    while True:\n        pass\ndist.barrier()"
    return Fault("hang", f"rank {d.rank} spins past a {limit} s deadline",
                 kernel.run(_cell(code, f"--timeout {limit}")),
                 [rf"rank {d.rank}: running Python at cell line [23]", r"deadline|timed out"])


def output_flood(kernel: SoakKernel, d: Draw) -> Fault:
    size = d.rng.choice([50_000, 200_000])
    stream = d.rng.choice(["stdout", "stderr"])
    code = f"import sys\nsys.{stream}.write('x' * {size} + '\\n')\nprint('{d.tag}')"
    return Fault("flood", f"{size} characters to {stream} on every rank", kernel.run(_cell(code)),
                 [rf"{d.tag}"])


def rapid_start_stop(kernel: SoakKernel, d: Draw) -> Fault:
    code = "%dist_stop\n%dist_start -n 4"  # in one cell: the new start meets the old one's leftovers
    return Fault("start_stop", "%dist_stop then %dist_start at once", kernel.run(code),
                 [r"stopped \d+ process", r"4 rank\(s\) ready"], rank_state_kept=False)


FAULTS: dict[str, Callable[[SoakKernel, Draw], Fault]] = {
    "raise": raise_outside_collective,
    "raise_in_collective": raise_inside_collective,
    "sigkill": sigkill_mid_cell,
    "exit": rank_exits,
    "stop_loop": stop_in_python_loop,
    "stop_collective": stop_in_collective,
    "stop_push": stop_during_push,
    "stop_pull": stop_during_pull,
    "stop_restart": stop_during_restart,
    "hang": hang_to_deadline,
    "flood": output_flood,
    "start_stop": rapid_start_stop,
}
