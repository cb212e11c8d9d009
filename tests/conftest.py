"""Fixtures that start real clusters and always stop them; a hygiene check for leaked processes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import psutil
import pytest

from nbdist import Cluster
from nbdist.config import NbdistConfig

# Short knobs so faults resolve fast in tests; far below any process-group timeout.
FAST = NbdistConfig(
    process_group_timeout=30.0,
    fault_settle=1.0,
    interrupt_grace=1.5,
    teardown_grace=2.0,
    telemetry_interval=0.2,
    stop_timeout=3.0,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _gone, alive = psutil.wait_procs(procs, timeout=within)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes still running: {[(p.pid, p.cmdline()[:3]) for p in alive]}"


def _start(n: int, **kwargs: object) -> Cluster:
    return Cluster(n=n, config=FAST, **kwargs).start()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster2() -> Iterator[Cluster]:
    cluster = _start(2)
    try:
        yield cluster
    finally:
        assert_all_gone(cluster.stop())


@pytest.fixture(scope="module")
def cluster4() -> Iterator[Cluster]:
    cluster = _start(4)
    try:
        yield cluster
    finally:
        assert_all_gone(cluster.stop())


@pytest.fixture
def cluster_factory() -> Iterator[object]:
    """Start clusters inside a test; every one is stopped (by PID) when the test ends."""
    started: list[Cluster] = []

    def make(n: int = 2, **kwargs: object) -> Cluster:
        cluster = Cluster(n=n, config=kwargs.pop("config", FAST), **kwargs)  # type: ignore[arg-type]
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        assert_all_gone(cluster.stop())  # stop() returns the PIDs it stopped


@pytest.fixture(autouse=True, scope="module")
def no_leaked_processes() -> Iterator[None]:
    """Fail the module if it leaves child processes of the test process behind."""
    before = _children()
    yield
    leaked = _children() - before
    if leaked:
        assert_all_gone(sorted(leaked), within=10.0)


@pytest.fixture
def healthy(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a fault test, the cluster used must run a collective (restarting if told to)."""
    yield
