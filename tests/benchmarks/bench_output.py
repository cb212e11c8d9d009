"""The output path at 16 ranks, this tree beside an older one, side by side in one run.

    .venv/bin/python -m tests.benchmarks.bench_output                 # against main
    .venv/bin/python -m tests.benchmarks.bench_output --old REF --write

Two Jupyter kernels live at once, each with 16 CPU ranks (gloo, 1 thread each) started by
`%dist_start`: one imports nbdist from this tree, the other from REF checked out into a temporary
git worktree (the output path before merged lines). Each round runs, on both kernels in
alternating order, two `%%distributed` cells: 16 ranks × 1,000 lines that differ per rank and 16 ×
1,000 lines alike on every rank; then 40 no-op cells (B2 through the magic), one on each kernel in
turn. Timed: from
the execute request until the reply, with every stream message received (execute_interactive); the
lines that reached the notebook are counted (each rank's, a merged line counting once per rank),
and every rank's 1,000 lines must be there. Reported: medians per kernel and the median of the
per-round ratios new ÷ old; CPU of the notebook kernel per cell beside wall time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from tests.benchmarks.common import write_section
from tests.kernels import KernelSession

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "benchmarks" / "RESULTS.md"
SECTION = "## Output at 16 ranks: this output path ÷ the one before it (issue 28)"
RANKS, LINES, NOOPS = 16, 1000, 40
CELLS = {
    "differ": f"%%distributed\nfor i in range({LINES}):\n    print(f'rank {{rank}} line {{i}}')\n",
    "alike": f"%%distributed\nfor i in range({LINES}):\n    print(f'line {{i}}')\n",
}
_LABEL = re.compile(r"^(?:\x1b\[[0-9;]*m)?\[ranks? ([\d,-]+)\](?:\x1b\[0m)? .*line \d+$")

# the notebook sink alone, fed what 16 ranks send (each rank's 1,000 lines in 4 chunks, ranks
# interleaved), in a process of its own that imports the tree under test; ms per cell, median
_SINK_PROBE = """
import io, json, statistics, sys, time
from contextlib import redirect_stdout
from nbdist.notebook.sink import NotebookSink
ranks, lines = int(sys.argv[1]), int(sys.argv[2])
out = {}
for name, fmt in (("differ", "rank {r} line {i}"), ("alike", "line {i}"), ("silent", "")):
    texts = ["".join(fmt.format(r=r, i=i) + "\\n" for i in range(lines)) for r in range(ranks)]
    if not fmt:
        texts = [""] * ranks
    step = len(texts[0]) // 4 + 1
    chunks = [(r, t[at:at + step]) for at in range(0, len(texts[0]), step)
              for r, t in enumerate(texts)]
    times = []
    for _ in range(15 if fmt else 200):
        try:
            sink = NotebookSink(ranks=range(ranks))
        except TypeError:  # the sink before merged output knows no ranks
            sink = NotebookSink()
        started = time.perf_counter()
        with redirect_stdout(io.StringIO()):
            for rank, text in chunks:
                sink.on_stream(rank, "stdout", text)
                getattr(sink, "tick", lambda: None)()
            for rank in range(ranks):
                getattr(sink, "on_rank_done", lambda r, s: None)(rank, "finished")
            getattr(sink, "close", sink.flush)()
        times.append(time.perf_counter() - started)
    out[name] = statistics.median(times) * 1e3
print("SINK " + json.dumps(out))
"""


class Kernel(KernelSession):
    def __init__(self, tree: Path, workdir: Path) -> None:
        super().__init__(workdir, env={"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"})
        self.run("%load_ext nbdist")
        where = self.run("import nbdist, os\nprint(nbdist.__file__, os.getpid())")[1]
        path, pid = where.split()
        assert path.startswith(str(tree)), (path, tree)
        self.process = psutil.Process(int(pid))
        self.run(f"%dist_start -n {RANKS} --threads 1")

    def run(self, code: str, timeout: float = 600) -> tuple[float, str]:
        """Seconds until the reply, every stream message received; the streamed text."""
        self.outputs.clear()
        started = time.perf_counter()
        reply = super().run(code, timeout)
        seconds = time.perf_counter() - started
        assert reply["status"] == "ok", self.text()[-2000:]
        return seconds, self.text()

    def cpu(self) -> float:
        return sum(self.process.cpu_times()[:2])


def rank_lines(text: str) -> int:
    """Lines that reached the notebook, a line shown for several ranks counted once per rank."""
    count = 0
    for line in text.splitlines():
        match = _LABEL.match(line)
        if match:
            for part in match.group(1).split(","):
                low, _, high = part.partition("-")
                count += int(high or low) - int(low) + 1
    return count


@contextmanager
def old_tree(ref: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nbdist-bench-output-") as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), ref], cwd=ROOT,
                       check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False)


def sink_alone(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", _SINK_PROBE, str(RANKS), str(LINES)], env=env,
                          cwd=tree, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.split("SINK ", 1)[1])


def one_round(kernels: dict[str, Kernel], order: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {side: {} for side in kernels}
    for name, code in CELLS.items():
        for side in order:
            cpu = kernels[side].cpu()
            seconds, text = kernels[side].run(code)
            out[side][name] = seconds
            out[side][name + "_cpu"] = kernels[side].cpu() - cpu
            got = rank_lines(text)
            assert got == RANKS * LINES, f"{side} {name}: {got} of {RANKS * LINES} lines shown"
    # one no-op cell on each kernel in turn: the load on shared cores moves between blocks
    times: dict[str, list[float]] = {side: [] for side in order}
    cpu = {side: kernels[side].cpu() for side in order}
    for _ in range(NOOPS):
        for side in order:
            times[side].append(kernels[side].run("%%distributed\npass")[0])
    for side in order:
        out[side]["noop"] = statistics.median(times[side])
        out[side]["noop_cpu"] = kernels[side].cpu() - cpu[side]
    return out


def measure(old_ref: str, rounds: int) -> dict[str, Any]:
    started = time.perf_counter()
    loads = [os.getloadavg()[0]]
    results: list[dict[str, dict[str, float]]] = []
    with old_tree(old_ref) as old, tempfile.TemporaryDirectory() as workdir:
        kernels: dict[str, Kernel] = {}
        try:
            kernels["new"] = Kernel(ROOT, Path(workdir))
            kernels["old"] = Kernel(old, Path(workdir))
            for side in kernels.values():  # warm: first cells import and build what they need
                for code in CELLS.values():
                    side.run(code)
            for index in range(rounds):
                order = ["new", "old"] if index % 2 == 0 else ["old", "new"]
                results.append(one_round(kernels, order))
                loads.append(os.getloadavg()[0])
                print(f"round {index + 1}: {results[-1]}", flush=True)
        finally:
            for kernel in kernels.values():
                kernel.close()
        sink = {"new": sink_alone(ROOT), "old": sink_alone(old)}
    return {"rounds": results, "loads": loads, "old": old_ref, "sink": sink,
            "seconds": time.perf_counter() - started}


def render(out: dict[str, Any]) -> str:
    rounds = out["rounds"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"Measured {now} by `.venv/bin/python -m tests.benchmarks.bench_output --old {out['old']} "
        f"--write` ({out['seconds'] / 60:.1f} min); {platform.platform()}, {os.cpu_count()} CPUs "
        f"(shared); load average (1 min) before and after each round: "
        f"{', '.join(f'{x:.1f}' for x in out['loads'])}. Two kernels alive at once, "
        f"{RANKS} gloo ranks × 1 thread each, {len(rounds)} rounds in alternating order; every "
        f"rank's {LINES:,} lines reached the notebook in every cell of both.", "",
        "| cell | this tree (median) | before (median) | this ÷ before (median of rounds) | "
        "kernel CPU this ÷ before | target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, label, target in (
            ("differ", f"{RANKS} ranks × {LINES:,} lines, each rank's own", 1.2),
            ("alike", f"{RANKS} ranks × {LINES:,} lines, alike on every rank", 1.2),
            ("noop", f"`%%distributed pass` (B2 through the magic, {RANKS} ranks)", 1.05)):
        new = statistics.median(r["new"][name] for r in rounds)
        old = statistics.median(r["old"][name] for r in rounds)
        ratio = statistics.median(r["new"][name] / r["old"][name] for r in rounds)
        cpu = "{:.2f}".format(sum(r["new"][name + "_cpu"] for r in rounds)
                              / sum(r["old"][name + "_cpu"] for r in rounds))
        verdict = "met" if ratio <= target else "**missed**"
        shown = (f"{new * 1e3:.1f} ms | {old * 1e3:.1f} ms" if name == "noop" else
                 f"{new:.2f} s | {old:.2f} s")
        lines.append(f"| {label} | {shown} | {ratio:.2f} | {cpu} | ≤ {target}: {verdict} |")
    sink = out["sink"]
    for name, label in (("differ", "each rank's own lines"), ("alike", "lines alike"),
                        ("silent", "a cell with no output")):
        new, old = sink["new"][name], sink["old"][name]
        shown = f"{new * 1e3:.0f} µs | {old * 1e3:.0f} µs" if name == "silent" else \
            f"{new:.1f} ms | {old:.1f} ms"
        lines.append(f"| the notebook sink alone, {label} (no kernel) | {shown} | "
                     f"{new / old:.2f} | | |")
    lines += ["", "Wall time is from the execute request to the reply with every stream message "
              "in (what a notebook waits for). Kernel CPU: the notebook kernel's own, summed over "
              "the rounds (the ranks' printing is the same code in both). The sink alone: the "
              "notebook side's Python with no kernel, fed the same lines in chunks as the ranks "
              "send them (a steadier figure than wall time on shared cores)."]
    return "\n".join(lines)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="main", help="the git ref to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--write", action="store_true", help="update RESULTS.md")
    args = parser.parse_args()
    out = measure(args.old, args.rounds)
    section = render(out)
    print(section)
    if args.write:
        write_section(RESULTS, SECTION, section)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
