"""`python -m tests.soak --faults N --seed S [--budget SECONDS] [--results FILE]`: run the soak and
write its figures (faults, time, recoveries, leaks) to tests/benchmarks/SOAK_RESULTS.md."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from tests.soak.results import write_results
from tests.soak.runner import Soak


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak")
    parser.add_argument("--faults", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    parser.add_argument("--budget", type=float, default=None, help="stop drawing faults after S seconds")
    parser.add_argument("--results", default="tests/benchmarks/SOAK_RESULTS.md")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    print(f"soak: seed {seed} ({args.faults} faults); reproduce with --seed {seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nbdist-soak-") as workdir:
        report = Soak(seed, Path(workdir), log=lambda line: print(line, flush=True)).run(args.faults, args.budget)
    verdict = write_results(report, Path(args.results))
    print(verdict)
    return 0 if not verdict.startswith("FAILED") else 1


if __name__ == "__main__":
    sys.exit(main())
