"""The benchmark command in a tiny quick mode, so it never rots (the full run is documented, not CI).

Runs only what the project's .venv has (nbdist and raw ipyparallel, 2 ranks, 3 cells per series,
the in-process B5), writes the table to a temporary file and checks its shape, and that nothing
is left running. The peers in .bench-venv and torchrun are the full run's business.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.benchmarks import run as bench

ROOT = Path(__file__).resolve().parents[1]


def test_quick_mode_measures_and_writes_the_table(tmp_path: Path) -> None:
    out, raw = tmp_path / "RESULTS.md", tmp_path / "raw.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.run", "--quick", "--no-install",
         "--tools", "nbdist,ipyparallel", "--figures", "B1,B2,B3,B9", "--ranks", "2",
         "--reps", "3", "--no-torchrun", "--out", str(out), "--json", str(raw)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    for heading in ("## Targets (issues 7 and 14)", "## B1:", "## B2:", "## B5:", "## B9:"):
        assert heading in text
    data = json.loads(raw.read_text())
    nb = data["runs"]["nbdist"][0]
    assert nb["B1"]["seconds"] > 0 and nb["B2"]["n"] == 3 and nb["B3"]["n"] == 3
    assert nb["B9"]["left"] == [], "nbdist left processes behind after %dist_stop"
    assert data["runs"]["ipyparallel"][0]["B2"]["n"] == 3
    assert data["b5"] and data["b5"][0]["ratio_cpu_paired"] > 0


def test_table_from_synthetic_measurements() -> None:
    """The table and the verdicts, without starting anything."""
    def sample(value: float) -> dict[str, object]:
        return {"median": value, "min": value, "max": value, "n": 1, "samples": [value]}

    data = bench.Collected(started=0.0, seconds=60.0, load=[(1.0, 1.0, 1.0)])
    data.runs = {
        "nbdist": [{"B1": {"seconds": 4.0}, "B2": sample(0.010), "B3": sample(0.012),
                    "B4": {"steps_per_s": 5.0}, "B6": {"median": 0.2, "min": 0.1, "max": 0.3, "n": 9,
                                                       "p90": 0.25, "telemetry_interval": 0.5},
                    "B7": {"seconds": 1.5, "root_cause_shown": True}, "B8": {"seconds": 1.0},
                    "B9": {"seconds": 1.0, "left": []}, "B10": sample(0.8), "B11": sample(2.5),
                    "versions": {"nbdist": "x"}}],
        "ipyparallel": [{"B1": {"seconds": 10.0}, "B2": sample(0.020), "B3": sample(0.024),
                         "B7": {"seconds": None, "cap": 20.0}, "B9": {"seconds": 2.0, "left": [1]}}],
    }
    data.torchrun = [{"steps_per_s": 5.0}]
    data.b5 = [{"ratio_cpu_paired": 1.004, "ratio_wall_paired": 1.01, "log_call_us": 0.5,
                "tick_us": 30.0}]
    text = bench.render(data, bench.Settings(command="test"))
    assert "| B1 | ≤ 0.25 × raw ipyparallel (issue 14) | 0.40× | **missed** |" in text
    assert "| B1 | faster than every peer (÷ the fastest) | 0.40× | met |" in text
    assert "| B10 | ≤ 2 s on 4 ranks | 0.80 s | met |" in text
    assert "| B11 | ≤ 2 s on 4 ranks | 2.50 s | **missed** |" in text
    assert "| B2 | ≤ 0.8 × raw `view.execute` | 0.50× | met |" in text
    assert "| B4 | ≥ 0.97 × torchrun | 1.00× | met |" in text
    assert "> 20.0 s (still blocked; stopped by PID)" in text
    assert "left after stop: 1" in text
    assert "| B5 | ≤ 1 % overhead (ratio ≤ 1.01) | 1.004 | met |" in text


def test_line_count_sorts_each_line_once() -> None:
    from tests.benchmarks.line_count import PACKAGES, Count, count_at

    source = ('"""Module doc,\non two lines."""\n\nimport os  # a comment after code\n\n\n'
              'def f() -> int:\n    """One line."""\n    # a comment alone\n    return 1\n'
              'g = lambda: "not a docstring"\n')
    count = Count()
    count.add(source)
    assert (count.total, count.docstring, count.comment, count.blank, count.code) == (11, 3, 1, 3, 4)
    tree = count_at(None)
    lines = sum(len(path.read_text().splitlines())
                for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    assert tree.total == lines == tree.code + tree.docstring + tree.comment + tree.blank
    assert tree.long_lines == 0  # ruff holds nbdist/ to 100 characters
