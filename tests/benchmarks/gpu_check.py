"""The parts of .ci/gpu-check that are Python: the share-gpu proof, the DDP/FSDP2 step beside
torchrun, the tutorials as NCCL ranks sharing the GPU, and the report (the next section of
docs/GPU_CHECKS.md, tests/benchmarks/GPU_RESULTS.md), each writing under OUT.

    python3 -m tests.benchmarks.gpu_check proof|results|tutorials|report OUT DEADLINE

DEADLINE is a Unix time: a part starts nothing that could not end before it. Every figure comes
from the files the parts write; nothing is filled in by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEP = ROOT / "tests" / "benchmarks" / "gpu_step.py"
READY = re.compile(r"(\d+) rank\(s\) ready \((\w+)\)")
SHARED = re.compile(r"(\d+) ranks share (cuda:\d+)")

PROOF_CELL = """
import os, time
t = torch.ones(1, device=device) * (rank + 1)
dist.all_reduce(t)
big = torch.ones(16 * 2**20, device=device)
dist.all_reduce(big)
torch.cuda.synchronize()
started = time.perf_counter()
for _ in range(5):
    dist.all_reduce(big)
torch.cuda.synchronize()
ms = (time.perf_counter() - started) / 5 * 1000
(float(t), float(big[0]), str(device), str(dist.get_backend()), os.environ.get('NCCL_HOSTID'),
 os.environ.get('NCCL_NET'), round(ms, 1))
"""


def _left(deadline: float, reserve: float = 0.0) -> float:
    return deadline - time.time() - reserve


def proof(out: Path, deadline: float) -> int:
    """Two ranks sharing GPU 0, NCCL between them: all_reduce of 1 and of 64 MiB (x6)."""
    from nbdist import Cluster

    lines: list[str] = []
    ok = False
    cluster = Cluster(n=2, share_gpu=True)
    try:
        cluster.start(progress=lines.append)
        lines.append(f"started in {cluster.start_seconds:.1f} s, backend {cluster.backend}")
        result = cluster.run(PROOF_CELL, timeout=max(10.0, _left(deadline, 10)))
        for rank in range(cluster.world_size):
            lines.append(f"rank {rank}: {result.value_text(rank) or result.errors.get(rank)}")
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20)
        lines.append("nvidia-smi compute apps (pid, used): " + apps.stdout.strip().replace(
            "\n", "; "))
        pids = {str(p.pid) for p in cluster.ranks}
        values = [eval(result.value_text(r)) for r in range(2)] if result.ok else []  # noqa: S307
        # a container's nvidia-smi may list host PIDs: said, not part of the verdict
        lines.append(f"ranks' PIDs {sorted(pids)} listed by nvidia-smi: "
                     f"{all(pid in apps.stdout for pid in pids)}")
        ok = (len(values) == 2 and all(v[0] == 3.0 and v[1] == 64.0 for v in values)
              and {v[2] for v in values} == {"cuda:0"} and len({v[4] for v in values}) == 2
              and all("nccl" in v[3] for v in values))
    except Exception as error:  # the proof's answer is this file: every failure goes in it
        lines.append(f"FAILED: {type(error).__name__}: {error}")
    finally:
        cluster.stop()
    lines.append("proof: " + ("ok" if ok else "FAILED"))
    (out / "proof.txt").write_text("\n".join(map(str, lines)) + "\n")
    print("\n".join(map(str, lines)))
    return 0 if ok else 1


def _torchrun(nproc: int, strategy: str, steps: list[str], out: Path, limit: float) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(STEP), strategy, "--out",
               str(out / "steps.jsonl"), *steps]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(limit, 1))
        return f"torchrun x{nproc} {strategy}: exit {done.returncode}\n{done.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        return f"torchrun x{nproc} {strategy}: stopped after {limit:.0f} s"


def _nbdist(n: int, share: bool, out: Path, deadline: float, steps: list[str]) -> str:
    from nbdist import Cluster

    log = []
    cluster = Cluster(n=n, share_gpu=share)
    try:
        cluster.start()
        for strategy in ("ddp", "fsdp2"):
            result = cluster.run_script(str(STEP), [strategy, "--out", str(out / "steps.jsonl"),
                                                    *steps], timeout=max(5, _left(deadline, 5)))
            log.append(f"nbdist x{n} {strategy}: {'ok' if result.ok else result.errors}")
    except Exception as error:
        log.append(f"nbdist x{n}: {type(error).__name__}: {error}")
    finally:
        cluster.stop()
    return "\n".join(log)


def results(out: Path, deadline: float) -> int:
    """A DDP and an FSDP2 step in nbdist and under torchrun: one rank per GPU, and where there is
    one GPU, two ranks sharing it too."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        (out / "results.log").write_text("no CUDA GPU: no step to time\n")
        return 1
    plans = [(gpus, False, ["--steps", "20", "--warmup", "5"])]
    if gpus == 1:
        plans.append((2, True, ["--steps", "10", "--warmup", "3"]))
    with (out / "results.log").open("a") as log:  # line by line: the part may be stopped
        for n, share, steps in plans:
            for strategy in ("ddp", "fsdp2"):
                said = _torchrun(n, strategy, steps, out, min(90.0, _left(deadline, 30)))
                print(said, file=log, flush=True)
                print(said, flush=True)
            said = _nbdist(n, share, out, deadline, steps)
            print(said, file=log, flush=True)
            print(said, flush=True)
    return 0


def one_notebook(path: Path, record: Path) -> None:
    """Run one tutorial (its own process: the caller can stop it at the budget's end)."""
    import tempfile

    from tests.test_notebooks import check_tagged_cells_raised, run_notebook

    row: dict[str, Any] = {"name": path.stem}
    try:
        nb, seconds = run_notebook(path, Path(tempfile.mkdtemp(prefix="nbdist-nb-")))
        check_tagged_cells_raised(nb, path.stem)
        text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                         for o in c.outputs if o.get("output_type") == "stream")
        row.update(ok=True, seconds=round(seconds, 1),
                   started=[f"{n} {backend}" for n, backend in READY.findall(text)],
                   shared=sorted({f"{n} on {d}" for n, d in SHARED.findall(text)}))
    except Exception as error:
        message = str(error)
        row.update(ok=False, error=f"{type(error).__name__}: {message[:800]} [...] "
                                   f"{message[-1200:]}")
    with record.open("a") as file:
        file.write(json.dumps(row) + "\n")


def tutorials(out: Path, deadline: float, wanted: list[str]) -> int:
    """Every tutorial with NBDIST_SHARE_GPU=1: its `-n 2` as NCCL ranks sharing the GPU."""
    from tests.test_notebooks import NOTEBOOKS, missing_packages

    record = out / "tutorials.jsonl"
    env = {**os.environ, "NBDIST_SHARE_GPU": "1"}
    for path in NOTEBOOKS:
        if wanted and not any(path.stem.startswith(prefix) for prefix in wanted):
            continue
        left = _left(deadline)
        row: dict[str, Any] = {"name": path.stem, "ok": False}
        if missing_packages(path):
            row["error"] = f"skipped, needs {missing_packages(path)}"
        elif left < 45:
            row["error"] = "not started: the check's time was spent"
        else:
            started = time.time()
            child = subprocess.Popen([sys.executable, "-m", "tests.benchmarks.gpu_check",
                                      "one-notebook", str(path), str(record)], env=env, cwd=ROOT)
            try:
                child.wait(timeout=left)
                print(f"{path.stem}: {time.time() - started:.0f} s", flush=True)
                continue
            except subprocess.TimeoutExpired:
                child.kill()  # its kernel and engines end once their parent is gone
                child.wait()
                row["error"] = f"stopped after {left:.0f} s: the check's time was spent"
        with record.open("a") as file:
            file.write(json.dumps(row) + "\n")
    late = [row["name"][:2] for row in _rows(record) if "time was spent" in row.get("error", "")]
    if late:
        print(f'not reached; rerun: PARTS="tutorials report" NOTEBOOKS="{" ".join(late)}" '
              "bash .ci/gpu-check")
    return 0


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _junit(path: Path) -> tuple[dict[str, int], list[str]]:
    """Counts by outcome and each failure's test name and first line, from pytest's junit xml."""
    import xml.etree.ElementTree as ElementTree

    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[str] = []
    if not path.is_file():
        return counts, ["no junit file: the tests did not finish (see gpu.log)"]
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append(f"{case.get('name')}: {(bad.get('message') or '')[:300]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures


def _one_line(error: str) -> str:
    """A tutorial's error in a table cell: the cell's own error line where nbclient gives one."""
    stderr = error.split("----- stderr -----", 1)
    text = " ".join((stderr[1] if len(stderr) > 1 else error).split()).split(" -----")[0]
    return text[:400].replace("|", "\\|")


def _mib(value: Any) -> str:
    return "-" if value is None else f"{int(value) / 2**20:,.0f} MiB"


def results_table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| launcher | step | ranks | GPU shared | backend | ms/step (median) | min | torch "
            "peak | NVML, rank 0 |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['launcher']} | {r['strategy']} | {r['world_size']} | "
                     f"{'yes' if r['shared_gpu'] else 'no'} | {r['backend']} | "
                     f"{r['ms_per_step']} | {r['ms_min']} | {_mib(r['peak_allocated'])} | "
                     f"{_mib(r['nvml_process'])} |")
    return lines


def report(out: Path, stamp: str) -> int:
    """The next section of docs/GPU_CHECKS.md and of GPU_RESULTS.md, from the parts' files,
    written into the tree here and copied to OUT (only OUT comes back from a lent machine)."""
    env = (out / "env.txt").read_text() if (out / "env.txt").is_file() else "(no env.txt)\n"
    counts, failures = _junit(out / "gpu.xml")
    notebooks = _rows(out / "tutorials.jsonl")
    steps = _rows(out / "steps.jsonl")
    section = [f"## {stamp}: .ci/gpu-check (generated from its files; edit the findings in)", "",
               "```", env.strip(), "```", "", "### The share-gpu proof", "", "```",
               ((out / "proof.txt").read_text().strip() if (out / "proof.txt").is_file()
                else "(no proof.txt)"), "```", "",
               f"### gpu-marked tests: {counts['passed']} passed, {counts['failed']} failed, "
               f"{counts['skipped']} skipped", ""]
    section += [f"- {line}" for line in failures] + [""] if failures else []
    section += ["### Tutorials, `-n 2` as NCCL ranks sharing the GPU (NBDIST_SHARE_GPU=1)", "",
                "| tutorial | result | seconds | clusters started | shared |",
                "| --- | --- | --- | --- | --- |"]
    for row in notebooks:
        result = "ok" if row.get("ok") else _one_line(row.get("error", "failed"))
        section.append(f"| {row['name']} | {result} | {row.get('seconds', '-')} | "
                       f"{', '.join(row.get('started', [])) or '-'} | "
                       f"{', '.join(row.get('shared', [])) or '-'} |")
    section += ["", "### A DDP and an FSDP2 step (tests/benchmarks/GPU_RESULTS.md)", ""]
    section += results_table(steps) + [""]
    _insert_section(ROOT / "docs" / "GPU_CHECKS.md", section)
    _write_results(steps, stamp)
    for name in ("docs/GPU_CHECKS.md", "tests/benchmarks/GPU_RESULTS.md"):
        (out / Path(name).name).write_text((ROOT / name).read_text())
    print("\n".join(section))
    return 0


def _insert_section(path: Path, section: list[str]) -> None:
    """Newest first: before the page's first dated section."""
    text = path.read_text()
    at = text.find("\n## ")
    at = len(text) if at < 0 else at + 1
    path.write_text(text[:at] + "\n".join(section) + "\n" + text[at:])


def _write_results(steps: list[dict[str, Any]], stamp: str) -> None:
    path = ROOT / "tests" / "benchmarks" / "GPU_RESULTS.md"
    first = steps[0] if steps else {}
    versions = ", ".join(f"{key} {first.get(key)}" for key in
                         ("device", "torch", "cuda", "nccl", "driver")) if first else "no rows"
    _insert_section(path, [f"## {stamp}", "", versions, "", *results_table(steps), ""])


def main() -> int:
    part, out = sys.argv[1], Path(sys.argv[2])
    if part == "one-notebook":
        one_notebook(out, Path(sys.argv[3]))
        return 0
    deadline = float(sys.argv[3]) if len(sys.argv) > 3 else time.time() + 600
    out.mkdir(parents=True, exist_ok=True)
    if part == "proof":
        return proof(out, deadline)
    if part == "results":
        return results(out, deadline)
    if part == "tutorials":
        return tutorials(out, deadline, sys.argv[4:])
    if part == "report":
        return report(out, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    raise SystemExit(f"unknown part {part!r}: proof, results, tutorials, report")


if __name__ == "__main__":
    sys.exit(main())
