"""Benchmarks B1–B9 of nbdist beside its peers (see docs/BENCHMARKS.md and RESULTS.md)."""
