"""Measure B1–B9 (docs/BENCHMARKS.md) for nbdist and its peers side by side; write RESULTS.md.

    .venv/bin/python -m tests.benchmarks.run            # full run (~15-25 min on 2 shared cores)
    .venv/bin/python -m tests.benchmarks.run --quick    # 1 round, few repetitions (~4 min)

Peers (jupyter-distributed, nbdistributed, and py-spy/pyinstrument for profiling) are installed
into their own ``.bench-venv`` (git-ignored, torch pinned by ``.ci/constraints.txt``), never into
the project. Raw ipyparallel and torchrun run from the project's ``.venv`` (the same ipyparallel
and torch nbdist uses, so the comparison is like for like). Every tool runs alone, in turn, with
the order rotated each round; whatever a tool leaves behind is found by an environment marker and
stopped by PID (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from nbdist.worker.process_tree import stop_processes
from tests.benchmarks.common import ROOT

VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
BENCH_VENV = os.path.join(ROOT, ".bench-venv")
BENCH_PY = os.path.join(BENCH_VENV, "bin", "python")
PEER_PACKAGES = ["torch==2.13.0", "ipyparallel", "jupyter-distributed", "nbdistributed",
                 "py-spy", "pyinstrument", "psutil", "numpy"]
MARKER = "NBDIST_BENCH_RUN"
TOOLS = ("nbdist", "ipyparallel", "jupyter-distributed", "nbdistributed")
MODULES = {"nbdist": "tests.benchmarks.tool_nbdist", "ipyparallel": "tests.benchmarks.tool_ipp",
           "jupyter-distributed": "tests.benchmarks.tool_jd", "nbdistributed": "tests.benchmarks.tool_nbd"}
PEER_VENV_TOOLS = {"jupyter-distributed", "nbdistributed"}


@dataclass
class Settings:
    rounds: int = 3
    reps: int = 50
    ranks: int = 4
    threads: int = 1
    train_steps: int = 40
    cap: float = 20.0
    b5_steps: int = 60
    b5_rounds: int = 7
    tools: tuple[str, ...] = TOOLS
    figures: str = "B1,B2,B3,B4,B6,B7,B8,B9,B10,B11"
    torchrun: bool = True
    b5: bool = True
    install: bool = True
    out: str = os.path.join(ROOT, "tests", "benchmarks", "RESULTS.md")
    json_out: str | None = None
    from_json: str | None = None
    command: str = ""


@dataclass
class Collected:
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    torchrun: list[dict[str, Any]] = field(default_factory=list)
    b5: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    reaped: list[str] = field(default_factory=list)
    load: list[tuple[float, float, float]] = field(default_factory=list)
    started: float = 0.0
    seconds: float = 0.0


# ---------------------------------------------------------------- environments
def ensure_bench_venv(say: Any = print) -> None:
    """Create .bench-venv with the peers (once); torch stays at the pinned 2.13.0."""
    if os.path.exists(BENCH_PY) and _has(BENCH_PY, "jupyter_distributed", "nbdistributed", "ipyparallel"):
        return
    say(f"creating {BENCH_VENV} for the peers (once)")
    if not os.path.exists(BENCH_PY):
        subprocess.run([sys.executable, "-m", "venv", BENCH_VENV], check=True)
    subprocess.run([BENCH_PY, "-m", "pip", "install", "--quiet", "-c",
                    os.path.join(ROOT, ".ci", "constraints.txt"), *PEER_PACKAGES], check=True)


def _has(python: str, *modules: str) -> bool:
    code = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
    return subprocess.run([python, "-c", code, *modules], capture_output=True).returncode == 0


def _env(peer_venv: bool, marker: str) -> dict[str, str]:
    env = dict(os.environ)
    env[MARKER] = marker
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = ROOT
    env.pop("PYTHONSTARTUP", None)
    if peer_venv:  # nbdistributed starts `python` from PATH
        env["PATH"] = os.path.join(BENCH_VENV, "bin") + os.pathsep + env.get("PATH", "")
        env.pop("VIRTUAL_ENV", None)
    return env


# ---------------------------------------------------------------- running one tool
def reap(marker: str, grace: float = 3.0) -> list[str]:
    """Stop, by PID, every process that carries this run's marker (leftovers of a tool)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARKER) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    stop_processes(found, grace)
    names = []
    for proc in found:
        try:
            names.append(f"{proc.pid} {' '.join(proc.info['cmdline'][:3])[:80]}")
        except Exception:
            names.append(str(proc.pid))
    return names


def run_tool(tool: str, settings: Settings, figures: str, timeout: float = 900) -> tuple[dict[str, Any] | None, str, list[str]]:
    marker = uuid.uuid4().hex
    python = BENCH_PY if tool in PEER_VENV_TOOLS else VENV_PY
    cmd = [python, "-m", MODULES[tool], "--ranks", str(settings.ranks), "--reps", str(settings.reps),
           "--figures", figures, "--train-steps", str(settings.train_steps), "--cap", str(settings.cap),
           "--threads", str(settings.threads)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(tool in PEER_VENV_TOOLS, marker),
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, start_new_session=True)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"timed out after {timeout:.0f} s\n" + str(exc.stdout or "")[-2000:]
    reaped = reap(marker)
    for line in text.splitlines():
        if line.startswith("NBDIST_BENCH "):
            return json.loads(line[len("NBDIST_BENCH "):]), text, reaped
    return None, text, reaped


def run_torchrun(settings: Settings) -> dict[str, Any] | None:
    marker = uuid.uuid4().hex
    cmd = [VENV_PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={settings.ranks}",
           os.path.join(ROOT, "tests", "benchmarks", "train_loop.py"), str(settings.train_steps)]
    env = _env(False, marker)
    env["OMP_NUM_THREADS"] = str(settings.threads)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL, start_new_session=True)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        text = ""
    reap(marker)
    for line in text.splitlines():
        if "NBDIST_BENCH " in line:
            return json.loads(line.split("NBDIST_BENCH ", 1)[1])
    return None


def run_b5(settings: Settings) -> dict[str, Any] | None:
    code = ("import json; from tests.benchmarks.bench_dashboard import bench_overhead; "
            f"print('NBDIST_BENCH ' + json.dumps(bench_overhead(steps={settings.b5_steps}, rounds={settings.b5_rounds})))")
    marker = uuid.uuid4().hex
    try:
        proc = subprocess.run([VENV_PY, "-c", code], cwd=ROOT, env=_env(False, marker), capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        text = ""
    reap(marker)
    for line in text.splitlines():
        if line.startswith("NBDIST_BENCH "):
            return json.loads(line[len("NBDIST_BENCH "):])
    return None


def collect(settings: Settings, say: Any = print) -> Collected:
    data = Collected(started=time.time())
    data.load.append(os.getloadavg())
    wall = time.perf_counter()
    tools = list(settings.tools)
    for round_index in range(settings.rounds):
        order = tools[round_index % len(tools):] + tools[: round_index % len(tools)]
        for tool in order:
            say(f"round {round_index + 1}/{settings.rounds}: {tool}")
            result, text, reaped = run_tool(tool, settings, settings.figures)
            data.load.append(os.getloadavg())
            if reaped:
                data.reaped.append(f"{tool}: stopped {len(reaped)} leftover process(es) by PID")
            if result is None:
                data.failures.append(f"{tool} (round {round_index + 1}): {text[-1500:]}")
                say(f"  {tool} failed:\n{text[-1500:]}")
                continue
            data.runs.setdefault(tool, []).append(result)
        if settings.torchrun and "B4" in settings.figures:
            say(f"round {round_index + 1}/{settings.rounds}: torchrun")
            out = run_torchrun(settings)
            if out is None:
                data.failures.append(f"torchrun (round {round_index + 1}) failed")
            else:
                data.torchrun.append(out)
        if settings.b5:
            say(f"round {round_index + 1}/{settings.rounds}: B5 (dashboard cost, in-process)")
            out = run_b5(settings)
            if out is None:
                data.failures.append(f"B5 (round {round_index + 1}) failed")
            else:
                data.b5.append(out)
    data.seconds = time.perf_counter() - wall
    data.load.append(os.getloadavg())
    return data


# ---------------------------------------------------------------- the table
def _pool(runs: list[dict[str, Any]], key: str, field_name: str = "seconds") -> list[float]:
    values: list[float] = []
    for run in runs:
        item = run.get(key)
        if not isinstance(item, dict):
            continue
        if "samples" in item:
            values.extend(item["samples"])
        elif item.get(field_name) is not None:
            values.append(float(item[field_name]))
    return values


def _fmt_s(values: list[float], unit: str = "ms") -> str:
    if not values:
        return "—"
    scale = 1e3 if unit == "ms" else 1.0
    med = statistics.median(values) * scale
    lo, hi = min(values) * scale, max(values) * scale
    digits = 1 if unit == "ms" else 2
    text = f"{med:.{digits}f} {unit}"
    if len(values) > 1:
        text += f" ({lo:.{digits}f}–{hi:.{digits}f}, n={len(values)})"
    return text


def _ratio(mine: list[float], theirs: list[float]) -> float | None:
    if not mine or not theirs:
        return None
    return statistics.median(mine) / statistics.median(theirs)


def _capped(runs: list[dict[str, Any]], key: str) -> list[str]:
    notes = []
    for run in runs:
        item = run.get(key) or {}
        if item.get("seconds") is None and item:
            notes.append(item.get("note") or f"> {item.get('cap', '?')} s (still blocked; stopped by PID)")
        elif item.get("dead_ranks"):
            notes.append(f"ladder killed rank(s) {item['dead_ranks']} in one round")
    return notes


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**missed**")


def build_rows(data: Collected) -> dict[str, Any]:
    """Per figure: values per tool (pooled over rounds), ratios and the verdict against the target."""
    runs = data.runs
    nb = runs.get("nbdist", [])
    peers = [t for t in TOOLS if t != "nbdist"]
    figures: dict[str, Any] = {}

    def per_tool(key: str, unit: str, extra: dict[str, tuple[str, str]] | None = None) -> list[dict[str, Any]]:
        rows = []
        for tool in TOOLS:
            values = _pool(runs.get(tool, []), key)
            notes = _capped(runs.get(tool, []), key) if key in ("B7", "B8", "B9") else []
            if not values and not notes and tool not in runs:
                continue
            rows.append({"tool": tool, "what": key, "values": values, "text": _fmt_s(values, unit),
                         "notes": notes})
        for label, (tool, key2) in (extra or {}).items():
            values = _pool(runs.get(tool, []), key2)
            if values:
                rows.append({"tool": label, "what": key2, "values": values, "text": _fmt_s(values, unit), "notes": []})
        return rows

    b1 = per_tool("B1", "s")
    b2 = per_tool("B2", "ms", {"nbdist (Python API, cluster.run)": ("nbdist", "B2_api"),
                               "ipyparallel (%%px)": ("ipyparallel", "B2_px")})
    b3 = per_tool("B3", "ms")
    b7 = per_tool("B7", "s")
    b8 = per_tool("B8", "s")
    b9 = per_tool("B9", "s")
    nb_b1, nb_b2, nb_b3 = _pool(nb, "B1"), _pool(nb, "B2"), _pool(nb, "B3")
    raw = runs.get("ipyparallel", [])
    jd = runs.get("jupyter-distributed", [])
    r_b1 = _ratio(nb_b1, _pool(raw, "B1"))
    r_b2_raw = _ratio(nb_b2, _pool(raw, "B2"))
    r_b2_jd = _ratio(nb_b2, _pool(jd, "B2"))
    r_b3 = _ratio(nb_b3, _pool(raw, "B3"))
    peer_b1 = [statistics.median(v) for t in peers if (v := _pool(runs.get(t, []), "B1"))]
    fastest_peer = min(peer_b1) if peer_b1 else None
    r_peer = None if fastest_peer is None or not nb_b1 else statistics.median(nb_b1) / fastest_peer
    figures["B1"] = {"title": "time to first collective (start → all_reduce cell returned)", "rows": b1,
                     "targets": [("≤ 0.25 × raw ipyparallel (issue 14)", r_b1, None if r_b1 is None else r_b1 <= 0.25),
                                 ("faster than every peer (÷ the fastest)", r_peer,
                                  None if r_peer is None else r_peer < 1.0)]}
    figures["B2"] = {"title": "no-op cell round trip (`%%distributed pass`)", "rows": b2,
                     "targets": [("≤ 0.8 × raw `view.execute`", r_b2_raw, None if r_b2_raw is None else r_b2_raw <= 0.8),
                                 ("≤ 0.5 × jupyter-distributed", r_b2_jd, None if r_b2_jd is None else r_b2_jd <= 0.5)]}
    figures["B3"] = {"title": "1,000-float all_reduce cell", "rows": b3,
                     "targets": [("≤ 1.0 × raw ipyparallel", r_b3, None if r_b3 is None else r_b3 <= 1.0)]}
    # B4: steps/s, nbdist (dashboard on) vs torchrun
    nb_b4 = [float(r["B4"]["steps_per_s"]) for r in nb if r.get("B4")]
    tr_b4 = [float(r["steps_per_s"]) for r in data.torchrun]
    r_b4 = (statistics.median(nb_b4) / statistics.median(tr_b4)) if nb_b4 and tr_b4 else None
    b4_rows = []
    if nb_b4:
        b4_rows.append({"tool": "nbdist (dashboard on, log() every step)", "text": _fmt_rate(nb_b4)})
    if tr_b4:
        b4_rows.append({"tool": "torchrun (same loop, same threads)", "text": _fmt_rate(tr_b4)})
    figures["B4"] = {"title": "DDP training throughput (4×1024 MLP, batch 64, SGD; steps/s, higher is better)",
                     "rows": b4_rows, "targets": [("≥ 0.97 × torchrun", r_b4, None if r_b4 is None else r_b4 >= 0.97)]}
    # B5 (bench_dashboard.bench_overhead: CPU-time ratio is the figure; wall is noise here)
    b5_ratio = [float(r.get("ratio_cpu_paired", r.get("ratio", 0.0))) for r in data.b5]
    b5_wall = [float(r["ratio_wall_paired"]) for r in data.b5 if "ratio_wall_paired" in r]
    b5_rows = [{"tool": "nbdist: CPU per step with sampler + log() every step ÷ without (paired rounds)", "text":
                (f"{statistics.median(b5_ratio):.3f} (" + ", ".join(f"{x:.3f}" for x in b5_ratio) + ")") if b5_ratio else "—"}]
    if b5_wall:
        b5_rows.append({"tool": "same, wall time (noisy on shared cores)",
                        "text": f"{statistics.median(b5_wall):.3f} (" + ", ".join(f"{x:.3f}" for x in b5_wall) + ")"})
    if data.b5:
        last = data.b5[-1]
        b5_rows.append({"tool": "cost model (last round)", "text": "; ".join(
            f"{k} {float(v):.2f}" for k, v in last.items() if isinstance(v, (int, float)) and k != "published_bytes")})
    r_b5 = statistics.median(b5_ratio) if b5_ratio else None
    figures["B5"] = {"title": "dashboard cost (one process, 1 thread)", "rows": b5_rows,
                     "targets": [("≤ 1 % overhead (ratio ≤ 1.01)", r_b5, None if r_b5 is None else r_b5 <= 1.01)]}
    # B6
    b6_vals: list[float] = []
    for r in nb:
        if r.get("B6"):
            b6_vals.append(float(r["B6"]["median"]))
    b6_rows = [{"tool": "nbdist log() → widget model (median per round)", "text": _fmt_s(b6_vals, "ms")}]
    if nb and nb[-1].get("B6"):
        last = nb[-1]["B6"]
        b6_rows.append({"tool": "last round: records, p90, max", "text":
                        f"{last['n']} records, p90 {1e3 * last['p90']:.0f} ms, max {1e3 * last['max']:.0f} ms "
                        f"(telemetry_interval {last['telemetry_interval']} s)"})
    b6_med = statistics.median(b6_vals) if b6_vals else None
    figures["B6"] = {"title": "metric latency (rank log() timestamp → value in the client widget model)", "rows": b6_rows,
                     "targets": [("≤ 250 ms median", b6_med, None if b6_med is None else b6_med <= 0.25)]}
    nb_b7, nb_b8 = _pool(nb, "B7"), _pool(nb, "B8")
    figures["B7"] = {"title": "failure report time (rank 1 raises before a barrier → cell ended with the root cause)",
                     "rows": b7, "targets": [("≤ 2 s", statistics.median(nb_b7) if nb_b7 else None,
                                              None if not nb_b7 else statistics.median(nb_b7) <= 2.0)]}
    figures["B8"] = {"title": "interrupt time (stop button during the DDP loop → cell returned)", "rows": b8,
                     "targets": [("≤ 2 s", statistics.median(nb_b8) if nb_b8 else None,
                                  None if not nb_b8 else statistics.median(nb_b8) <= 2.0)]}
    nb_b9 = _pool(nb, "B9")
    left = sum(len((r.get("B9") or {}).get("left") or []) for r in nb)
    figures["B9"] = {"title": "`%dist_stop` seconds and processes left", "rows": b9,
                     "targets": [("≤ 3 s, 0 processes left", statistics.median(nb_b9) if nb_b9 else None,
                                  None if not nb_b9 else (statistics.median(nb_b9) <= 3.0 and left == 0))]}
    for fig, title in (("B10", "`%dist_restart` → first collective (issue 14: warm restart)"),
                       ("B11", "rank 1 SIGKILLed → `%dist_restart --dead` → first collective (issue 14)")):
        values = _pool(nb, fig, "median")
        figures[fig] = {"title": title, "rows": [{"tool": "nbdist", "values": values,
                                                  "text": _fmt_s(values, "s"), "notes": []}],
                        "targets": [("≤ 2 s on 4 ranks", statistics.median(values) if values else None,
                                     None if not values else statistics.median(values) <= 2.0)]}
    figures["_b9_left"] = {tool: [len((r.get("B9") or {}).get("left") or []) for r in runs.get(tool, [])] for tool in runs}
    figures["_peers"] = peers
    return figures


def _fmt_rate(values: list[float]) -> str:
    med = statistics.median(values)
    text = f"{med:.2f} steps/s"
    if len(values) > 1:
        text += f" ({min(values):.2f}–{max(values):.2f}, n={len(values)})"
    return text


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = psutil.virtual_memory().total / 2**30
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs (shared), {mem:.0f} GiB, {platform.platform()}"


def render(data: Collected, settings: Settings) -> str:
    figs = build_rows(data)
    versions: dict[str, dict[str, str]] = {}
    for tool, runs in data.runs.items():
        if runs:
            versions[tool] = runs[-1].get("versions", {})
    when = datetime.datetime.fromtimestamp(data.started, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = ", ".join(f"{a:.1f}" for a, _b, _c in data.load)
    lines = [
        "# nbdist benchmarks beside its peers",
        "",
        f"Generated by `{settings.command}` on {when}; {data.seconds / 60:.1f} min. "
        "Regenerate with the same command (see docs/BENCHMARKS.md).",
        "",
        f"- **machine**: {_machine()}; CPU only (no GPU in this run: the NCCL figures of issue 7 item 4 need one)",
        f"- **load average (1 min) before, after each tool, after**: {loads} — other work shared these cores, "
        "so absolute times are noisy; compare ratios measured in the same run",
        f"- **setup**: {settings.ranks} CPU ranks (gloo), {settings.threads} thread(s) per rank for every tool; "
        f"{settings.rounds} round(s), tools one at a time in rotated order; B2/B3: {settings.reps} timed cells per "
        f"round after 3 untimed; values are medians (min–max, n); a peer still blocked after {settings.cap:g} s is "
        "shown as '> cap' and stopped by PID",
        "- **versions**: " + "; ".join(f"{tool}: " + ", ".join(f"{k} {v}" for k, v in vs.items())
                                       for tool, vs in versions.items()),
        "",
        "## Targets (issues 7 and 14)",
        "",
        "| figure | target | nbdist | verdict |",
        "| --- | --- | --- | --- |",
    ]
    for fig in FIGURE_ORDER:
        for label, value, ok in figs[fig]["targets"]:
            if value is None:
                shown = "—"
            elif fig in ("B1", "B2", "B3", "B4", "B5"):
                shown = f"{value:.2f}×" if fig != "B5" else f"{value:.3f}"
            elif fig in ("B10", "B11"):
                shown = f"{value:.2f} s"
            elif fig == "B6":
                shown = f"{1e3 * value:.0f} ms"
            else:
                shown = f"{value:.2f} s"
            lines.append(f"| {fig} | {label} | {shown} | {_verdict(ok)} |")
    lines.append("")
    for fig in FIGURE_ORDER:
        info = figs[fig]
        lines += [f"## {fig}: {info['title']}", "", "| tool | median (min–max, n) | nbdist ÷ tool | notes |",
                  "| --- | --- | --- | --- |"]
        mine = None
        for row in info["rows"]:
            if row["tool"] == "nbdist":
                mine = row.get("values")
        for row in info["rows"]:
            values = row.get("values")
            ratio = ""
            if mine and values and row["tool"] != "nbdist":
                ratio = f"{statistics.median(mine) / statistics.median(values):.2f}"
            notes = "; ".join(sorted(set(row.get("notes") or [])))
            if fig == "B9" and row["tool"] in figs["_b9_left"]:
                notes = (notes + "; " if notes else "") + "left after stop: " + ", ".join(map(str, figs["_b9_left"][row["tool"]]))
            lines.append(f"| {row['tool']} | {row['text']} | {ratio} | {notes} |")
        lines.append("")
    extra = _extra_notes(data)
    if extra:
        lines += ["## Notes from this run", "", *extra, ""]
    return "\n".join(lines)


FIGURE_ORDER = ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8", "B9", "B10", "B11")


def split_sections(text: str) -> list[str]:
    """The file's head and its '## ' sections, each with its own heading and trailing text."""
    parts: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("## ") or not parts:
            parts.append(line)
        else:
            parts[-1] += line
    return parts


def kept_sections(old_text: str) -> str:
    """Sections other scripts wrote into RESULTS.md (scale, straggler cost...): a full run
    regenerates its own sections and keeps theirs."""
    own = ("## Targets", "## Notes from this run", *(f"## {fig}:" for fig in FIGURE_ORDER))
    keep = [part for part in split_sections(old_text)[1:] if not part.startswith(own)]
    return "".join(keep)


def _extra_notes(data: Collected) -> list[str]:
    notes = []
    for run in data.runs.get("nbdist", []):
        b8 = run.get("B8") or {}
        if b8.get("dead_ranks"):
            notes.append(f"- nbdist B8: rank(s) {b8['dead_ranks']} died after the interrupt "
                         f"({b8.get('next_cell_error', '')[:120]}); the run restarted the cluster")
        b7 = run.get("B7") or {}
        if b7 and not b7.get("root_cause_shown", True):
            notes.append("- nbdist B7: the root cause (rank 1's RuntimeError) was not shown first")
        if b7.get("dead_ranks"):
            notes.append(f"- nbdist B7: rank(s) {b7['dead_ranks']} were killed by the ladder "
                         f"(actions: {'; '.join(b7.get('actions', []))[:300]})")
        if b8.get("actions"):
            notes.append(f"- nbdist B8 actions: {'; '.join(b8['actions'])[:400]}")
    for tool in ("jupyter-distributed", "nbdistributed"):
        for run in data.runs.get(tool, []):
            if "B1_start_only" in run:
                notes.append(f"- {tool}: kernels alone started in {run['B1_start_only']:.2f} s (before torch "
                             "and the process group)")
                break
    notes += [f"- {r}" for r in data.reaped]
    notes += [f"- failure: {f[:300]}" for f in data.failures]
    return notes


def parse(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, 5 cells per series, short loops")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--ranks", type=int)
    parser.add_argument("--train-steps", type=int)
    parser.add_argument("--cap", type=float)
    parser.add_argument("--tools", help=f"comma list of {', '.join(TOOLS)}")
    parser.add_argument("--figures", help="comma list of B1..B11 (B1 and B9 always run)")
    parser.add_argument("--no-torchrun", action="store_true")
    parser.add_argument("--no-b5", action="store_true")
    parser.add_argument("--no-install", action="store_true", help="do not create .bench-venv; skip peers that need it")
    parser.add_argument("--out", help="where to write the table (default tests/benchmarks/RESULTS.md)")
    parser.add_argument("--json", help="also write the raw measurements here")
    parser.add_argument("--from-json", help="only re-render the table from measurements saved with --json")
    args = parser.parse_args(argv)
    s = Settings()
    if args.quick:
        s.rounds, s.reps, s.train_steps, s.cap, s.b5_steps, s.b5_rounds = 1, 5, 8, 15.0, 10, 3
    for name in ("rounds", "reps", "ranks", "train_steps", "cap"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    if args.tools:
        s.tools = tuple(t.strip() for t in args.tools.split(",") if t.strip())
        unknown = set(s.tools) - set(TOOLS)
        if unknown:
            parser.error(f"unknown tool(s): {sorted(unknown)}")
    if args.figures:
        s.figures = args.figures
    s.torchrun = not args.no_torchrun
    s.b5 = not args.no_b5
    s.install = not args.no_install
    if args.out:
        s.out = args.out
    s.json_out = args.json
    s.from_json = args.from_json
    s.command = ".venv/bin/python -m tests.benchmarks.run" + ("".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    return s


def main(argv: list[str] | None = None) -> int:
    settings = parse(argv)

    def say(msg: str) -> None:
        print(f"[bench] {msg}", flush=True)

    if not settings.from_json and any(t in PEER_VENV_TOOLS for t in settings.tools):
        if settings.install:
            ensure_bench_venv(say)
        elif not os.path.exists(BENCH_PY):
            settings.tools = tuple(t for t in settings.tools if t not in PEER_VENV_TOOLS)
            say("no .bench-venv and --no-install: skipping jupyter-distributed and nbdistributed")
    if settings.from_json:
        data = Collected(**json.loads(Path(settings.from_json).read_text()))
    else:
        data = collect(settings, say)
    if settings.json_out:  # first: a table bug must never lose a 20-minute run
        Path(settings.json_out).write_text(json.dumps(data.__dict__, indent=1, default=str))
    text = render(data, settings)
    kept = kept_sections(Path(settings.out).read_text()) if os.path.exists(settings.out) else ""
    Path(settings.out).write_text(text + "\n" + ("\n" + kept if kept else ""))
    say(f"wrote {settings.out}")
    print(text.split("## B1")[0])
    return 0 if not data.failures else 1


if __name__ == "__main__":
    sys.exit(main())
