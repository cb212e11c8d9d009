"""Benchmarks B1–B9 of nbdist beside its peers (see README "Benchmarks" and RESULTS.md)."""
