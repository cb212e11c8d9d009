"""Shared pieces of the per-tool benchmark drivers: cells, timing, process bookkeeping, output.

Every driver runs in its own process (the project's ``.venv`` or the peers' ``.bench-venv``),
measures what its tool can do, and prints one ``NBDIST_BENCH {json}`` line. It also lists every PID
its tool started so the orchestrator can verify (and, if needed, finish) the clean-up by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NOOP = "pass"
ALL_REDUCE = "_bench_t = torch.ones(1000)\ndist.all_reduce(_bench_t)"
RAISE_BEFORE_BARRIER = (
    "if rank == 1:\n    raise RuntimeError('benchmark: rank 1 fails before the barrier')\n"
    "dist.barrier()"
)
CAP_SECONDS = 20.0
"""A peer still blocked after this long (B7, B8) is reported as '> cap' and its cluster abandoned."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=50, help="cells per B2/B3 series")
    parser.add_argument("--figures", default="B1,B2,B3,B4,B6,B7,B8,B9")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--cap", type=float, default=CAP_SECONDS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--restarts", type=int, default=3, help="B10/B11 samples per run")
    return parser.parse_args(argv)


def figures(args: argparse.Namespace) -> set[str]:
    return {f.strip().upper() for f in args.figures.split(",") if f.strip()}


def series(fn: Callable[[], Any], reps: int, warmup: int = 3) -> list[float]:
    """Seconds per call of `fn`, after a few untimed calls."""
    for _ in range(min(warmup, reps)):
        fn()
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def summary(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "n": len(samples), "samples": [round(x, 6) for x in samples]}


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Swallow what the tool prints (progress lines, tables) while timing."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


def descendants() -> list[tuple[int, float]]:
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append((child.pid, child.create_time()))
    return out


def alive(pids: list[tuple[int, float]]) -> list[int]:
    """Which of these recorded processes still exist (zombies count as gone)."""
    import psutil

    out = []
    for pid, ct in pids:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - ct) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def interrupt_main_after(seconds: float) -> dict[str, float]:
    """The stop button: KeyboardInterrupt in the main thread after `seconds`; records when."""
    import _thread
    import signal

    # a process started in the background (nohup ... &) inherits SIGINT ignored, and then
    # interrupt_main does nothing: restore Python's own handler, as in a notebook kernel
    signal.signal(signal.SIGINT, signal.default_int_handler)
    when: dict[str, float] = {}

    def fire() -> None:
        when["t"] = time.perf_counter()
        _thread.interrupt_main()

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return when


def emit(result: dict[str, Any]) -> None:
    # the real stdout: a capped cell may still hold a redirect on another thread
    stream = sys.__stdout__
    stream.write("NBDIST_BENCH " + json.dumps(result) + "\n")
    stream.flush()


def versions(*names: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def write_section(results: Path, heading: str, section: str) -> None:
    """Put `section` into the results file in place of the one under `heading` (up to the next
    "## " heading), or after the rest; every other section is kept as it is."""
    current = results.read_text() if results.exists() else ""
    pattern = re.compile(re.escape(heading) + r".*?(?=\n## |\Z)", re.S)
    body = section.rstrip() + "\n"
    if pattern.search(current):
        updated = pattern.sub(lambda _: body, current)
    else:
        updated = current.rstrip() + "\n\n" + body
    results.write_text(updated)
