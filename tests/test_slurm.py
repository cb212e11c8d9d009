"""nbdist's Slurm launcher through a real scheduler: a one-node Slurm (tests/slurm_cluster.py) on
this machine, engines submitted by ipyparallel's SlurmEngineSetLauncher. Run: pytest -m slurm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import nbformat
import psutil
import pytest

from nbdist import Cluster
from nbdist.cells.result import CellResult
from nbdist.errors import ClusterStartError
from tests import slurm_cluster
from tests.test_notebook_lint import save_with_outputs
from tests.test_notebooks import NOTEBOOK_DIR, check_tagged_cells_raised, run_notebook

pytestmark = pytest.mark.slurm
if slurm_cluster.missing():
    pytestmark = [pytest.mark.slurm, pytest.mark.skip(reason=slurm_cluster.missing())]

# engines on this machine: the controller and the rendezvous stay on loopback
LOOPBACK = {"controller_ip": "127.0.0.1", "spans_hosts": False}
TUTORIAL = NOTEBOOK_DIR / "12_multi_node_slurm.ipynb"
SAVE_TUTORIAL = "NBDIST_SAVE_SLURM_TUTORIAL"
"""Set to 1: the tutorial test writes its executed notebook back, outputs kept (what is committed)."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.SlurmCluster]:
    root = str(tmp_path_factory.mktemp("slurm"))
    cluster = slurm_cluster.up(root)
    try:
        yield cluster
    finally:
        slurm_cluster.down(root)


@pytest.fixture
def slurm_env(slurm: slurm_cluster.SlurmCluster,
              monkeypatch: pytest.MonkeyPatch) -> slurm_cluster.SlurmCluster:
    for key, value in slurm.env.items():
        monkeypatch.setenv(key, value)
    return slurm


def _squeue_active() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T %r"], capture_output=True, text=True, check=True)
    return out.stdout.split("\n")[:-1]


def _job_processes(slurm: slurm_cluster.SlurmCluster) -> list[tuple[int, list[str]]]:
    """Processes of any job of this test cluster (they carry its SLURM_CONF and a job id)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_CONF") == slurm.conf and "SLURM_JOB_ID" in env:
            found.append((proc.pid, proc.info["cmdline"]))
    return found


def _assert_nothing_left(slurm: slurm_cluster.SlurmCluster) -> None:
    assert _squeue_active() == [], "a job (or a step of it) is still queued or running"
    deadline = time.monotonic() + 10
    while _job_processes(slurm) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _job_processes(slurm) == []


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    found = re.search(r"JobState=(\S+)", out.stdout)
    return found.group(1) if found else ""


def _note_when_running_ends(job_id: str, seen: list[float], within: float) -> None:
    """Append the moment Slurm first shows the job in a state other than RUNNING."""
    deadline = time.monotonic() + within
    while _job_state(job_id) == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.1)
    seen.append(time.perf_counter())


def _node_back_to_service(timeout: float = 30.0) -> None:
    """After a test set the node DOWN: wait until it is idle again (ReturnToService=2 brings it
    back when slurmd registers; resume it if it stays down)."""
    started = time.monotonic()
    state = ""
    while time.monotonic() - started < timeout:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.strip()
        if state == "idle":
            return
        if state.startswith("down") and time.monotonic() - started > 3:
            node = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True).stdout.strip()
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        time.sleep(0.2)
    raise AssertionError(f"the Slurm node is not idle again within {timeout:.0f} s: {state}")


def _cluster(slurm: slurm_cluster.SlurmCluster, n: int = 4, config=None, **options: object) -> Cluster:
    opts = {"partition": slurm.partition, "timelimit": "10", **LOOPBACK, **options}
    return Cluster(n=n, launcher="slurm", launcher_options=opts, config=config)



def _fault_mid_cell(cluster: Cluster, fault: Callable[[], object], code: str) -> tuple[CellResult, float]:
    """Run `code` on the ranks and, 2 s in, `fault()` (a scancel, a node going down): the cell's
    result and the seconds from the fault to the ranks being reported."""
    at: list[float] = []
    timer = threading.Timer(2.0, lambda: (at.append(time.perf_counter()), fault()))
    timer.start()
    result = cluster.run(code)
    reported = time.perf_counter() - at[0]
    timer.join()
    return result, reported

def test_start_run_scancel_restart_stop(slurm_env, fast_config) -> None:
    """Submit, PENDING -> RUNNING progress, a real all_reduce; scancel mid-cell: ranks dead with
    the Slurm state within 10 s; restart submits a new job; stop leaves no job or process."""
    said: list[str] = []
    started = time.perf_counter()
    cluster = _cluster(slurm_env, config=fast_config.replace(engine_start_timeout=120))
    try:
        cluster.start(progress=said.append)
        result = cluster.run("t = torch.ones(1); dist.all_reduce(t); t.item()")
        first_collective = time.perf_counter() - started
        assert result.ok, result.errors
        assert {result.value_text(r) for r in range(4)} == {"4.0"}
        job_id = cluster.batch_job.job_id
        assert any(m == f"Slurm job {job_id}: RUNNING" for m in said), said
        assert _squeue_active() == [f"{job_id} RUNNING None"]
        print(f"submit -> first collective: {first_collective:.1f} s; progress: {said}")

        cluster.run("kept = 41")
        result, reported = _fault_mid_cell(cluster, lambda: subprocess.run(["scancel", job_id]),
                                           "import time\nfor _ in range(600): time.sleep(0.1)")
        print(f"scancel -> ranks reported dead: {reported:.1f} s")
        assert reported < 10.0
        assert {e.kind for e in result.errors.values()} == {"dead"}, result.errors
        # Slurm still shows the job COMPLETING here (for about 7 s); its exit signal says why
        assert all(e.evalue == f"Slurm job {job_id} was cancelled (CANCELLED: scancel)"
                   for e in result.errors.values()), result.errors
        assert f"Slurm job {job_id} log " in cluster.engine_log_tail(0, 20)  # the job's own log

        cluster.restart(progress=said.append)
        assert cluster.batch_job.job_id != job_id
        result = cluster.run("t = torch.ones(1); dist.all_reduce(t); t.item()")
        assert result.ok and result.value_text(0) == "4.0", result.errors
    finally:
        cluster.stop()
    _assert_nothing_left(slurm_env)


def test_queued_job_reports_its_reason_and_is_cancelled(slurm_env, fast_config) -> None:
    blocker = subprocess.run(["sbatch", "--parsable", "-n", str(slurm_env.cpus), "--output=/dev/null",
                              "--wrap", "sleep 300"],
                             capture_output=True, text=True, check=True).stdout.strip()
    said: list[str] = []
    cluster = _cluster(slurm_env, config=fast_config.replace(batch_queue_timeout=4))
    try:
        with pytest.raises(ClusterStartError, match=r"still PENDING \(Resources\) after 4 s"):
            cluster.start(progress=said.append)
    finally:
        subprocess.run(["scancel", blocker], check=True)
        cluster.stop()
    assert any(m.endswith(": PENDING (Resources)") for m in said), said
    deadline = time.monotonic() + 15
    while _squeue_active() and time.monotonic() < deadline:  # the blocker ends too
        time.sleep(0.2)
    _assert_nothing_left(slurm_env)


@pytest.mark.parametrize(("options", "n", "message"), [
    ({"partition": "nope"}, 2, r"sbatch refused the engines' job: .*invalid partition"),
    ({}, 20, r"cannot start: PENDING \(PartitionConfig\)"),
])
def test_bad_arguments_fail_fast_in_one_line(slurm_env, options, n, message) -> None:
    cluster = _cluster(slurm_env, n=n, **options)
    t0 = time.perf_counter()
    with pytest.raises(ClusterStartError, match=message) as info:
        cluster.start()
    assert time.perf_counter() - t0 < 15
    assert "\n" not in str(info.value)
    _assert_nothing_left(slurm_env)


def test_failed_job_shows_its_engine_log(slurm_env) -> None:
    cluster = _cluster(slurm_env, n=2, engine_python="/nonexistent/python")
    with pytest.raises(ClusterStartError, match=r"(?s)Slurm job \d+ ended: FAILED.*log .*/nonexistent"):
        cluster.start()
    _assert_nothing_left(slurm_env)


def test_time_limit_is_reported_with_the_limit(slurm_env, fast_config) -> None:
    cluster = _cluster(slurm_env, n=2, timelimit="1", config=fast_config.replace(engine_start_timeout=120))
    try:
        cluster.start()
        seen: list[float] = []
        watcher = threading.Thread(target=_note_when_running_ends,
                                   args=(cluster.batch_job.job_id, seen, 200), daemon=True)
        watcher.start()
        result = cluster.run("import time\nfor _ in range(1500): time.sleep(0.1)")
        reported = time.perf_counter()
        watcher.join()
        print(f"time limit enforced by Slurm -> ranks reported dead: {reported - seen[0]:.1f} s")
        assert reported - seen[0] < 10.0
        assert {e.kind for e in result.errors.values()} == {"dead"}, result.errors
        assert all("reached its time limit (00:01:00) and was ended (TIMEOUT)" in e.evalue
                   for e in result.errors.values()), result.errors
    finally:
        cluster.stop()
    _assert_nothing_left(slurm_env)


def test_node_failure_mid_cell_is_reported_as_node_fail(slurm_env, fast_config) -> None:
    """The node set DOWN under a running cell (Slurm's own node failure): the job is not requeued
    (nbdist submits with --no-requeue) but ends NODE_FAIL, and the ranks say so within 10 s."""
    cluster = _cluster(slurm_env, n=2, config=fast_config.replace(engine_start_timeout=120))
    node = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True).stdout.strip()
    def fail_node() -> None:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=nbdist-test"],
                       check=True)
    try:
        cluster.start()
        job_id = cluster.batch_job.job_id
        result, reported = _fault_mid_cell(
            cluster, fail_node, "import time\nfor _ in range(600):\n    dist.barrier()\n    time.sleep(0.1)")
        print(f"node DOWN -> ranks reported dead: {reported:.1f} s")
        assert reported < 10.0
        assert {e.kind for e in result.errors.values()} == {"dead"}, result.errors
        assert all(e.evalue.startswith(f"Slurm job {job_id} lost a node (NODE_FAIL, NodeDown)")
                   for e in result.errors.values()), result.errors
        assert "NODE_FAIL" in str(cluster.status())
    finally:
        cluster.stop()
        _node_back_to_service()
    _assert_nothing_left(slurm_env)


def test_kernel_killed_ends_its_job(slurm_env, tmp_path) -> None:
    """The notebook kernel SIGKILLed: the engines (under slurmstepd, not ours to kill by PID) see
    their cell channel's notebook end go and exit, so the job ends and squeue is empty soon after."""
    options = {"partition": slurm_env.partition, "timelimit": "10", **LOOPBACK}
    script = tmp_path / "kernel.py"
    script.write_text(
        "import time\n"
        "from nbdist import Cluster\n"
        f"c = Cluster(n=2, launcher='slurm', launcher_options={options!r}).start()\n"
        "print(c.batch_job.job_id, flush=True)\n"
        "time.sleep(600)\n"
    )
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        job_id = kernel.stdout.readline().strip()
        assert job_id.isdigit(), job_id
        assert _squeue_active() == [f"{job_id} RUNNING None"]
        kernel.kill()
        kernel.wait(timeout=10)
        killed = time.perf_counter()
        deadline = time.monotonic() + 15
        while _squeue_active() and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"kernel SIGKILL -> squeue empty: {time.perf_counter() - killed:.1f} s "
              f"(job {job_id} {_job_state(job_id)})")
        assert _job_state(job_id) == "COMPLETED"  # its engines exited: nothing cancelled it
    finally:
        if kernel.poll() is None:
            kernel.kill()
    _assert_nothing_left(slurm_env)


def _output_text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", "") + "".join(output.get("traceback", [])))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_tutorial_runs_through_slurm(slurm_env, tmp_path) -> None:
    """notebooks/12_multi_node_slurm.ipynb against the live scheduler: a Slurm job that reaches
    RUNNING, ranks that are its tasks, a working all_reduce, the scancel lesson, a new job after
    %dist_restart and nothing left after %dist_stop."""
    nb, seconds = run_notebook(TUTORIAL, tmp_path)
    nbformat.write(nb, tmp_path / TUTORIAL.name)  # to look at when an assertion below fails
    check_tagged_cells_raised(nb, TUTORIAL.stem)
    text = "\n".join(_output_text(cell) for cell in nb.cells if cell.cell_type == "code")
    print(f"{TUTORIAL.stem} through Slurm: {seconds:.1f} s")
    assert "falling back" not in text
    jobs = re.findall(r"nbdist: Slurm job (\d+): RUNNING", text)
    assert len(jobs) == 2 and jobs[0] != jobs[1], text  # %dist_start, then %dist_restart
    # each rank is one task of the job (nbdist orders ranks by registration, not by task number)
    tasks = dict(re.findall(rf"rank (\d): Slurm job {jobs[0]} task (\d) on \S+, all_reduce sum 3\n", text))
    assert sorted(tasks) == ["0", "1"] and sorted(tasks.values()) == ["0", "1"], text
    for rank in (0, 1):
        assert f"rank {rank}: Slurm job {jobs[1]}, all_reduce sum 3" in text
    assert f"Slurm job {jobs[0]} was cancelled (CANCELLED: scancel)" in text
    assert "listen on: 127.0.0.1\n" in text
    _assert_nothing_left(slurm_env)
    if os.environ.get(SAVE_TUTORIAL) == "1":
        save_with_outputs(nb, TUTORIAL, f"{SAVE_TUTORIAL}=1 pytest -m slurm tests/test_slurm.py -k tutorial")
