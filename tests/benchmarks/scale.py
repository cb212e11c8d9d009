"""Scale (issue 14): start, restart and per-cell cost of nbdist at N = 2, 4, 8, 16 ranks on this
machine, as a table and a plot (SVG) in RESULTS.md, with a check that each grows no worse than
linearly in N (doubling N at most doubles the time).

    .venv/bin/python -m tests.benchmarks.scale                 # N = 2, 4, 8, 16 (~3-5 min)
    .venv/bin/python -m tests.benchmarks.scale --ranks 2,4     # a subset

Each N runs in a fresh process (`tests.benchmarks.tool_nbdist`: B1 start to first collective,
B10 `%dist_restart` to first collective, B2 no-op cell, B3 1,000-float all_reduce cell), then raw
ipyparallel at the same N (`tool_ipp`: B1, B2, B3) beside it, one after the other; what a run
leaves behind is stopped by PID (`run.reap`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

from tests.benchmarks import run as bench

FIGURES = {"B1": ("start → first collective", "s"), "B10": ("%dist_restart → first collective", "s"),
           "B2": ("no-op cell", "ms"), "B3": ("1,000-float all_reduce cell", "ms")}
SECTION = "## Scale: nbdist at N = 2, 4, 8, 16 ranks (issue 14)"
PLOT = os.path.join(bench.ROOT, "tests", "benchmarks", "scale.svg")


def measure(ranks: list[int], reps: int, say: object = print) -> dict[int, dict[str, float]]:
    settings = bench.Settings(ranks=0, reps=reps, threads=1)
    out: dict[int, dict[str, float]] = {}
    for n in ranks:
        settings.ranks = n
        say(f"[scale] {n} ranks")  # type: ignore[operator]
        result, text, _reaped = bench.run_tool("nbdist", settings, "B1,B2,B3,B10,B9", timeout=900)
        raw, raw_text, _reaped = bench.run_tool("ipyparallel", settings, "B1,B2,B3,B9", timeout=900)
        if result is None or raw is None:
            raise RuntimeError(f"{n} ranks failed:\n{(text if result is None else raw_text)[-2000:]}")
        out[n] = {"B1": result["B1"]["seconds"], "B10": result["B10"]["median"],
                  "B2": result["B2"]["median"] * 1e3, "B3": result["B3"]["median"] * 1e3,
                  "raw B1": raw["B1"]["seconds"], "raw B2": raw["B2"]["median"] * 1e3,
                  "raw B3": raw["B3"]["median"] * 1e3}
    return out


def linear_verdicts(data: dict[int, dict[str, float]]) -> dict[str, str]:
    """Per figure: the largest growth factor between successive N against the growth of N."""
    ns = sorted(data)
    verdicts = {}
    for fig in FIGURES:
        worst = max((data[b][fig] / data[a][fig]) / (b / a) for a, b in zip(ns, ns[1:], strict=False))
        verdicts[fig] = f"{worst:.2f} ({'linear or better' if worst <= 1.0 else 'worse than linear'})"
    return verdicts


def svg_plot(data: dict[int, dict[str, float]]) -> str:
    """Four small panels (one per figure), N on a log2 axis, time against a linear reference."""
    ns = sorted(data)
    width, height, pad = 260, 180, 36
    panels = []
    for index, (fig, (title, unit)) in enumerate(FIGURES.items()):
        x0 = index * (width + 10)
        raw = f"raw {fig}" if all(f"raw {fig}" in data[n] for n in ns) else None
        top = max(max(data[n][fig] for n in ns), data[ns[0]][fig] * ns[-1] / ns[0],
                  max(data[n][raw] for n in ns) if raw else 0.0) * 1.05

        def px(n: int, x0: int = x0) -> float:
            span = max(1.0, math.log2(ns[-1] / ns[0]))
            return x0 + pad + (width - pad - 8) * math.log2(n / ns[0]) / span

        def py(v: float, top: float = top) -> float:
            return height - pad + 8 - (height - pad - 8) * v / top

        line = " ".join(f"{px(n):.1f},{py(data[n][fig]):.1f}" for n in ns)
        raw_line = "" if raw is None else (
            f'<polyline points="{" ".join(f"{px(n):.1f},{py(data[n][raw]):.1f}" for n in ns)}" '
            'fill="none" stroke="#ff7f0e" stroke-width="2"/>')
        ref = " ".join(f"{px(n):.1f},{py(data[ns[0]][fig] * n / ns[0]):.1f}" for n in ns)
        dots = "".join(f'<circle cx="{px(n):.1f}" cy="{py(data[n][fig]):.1f}" r="3" fill="#1f77b4"/>'
                       f'<text x="{px(n):.1f}" y="{height - 6}" font-size="10" text-anchor="middle">{n}</text>'
                       for n in ns)
        panels.append(
            f'<g><text x="{x0 + pad}" y="14" font-size="11">{title} ({unit})</text>'
            f'<line x1="{x0 + pad}" y1="{py(0):.1f}" x2="{x0 + width - 8}" y2="{py(0):.1f}" stroke="#999"/>'
            f'<text x="{x0 + pad - 4}" y="{py(top / 1.05):.1f}" font-size="9" text-anchor="end">{top / 1.05:.3g}</text>'
            f'<polyline points="{ref}" fill="none" stroke="#bbb" stroke-dasharray="4 3"/>'
            f'{raw_line}<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="2"/>{dots}</g>')
    total = len(FIGURES) * (width + 10)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{total}" height="{height}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{"".join(panels)}'
            f'<text x="{total - 8}" y="{height - 20}" font-size="9" text-anchor="end" fill="#777">'
            'ranks (log2); blue: nbdist; orange: raw ipyparallel; dashed: linear in N from '
            "nbdist's smallest N</text></svg>")


def section(data: dict[int, dict[str, float]], seconds: float, loads: list[float], reps: int,
            when: str) -> str:
    ns = sorted(data)
    verdicts = linear_verdicts(data)
    lines = [SECTION, "",
             f"Measured {when} by `.venv/bin/python -m tests.benchmarks.scale` ({seconds / 60:.1f} min); "
             f"machine: {bench._machine()}; load average (1 min) before and after each N: "
             f"{', '.join(f'{x:.1f}' for x in loads)}. One fresh process per N, 1 thread per rank; "
             f"B2/B3 medians of {reps} cells, B10 median of 3 restarts. On 2 cores, N ranks "
             "share 2 cores: past N = 2 every figure also measures the CPU contention.", "",
             "| figure | " + " | ".join(f"N = {n}" for n in ns) + " | worst growth ÷ growth of N |",
             "| --- | " + " | ".join("---" for _ in ns) + " | --- |"]
    for fig, (title, unit) in FIGURES.items():
        for tool, key in (("nbdist", fig), ("raw ipyparallel", f"raw {fig}")):
            if key not in data[ns[0]]:
                continue
            cells = " | ".join(f"{data[n][key]:.2f} {unit}" if unit == "s" else f"{data[n][key]:.1f} {unit}"
                               for n in ns)
            verdict = verdicts[fig] if tool == "nbdist" else ""
            lines.append(f"| {fig} {title}, {tool} | {cells} | {verdict} |")
    if all("raw B1" in data[n] for n in ns):
        lines.append("| B1 nbdist ÷ raw ipyparallel | "
                     + " | ".join(f"{data[n]['B1'] / data[n]['raw B1']:.2f}" for n in ns) + " | |")
        lines.append("| B3 nbdist ÷ raw ipyparallel | "
                     + " | ".join(f"{data[n]['B3'] / data[n]['raw B3']:.2f}" for n in ns) + " | |")
    lines += ["", "![nbdist at N = 2, 4, 8, 16 ranks](scale.svg)", ""]
    return "\n".join(lines)


def write_section(text: str, path: str) -> None:
    """Put the section into RESULTS.md in place of an older one (the rest is kept)."""
    old = Path(path).read_text() if os.path.exists(path) else ""
    kept = [part for part in bench.split_sections(old) if not part.startswith(SECTION)]
    Path(path).write_text("".join(kept).rstrip("\n") + "\n\n" + text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4,8,16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=bench.Settings().out)
    parser.add_argument("--json", default=os.path.join(bench.ROOT, "tests", "artifacts", "scale.json"),
                        help="the raw figures are saved here first (a plot bug never loses a run)")
    parser.add_argument("--from-json", action="store_true", help="only re-render from --json")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.json).read_text())
        data = {int(n): figs for n, figs in saved["data"].items()}
        seconds, loads, args.reps = saved["seconds"], saved["loads"], saved.get("reps", args.reps)
        when = saved.get("when", "(time not saved)")
    else:
        started = time.perf_counter()
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        loads = [os.getloadavg()[0]]
        data = {}
        for n in (int(x) for x in args.ranks.split(",")):
            data.update(measure([n], args.reps))
            loads.append(os.getloadavg()[0])
        seconds = time.perf_counter() - started
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        Path(args.json).write_text(json.dumps({"data": data, "seconds": seconds, "loads": loads, "reps": args.reps,
                                               "when": when}))
    Path(PLOT).write_text(svg_plot(data))
    text = section(data, seconds, loads, args.reps, when)
    write_section(text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
