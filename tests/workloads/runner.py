"""Helpers to run the workload scripts under torchrun and compare their losses.

The workloads in this folder are plain torchrun scripts in jupytext "percent"
format; the tests run each one three ways (torchrun, ``%dist_run``, and chunk by
chunk as ``%%distributed`` cells) and compare the per-rank losses.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: script name -> number of ranks the tests use
WORKLOADS: dict[str, int] = {
    "ddp.py": 2,
    "fsdp2_dcp.py": 2,
    "tensor_parallel.py": 2,
    "rpc_parameter_server.py": 4,
    "trainer_snapshot.py": 2,
    "lightning_fabric.py": 2,
    "lightning_trainer.py": 2,
}

_MARKER = "# %%"
_LOSS_FILE = re.compile(r"^losses-rank(\d+)\.json$")


def workload_path(name: str) -> Path:
    """Absolute path of a workload script in this folder."""
    return HERE / name


def split_cells(path: str | os.PathLike[str]) -> list[str]:
    """Split a jupytext "percent" script into its cells.

    A line starting with ``# %%`` starts a new cell (the marker line is dropped);
    the text before the first marker is a cell too.  Cells that are empty or
    only whitespace are dropped.
    """
    text = Path(path).read_text(encoding="utf-8")
    cells: list[list[str]] = [[]]
    for line in text.splitlines(keepends=True):
        if line.startswith(_MARKER):
            cells.append([])
        else:
            cells[-1].append(line)
    out = ["".join(lines).strip("\n") + "\n" for lines in cells]
    return [c for c in out if c.strip()]


def run_torchrun(
    script: str | os.PathLike[str],
    nproc: int,
    args: Sequence[str] = (),
    out_dir: str | os.PathLike[str] = ".",
    timeout: float = 120.0,
) -> None:
    """Run ``script`` under ``torchrun --standalone`` with ``nproc`` ranks.

    The environment gets ``OMP_NUM_THREADS=1`` and ``NBDIST_WORKLOAD_OUT=out_dir``
    (the workloads' default ``--out``).  ``--standalone`` binds the rendezvous to
    localhost only.  Raises ``RuntimeError`` with the tail of the output when the
    run fails or times out.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *[str(a) for a in args],
    ]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["NBDIST_WORKLOAD_OUT"] = str(out)
    for attempt in (1, 2):
        proc = _torchrun_once(cmd, env, script, timeout)
        if proc.returncode == 0:
            return
        # torch's exit-time abort (a C++ thread still joinable at exit) comes after the script
        # finished; it is not what the tests compare, so it gets one more run, said on stderr
        if attempt == 1 and EXIT_ABORT in proc.stdout:
            print(f"run_torchrun: {Path(script).name} aborted at exit ({EXIT_ABORT!r}); "
                  "running it once more", file=sys.stderr)
            continue
        raise RuntimeError(
            f"torchrun {Path(script).name} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}"
        )


EXIT_ABORT = "terminate called without an active exception"


def _torchrun_once(cmd: list[str], env: dict[str, str], script: str | os.PathLike[str],
                   timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (
            exc.output
            if isinstance(exc.output, str)
            else (exc.output or b"").decode(errors="replace")
        )
        raise RuntimeError(
            f"torchrun {Path(script).name} timed out after {timeout}s:\n{tail[-4000:]}"
        ) from exc


def read_losses(out_dir: str | os.PathLike[str]) -> dict[int, list[float]]:
    """Read every ``losses-rank{r}.json`` in ``out_dir``: rank -> list of losses.

    A file may hold a plain list of floats or a list of records; records
    (``{"loss": ..., ...}``) are reduced to their ``loss``.
    """
    result: dict[int, list[float]] = {}
    for p in sorted(Path(out_dir).iterdir()):
        m = _LOSS_FILE.match(p.name)
        if not m:
            continue
        data = json.loads(p.read_text(encoding="utf-8"))
        result[int(m.group(1))] = [
            float(x["loss"]) if isinstance(x, dict) else float(x) for x in data
        ]
    if not result:
        raise FileNotFoundError(f"no losses-rank*.json in {out_dir}")
    return dict(sorted(result.items()))


def assert_losses_close(
    a: Mapping[int, Sequence[float]],
    b: Mapping[int, Sequence[float]],
    rel: float = 1e-5,
) -> None:
    """Assert two ``read_losses`` results have the same ranks, same lengths, and
    every loss equal within ``rel`` relative tolerance (NaN never matches)."""
    assert sorted(a) == sorted(b), f"ranks differ: {sorted(a)} vs {sorted(b)}"
    for r in a:
        la, lb = list(a[r]), list(b[r])
        assert len(la) == len(lb), f"rank {r}: {len(la)} losses vs {len(lb)}"
        for i, (x, y) in enumerate(zip(la, lb, strict=True)):
            if not math.isclose(x, y, rel_tol=rel, abs_tol=0.0):
                raise AssertionError(
                    f"rank {r} step {i}: {x!r} vs {y!r} (rel {abs(x - y) / max(abs(x), abs(y), 1e-300):.3g} > {rel})"
                )
