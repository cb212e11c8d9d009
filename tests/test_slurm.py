"""nbdist's Slurm launcher through a real scheduler: a one-node Slurm (tests/slurm_cluster.py) on
this machine, engines submitted by ipyparallel's SlurmEngineSetLauncher. Run: pytest -m slurm."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from nbdist import Cluster
from nbdist.errors import ClusterStartError
from tests import slurm_cluster

pytestmark = pytest.mark.slurm
if slurm_cluster.missing():
    pytestmark = [pytest.mark.slurm, pytest.mark.skip(reason=slurm_cluster.missing())]

# engines on this machine: the controller and the rendezvous stay on loopback
LOOPBACK = {"controller_ip": "127.0.0.1", "spans_hosts": False}


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


def _cluster(slurm: slurm_cluster.SlurmCluster, n: int = 4, config=None, **options: object) -> Cluster:
    opts = {"partition": slurm.partition, "timelimit": "10", **LOOPBACK, **options}
    return Cluster(n=n, launcher="slurm", launcher_options=opts, config=config)


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
        job_id = cluster._engines.job.job_id
        assert any(m == f"Slurm job {job_id}: RUNNING" for m in said), said
        assert _squeue_active() == [f"{job_id} RUNNING None"]
        print(f"submit -> first collective: {first_collective:.1f} s; progress: {said}")

        cluster.run("kept = 41")
        timer = threading.Timer(2.0, subprocess.run, (["scancel", job_id],))
        timer.start()
        t0 = time.perf_counter()
        result = cluster.run("import time\nfor _ in range(600): time.sleep(0.1)")
        timer.join()
        assert time.perf_counter() - t0 < 2.0 + 10.0
        assert {e.kind for e in result.errors.values()} == {"dead"}, result.errors
        # Slurm shows the job COMPLETING (hiding CANCELLED) until its steps are gone
        assert all(e.evalue.startswith(f"Slurm job {job_id} ") and
                   ("CANCELLED" in e.evalue or "COMPLETING" in e.evalue)
                   for e in result.errors.values()), result.errors
        assert f"Slurm job {job_id} log " in cluster.engine_log_tail(0, 20)  # the job's own log

        cluster.restart(progress=said.append)
        assert cluster._engines.job.job_id != job_id
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
        result = cluster.run("import time\nfor _ in range(1500): time.sleep(0.1)")
        assert {e.kind for e in result.errors.values()} == {"dead"}, result.errors
        assert all("reached its time limit (1:00) and was ended (TIMEOUT)" in e.evalue
                   for e in result.errors.values()), result.errors
    finally:
        cluster.stop()
    _assert_nothing_left(slurm_env)
