"""The soak's verdict and its figures as markdown: faults, time, broken recoveries, leaks."""

from __future__ import annotations

import os
import platform
import time
from collections import defaultdict
from pathlib import Path

from tests.soak.runner import SoakReport

RSS_GROWTH_LIMIT = 50 * 2**20  # issue 20: the kernel's RSS grows by at most 50 MB over the soak
THREADS_SLACK = 2  # after %dist_stop, the kernel's threads back to their count before the start, +-
FDS_SLACK = 8
ZMQ_SLACK = 2
LOG_BYTES_LIMIT = 20 * 2**20  # the cluster's files on disk (logs, connection files) at any moment


def leaks(report: SoakReport) -> list[str]:
    """Each bound the soak broke, in words (empty: no leak)."""
    found = []
    first, last = report.samples[0], report.samples[-1]
    if last.rss - first.rss > RSS_GROWTH_LIMIT:
        found.append(f"kernel RSS grew {(last.rss - first.rss) / 2**20:.0f} MB (limit 50 MB)")
    before, after = report.before_start, report.after_stop
    if before and after:
        if after.threads > before.threads + THREADS_SLACK:
            found.append(f"kernel threads {before.threads} before the start, {after.threads} after %dist_stop "
                         f"(Python threads then: {', '.join(after.thread_names)})")
        if after.fds > before.fds + FDS_SLACK:
            found.append(f"kernel fds {before.fds} before the start, {after.fds} after %dist_stop")
        if after.zmq > before.zmq + ZMQ_SLACK:
            found.append(f"kernel ZMQ sockets {before.zmq} before the start, {after.zmq} after %dist_stop")
    biggest = max(s.log_bytes for s in report.samples)
    if biggest > LOG_BYTES_LIMIT:
        found.append(f"the cluster's files reached {biggest / 2**20:.1f} MB on disk (limit 20 MB)")
    return found


def verdict(report: SoakReport) -> str:
    broken, leaked = report.broken, leaks(report)
    if broken or leaked or report.start_problems:
        lines = [f"FAILED: soak seed {report.seed}: {len(broken)} broken recoveries of "
                 f"{len(report.records)} faults; reproduce with --seed {report.seed}"]
        lines += [f"  #{r.index} {r.fault} ({r.detail}): {p}" for r in broken for p in r.problems]
        lines += [f"  leak: {x}" for x in leaked] + [f"  {p}" for p in report.start_problems]
        return "\n".join(lines)
    return (f"ok: soak seed {report.seed}: {len(report.records)} faults in {report.seconds:.0f} s, "
            "0 broken recoveries, no leak")


def _table(report: SoakReport) -> list[str]:
    by_fault = defaultdict(list)
    for record in report.records:
        by_fault[record.fault].append(record)
    rows = ["| fault | count | broken | restarts | fault cell, mean s | recovery, mean s | recovery, worst s "
            "| kernel RSS change, total MB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, records in sorted(by_fault.items()):
        rec = [r.recovery_seconds for r in records]
        rows.append(f"| {name} | {len(records)} | {sum(bool(r.problems) for r in records)} | "
                    f"{sum(r.restarted for r in records)} | {sum(r.seconds for r in records) / len(records):.2f} | "
                    f"{sum(rec) / len(rec):.2f} | {max(rec):.2f} | {sum(r.rss_delta for r in records) / 2**20:+.1f} |")
    return rows


def _leak_rows(report: SoakReport) -> list[str]:
    first, last = report.samples[0], report.samples[-1]
    before, after = report.before_start, report.after_stop
    peak = max(report.samples, key=lambda s: s.rss)
    zmq = [s.zmq for s in report.samples if s.zmq >= 0]
    rows = ["| measure | before %dist_start | after the start | after the last fault | after %dist_stop | bound |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    if before and after:
        rows += [
            f"| kernel threads | {before.threads} | {first.threads} | {last.threads} | {after.threads} | "
            f"after stop <= before + {THREADS_SLACK} |",
            f"| kernel fds | {before.fds} | {first.fds} | {last.fds} | {after.fds} | after stop <= before + {FDS_SLACK} |",
            f"| kernel ZMQ sockets | {before.zmq} | {first.zmq} | max {max(zmq)} | {after.zmq} | "
            f"after stop <= before + {ZMQ_SLACK} |",
            f"| kernel RSS MB | {before.rss / 2**20:.0f} | {first.rss / 2**20:.0f} | {last.rss / 2**20:.0f} "
            f"(peak {peak.rss / 2**20:.0f}) | {after.rss / 2**20:.0f} | growth <= 50 MB |",
            f"| cluster files on disk MB | - | {first.log_bytes / 2**20:.2f} | max "
            f"{max(s.log_bytes for s in report.samples) / 2**20:.2f} | - | <= 20 MB |",
        ]
    return rows


def write_results(report: SoakReport, path: Path) -> str:
    """Write the markdown figures to `path`; return the verdict line(s)."""
    said = verdict(report)
    recoveries = [r.recovery_seconds for r in report.records] or [0.0]
    lines = [
        "# Fault soak results (issue 20)", "",
        f"Written by `.venv/bin/python -m tests.soak --faults {len(report.records)} --seed {report.seed}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPU cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end. One real kernel (jupyter_client), 4 gloo ranks, "
        "faults drawn from the seed; after each: the report named the rank and what happened, the one "
        "command it named (if any) was run, the next all_reduce worked, the kernel's trained model was "
        "intact, the process tree held no orphan. See docs/FAULTS.md, 'The soak'. The kernel's RSS is "
        "read after a gc.collect() there, with glibc's mmap threshold fixed (why: docs/FAULTS.md).", "",
        f"**{said.splitlines()[0]}**", "",
        f"- faults: {len(report.records)} in {report.seconds:.0f} s ({report.seconds / 60:.1f} min, "
        "including the kernel and cluster start)",
        f"- broken recoveries: {len(report.broken)}",
        f"- stop button in ipykernel's own window (the kernel finished the request without an "
        f"execute_reply, see tests/soak/kernel.py LOST_REPLY; checked like every fault after it): "
        f"{sum(r.lost_reply for r in report.records)}",
        f"- worst recovery (report to working collective): {max(recoveries):.1f} s", "",
        *_table(report), "", "## Leaks", "", *_leak_rows(report), "",
    ]
    if said.startswith("FAILED"):
        lines += ["## Failures", "", "```", said, "```", ""]
    path.write_text("\n".join(lines))
    return said
