"""Run one cell with torch.profiler on every rank (`%%distributed --profile [PATH]`): start the
profilers, run the cell as usual, always stop them, and merge what comes back into one report."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from nbdist.cells.execute import run_cell
from nbdist.cells.output import OutputSink
from nbdist.cells.result import CellResult
from nbdist.errors import NbdistError
from nbdist.profiler import ProfileReport, build_report

if TYPE_CHECKING:
    from nbdist.cluster import ClusterCore

CONTROL_TIMEOUT = 30.0
"""Seconds to start the ranks' profilers, and to stop them and bring the captures back."""


def check_trace_path(path: str | os.PathLike[str] | bool | None) -> str | None:
    """The trace file to write (None: none), checked before anything runs: its folder must exist
    and be writable, and it must not be a folder itself."""
    if path is None or isinstance(path, bool):
        return None
    text = os.path.abspath(os.path.expanduser(os.fspath(path)))
    folder = os.path.dirname(text)
    if os.path.isdir(text):
        raise NbdistError(
            f"--profile {path}: is a folder; give a file name, e.g. {path}/trace.json"
        )
    if not os.path.isdir(folder):
        raise NbdistError(f"--profile {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise NbdistError(f"--profile {path}: folder {folder} is not writable")
    return text


def run_profiled(cluster: ClusterCore, code: str, ranks: list[int] | None,
                 timeout: float | None, sink: OutputSink | None,
                 path: str | os.PathLike[str] | bool | None = None
                 ) -> tuple[CellResult, ProfileReport]:
    """The cell's result and the merged profile (written to `path` as a Chrome trace if given).
    A rank whose profiler did not start or whose capture did not come back is named in the
    report's `missing`; the cell's own errors are in the result, as without --profile."""
    trace_path = check_trace_path(path)
    targets = cluster.targets(ranks)
    started = cluster.call("profile.start", ranks=targets, timeout=CONTROL_TIMEOUT)
    if started.failures:
        _collect(cluster, list(started.results))
        rank = min(started.failures)
        raise NbdistError(f"--profile: the profiler did not start on rank {rank}: "
                          f"{started.failures[rank]}")
    try:
        result = run_cell(cluster, code, ranks=targets, timeout=timeout, sink=sink)
    finally:
        captures, missing = _collect(cluster, targets)
    report = build_report(captures, missing=missing)
    if trace_path is not None and captures:
        report.write_trace(trace_path)
        report.trace_path = str(path)  # as the user wrote it
    return result, report


def _collect(cluster: ClusterCore, targets: list[int]) -> tuple[list[dict], dict[int, str]]:
    """Stop the profilers on the live targets; their captures, and why any rank has none."""
    gathered = cluster.call("profile.stop", ranks=targets, timeout=CONTROL_TIMEOUT)
    missing = dict(gathered.failures)  # a rank that died during the cell is not waited for
    captures = _captures(gathered.results, missing, "no profiler was running there")
    return captures, missing


def _captures(results: dict[int, Any], missing: dict[int, str], none_reason: str) -> list[dict]:
    """The ranks' captures tagged with their rank; a rank that returned none goes to `missing`."""
    captures = []
    for rank, capture in results.items():
        if capture is None:
            missing[rank] = none_reason
        else:
            captures.append({**capture, "rank": rank})
    return captures


def collect_last_profile(cluster: ClusterCore, ranks: list[int] | None,
                         path: str | os.PathLike[str] | None = None) -> ProfileReport:
    """Merge the captures the ranks' last `with nbdist.profile():` blocks left behind."""
    trace_path = check_trace_path(path)
    targets = cluster.targets(ranks)
    gathered = cluster.call("profile.last", ranks=targets, timeout=CONTROL_TIMEOUT)
    missing = dict(gathered.failures)
    captures = _captures(gathered.results, missing,
                         "nothing profiled there yet (use `with nbdist.profile():` in a cell)")
    if not captures:
        raise NbdistError("no rank has a profile: " + "; ".join(
            f"rank {r}: {why}" for r, why in sorted(missing.items())))
    return build_report(captures, missing=missing, trace_path=trace_path)
