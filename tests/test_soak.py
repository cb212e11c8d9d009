"""The seeded fault soak (issue 20; docs/FAULTS.md, "The soak"): one real kernel driven through
jupyter_client, 4 gloo ranks, faults drawn at random from a seed; after each, the report was
specific, the named command brought the cluster back, the next collective worked, the kernel's
trained model was intact and no process was orphaned; over the soak, no leak.

    .venv/bin/python -m pytest -q -m soak          # 30 faults (.ci/run runs it), ~3 min
    .venv/bin/python -m pytest -q -m soakfull      # 200 faults, writes tests/benchmarks/SOAK_RESULTS.md
    NBDIST_SOAK_SEED=1234 ...                      # another draw; a failure prints its seed
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.soak.results import verdict, write_results
from tests.soak.runner import Soak

RESULTS = Path(__file__).parent / "benchmarks" / "SOAK_RESULTS.md"
FULL_SOAK_BUDGET = 20 * 60  # issue 20: >= 200 faults in <= 20 minutes


def _seed(default: int) -> int:
    return int(os.environ.get("NBDIST_SOAK_SEED", default))


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_short_soak_thirty_faults_nothing_lost(tmp_path):
    seed = _seed(20)
    report = Soak(seed, tmp_path).run(30)
    said = verdict(report)
    assert len(report.records) == 30, said
    assert not said.startswith("FAILED"), said


@pytest.mark.soakfull
@pytest.mark.timeout(FULL_SOAK_BUDGET + 600)
def test_full_soak_two_hundred_faults_in_twenty_minutes(tmp_path):
    seed = _seed(1)
    report = Soak(seed, tmp_path).run(200)
    said = write_results(report, RESULTS)
    assert len(report.records) == 200, said
    assert not said.startswith("FAILED"), said
    assert report.seconds <= FULL_SOAK_BUDGET, f"{report.seconds:.0f} s for 200 faults (seed {seed})"
