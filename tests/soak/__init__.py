"""The seeded fault soak (docs/FAULTS.md, issue 20): a real kernel, 4 ranks, hundreds of faults.

    .venv/bin/python -m tests.soak --faults 200 --seed 1     # writes tests/benchmarks/SOAK_RESULTS.md
"""
