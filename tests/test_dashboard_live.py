"""The dashboard data path on a real 2-rank cluster: values reach the widget model *while* the
cell runs, stale and dead states appear, and a failing listener never breaks the cell.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from nbdist.dashboard import Dashboard


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Any:
    # the shared fixture when conftest has it; otherwise our own, always cleaned up
    try:
        return request.getfixturevalue("cluster2")
    except pytest.FixtureLookupError:
        pass
    import nbdist

    own = nbdist.Cluster(n=2, config=nbdist.NbdistConfig(telemetry_interval=0.25))
    request.addfinalizer(own.stop)
    own.start()
    return own


class Snapshots:
    """A listener subscribed after the dashboard: records what the widget model holds, and when."""

    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.taken: list[tuple[float, dict[str, Any], int]] = []

    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
        self.taken.append((time.time(), self.dashboard.view, len(self.dashboard.points)))

    def on_rank_state(self, rank: int, state: str, detail: str) -> None:
        self.taken.append((time.time(), self.dashboard.view, len(self.dashboard.points)))


@pytest.fixture
def watched(cluster: Any):
    dashboard = Dashboard(cluster.world_size, stale_after=1.5)
    snapshots = Snapshots(dashboard)
    cluster.telemetry.subscribe(dashboard)
    cluster.telemetry.subscribe(snapshots)
    yield dashboard, snapshots
    cluster.telemetry.unsubscribe(snapshots)
    cluster.telemetry.unsubscribe(dashboard)


TRAIN = """
import time, torch, nbdist
layer = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(layer.parameters(), lr=0.05)
data = torch.randn(32, 64)
end = time.time() + {seconds}
step = 0
while time.time() < end:
    loss = layer(data).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if {stop_rank} != rank or time.time() < end - {silent}:
        nbdist.log(step=step, loss=loss, lr=0.05)
    step += 1
    time.sleep(0.02)
step
"""


def test_every_rank_reaches_the_widget_model_during_the_cell(cluster: Any, watched: Any) -> None:
    dashboard, snapshots = watched
    result = cluster.run(TRAIN.format(seconds=3.0, stop_rank=-1, silent=0), timeout=60)
    ended = time.time()
    result.raise_for_errors()
    # only snapshots taken well before the cell ended count as "live"
    live = [(t, view) for t, view, _ in snapshots.taken if t < ended - 1.0]
    assert live, "no telemetry reached the dashboard before the cell ended"
    ranks = range(cluster.world_size)
    steps_seen: dict[int, set[float]] = {rank: set() for rank in ranks}
    for _, view in live:
        for info in view["ranks"]:
            if info["step"] is not None:
                steps_seen[info["rank"]].add(info["step"])
    for rank in ranks:
        assert len(steps_seen[rank]) >= 2, f"rank {rank}: steps in the model mid-cell {steps_seen[rank]}"
    t, view = live[-1]
    for info in view["ranks"]:
        assert info["state"] == "running"
        assert info["memory"]["allocated"] > 0 and info["memory"]["capacity"] > 0
        assert "loss" in info["last"] and info["steps_per_s"] and info["steps_per_s"] > 1
    assert any(s["chart"] == "metric" and s["count"] > 1 for s in view["series"])
    dashboard.finalize()
    assert [info["state"] for info in dashboard.view["ranks"]] == ["idle"] * cluster.world_size
    assert "loss per rank" in dashboard.svg()


def test_a_rank_that_stops_logging_turns_stale_while_the_other_runs(cluster: Any, watched: Any) -> None:
    dashboard, snapshots = watched
    result = cluster.run(TRAIN.format(seconds=4.5, stop_rank=1, silent=3.0), timeout=60)
    ended = time.time()
    result.raise_for_errors()
    states = [
        ({info["rank"]: info["state"] for info in view["ranks"]}, view)
        for t, view, _ in snapshots.taken
        if t < ended - 0.3
    ]
    stale = [(s, v) for s, v in states if s.get(1) == "stale" and s.get(0) == "running"]
    assert stale, f"rank 1 never showed as stale: {[s for s, _ in states][-5:]}"
    detail = next(info["detail"] for info in stale[-1][1]["ranks"] if info["rank"] == 1)
    assert detail.startswith("no log() for")


def test_a_raising_listener_never_breaks_the_cell(cluster: Any, watched: Any) -> None:
    dashboard, _ = watched

    class Broken:
        def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
            raise RuntimeError("listener exploded")

        def on_rank_state(self, rank: int, state: str, detail: str) -> None:
            raise RuntimeError("listener exploded")

    broken = Broken()
    cluster.telemetry.subscribe(broken)
    try:
        result = cluster.run(TRAIN.format(seconds=1.0, stop_rank=-1, silent=0), timeout=60)
    finally:
        cluster.telemetry.unsubscribe(broken)
    result.raise_for_errors()
    assert all(int(result.value_text(rank) or 0) > 10 for rank in result.ranks)  # the loop ran to its end
    assert all(info["step"] is not None for info in dashboard.view["ranks"])


def test_a_dead_rank_shows_as_dead(cluster_factory: Any) -> None:
    # its own cluster: the module's stays whole for the other tests
    cluster = cluster_factory(2)
    dashboard = Dashboard(2)
    cluster.telemetry.subscribe(dashboard)
    code = """
import os, time, nbdist
for step in range(10):
    nbdist.log(step=step, loss=1.0)
    time.sleep(0.05)
if rank == 1:
    os._exit(3)
time.sleep(1.0)
"""
    result = cluster.run(code, timeout=30)
    assert 1 in result.errors
    deadline = time.time() + 10
    while time.time() < deadline and dashboard.view["ranks"][1]["state"] != "dead":
        cluster.poll_dead()
        time.sleep(0.1)
    assert dashboard.view["ranks"][1]["state"] == "dead", dashboard.view["ranks"][1]
    assert dashboard.view["ranks"][0]["state"] != "dead"
    assert "dead" in dashboard.svg()
