"""Pure tests of the dashboard path: rank-side log()/sampler, downsampling, states, view, SVG.

No cluster and no browser: telemetry payloads are built by hand or by the real rank-side code
running in this process; time is a fake clock so states are tested without sleeping.
"""

from __future__ import annotations

import math
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from nbdist.cluster.telemetry import TelemetryHub
from nbdist.dashboard.colors import PALETTE_DARK, PALETTE_LIGHT, rank_color
from nbdist.dashboard.model import DashboardConfig, DashboardModel
from nbdist.dashboard.series import Series, minmax_indices
from nbdist.dashboard.svg import format_bytes, nice_ticks, render_svg
from nbdist.worker import metrics
from nbdist.worker.agent import TelemetryAgent
from nbdist.worker.rank_memory import MemorySampler, install_memory_sampler


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def payload(rank: int, t: float, steps: list[int] | None = None, loss: list[float] | None = None,
            state: str = "running", cell: int = 1, reason: str = "tick", **memory: float) -> dict:
    out: dict = {"rank": rank, "t": t, "state": state, "cell": cell, "reason": reason, "seq": 1}
    if memory or True:
        out["memory"] = {"kind": "cpu", "allocated": memory.get("allocated", 2**30),
                         "reserved": memory.get("reserved", 2**31), "peak": 3 * 2**30, "capacity": 16 * 2**30}
    if steps is not None:
        out["metrics"] = {"t": [t - 0.01 * (len(steps) - i) for i in range(len(steps))],
                          "step": steps, "values": {"loss": loss if loss is not None else [1.0] * len(steps)}}
    return out


# -- rank side -----------------------------------------------------------------------------------
@pytest.fixture
def agent():
    sent: list[dict] = []
    agent = TelemetryAgent(0, 0.5, sent.append)
    agent.sent = sent
    metrics.install_metrics(agent)
    yield agent
    metrics.uninstall_metrics(agent)


def test_log_is_a_noop_outside_an_engine() -> None:
    metrics.uninstall_metrics()
    metrics.log(loss=1.0)
    assert metrics.drain() is None


def test_log_batches_columns_and_never_raises(agent) -> None:
    metrics.log(loss=1.0)  # step defaults to 0, then counts up
    metrics.log(loss=torch.tensor(0.5), acc=3)
    metrics.log(step=10, name="text", big=torch.ones(3), lr=np.float32(0.1))
    metrics.log(step=object(), loss=2.0)  # an unusable step is swallowed, not raised
    out = metrics.drain()
    assert out["step"] == [0.0, 1.0, 10.0]
    assert out["values"]["loss"] == [1.0, 0.5, None]
    assert out["values"]["acc"] == [None, 3, None]
    assert out["values"]["lr"][2] == pytest.approx(0.1)
    assert out["rejected"] == {"name": "str", "big": "tensor with 3 elements"}
    assert out["dropped"] == 1
    metrics.log(step=11, name="again")
    assert "rejected" not in metrics.drain()  # each bad name is reported once
    assert metrics.drain() is None


def test_drain_thins_a_fast_logger_and_keeps_the_newest(agent) -> None:
    for step in range(10_000):
        metrics.log(step=step, loss=float(step))
    out = metrics.drain(limit=100)
    assert len(out["step"]) == 100 and out["step"][-1] == 9999.0
    assert out["dropped"] == 9_900
    assert out["step"] == sorted(out["step"])


def test_log_costs_microseconds(agent) -> None:
    started = time.perf_counter()
    for step in range(20_000):
        metrics.log(step=step, loss=0.1, lr=1e-3)
    per_call = (time.perf_counter() - started) / 20_000
    metrics.drain()
    assert per_call < 50e-6, f"log() took {per_call * 1e6:.1f} µs per call"


def test_metrics_reach_the_agent_payload(agent) -> None:
    agent.cell_started()
    metrics.log(step=3, loss=0.25)
    agent.publish_now("tick")
    body = agent.sent[-1]["nbdist"]
    assert body["metrics"]["values"]["loss"] == [0.25]


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.005)


def test_log_wakes_the_agent_long_before_the_next_tick() -> None:
    sent: list[dict] = []
    agent = TelemetryAgent(0, 30.0, sent.append, log_spacing=0.05)  # no tick during the test
    agent.register("memory", lambda: {"allocated": 1})
    metrics.install_metrics(agent)
    agent.start()
    try:
        metrics.log(step=0, loss=1.0)  # outside a cell: nothing is sent, and the thread does not spin
        time.sleep(0.2)
        assert sent == []
        agent.cell_started()
        metrics.drain()
        started = time.monotonic()
        metrics.log(step=1, loss=0.5)
        _wait_for(lambda: any(b["nbdist"]["reason"] == "log" for b in sent), 10.0, "a log payload")
        assert time.monotonic() - started < 5.0  # the tick is 30 s away
        light = [b["nbdist"] for b in sent if b["nbdist"]["reason"] == "log"]
        assert light[0]["metrics"]["values"]["loss"] == [0.5]
        assert "memory" not in light[0]  # a log payload carries metrics only; ticks keep the rest
        # a fast loop is batched: at most one light payload per log_spacing, every record kept
        started, count = time.monotonic(), 0
        while time.monotonic() - started < 0.5:
            metrics.log(step=2 + count, loss=0.25)
            count += 1
            time.sleep(0.001)

        def received() -> int:
            return sum(len(b["nbdist"]["metrics"]["step"]) for b in sent if b["nbdist"]["reason"] == "log")

        _wait_for(lambda: received() == count + 1, 10.0, f"all {count + 1} logged records")
        batches = sum(1 for b in sent if b["nbdist"]["reason"] == "log") - 1
        assert count > 50 and batches <= 0.5 / 0.05 + 3, (count, batches)
    finally:
        agent.stop()
        metrics.uninstall_metrics(agent)
    assert metrics._BUFFER.wake is None


def test_hub_keeps_the_last_tick_under_log_payloads() -> None:
    hub = TelemetryHub()
    tick = payload(0, 1.0, steps=[1])
    tick["where"] = {"collective": {"name": "all_reduce", "location": "cell:3"}}
    hub.publish(0, tick)
    hub.publish(0, {"rank": 0, "t": 1.1, "reason": "log", "state": "running", "cell": 1,
                    "metrics": {"t": [1.05], "step": [2], "values": {"loss": [0.5]}}})
    last = hub.last_payload[0]
    assert last["where"] == tick["where"] and last["memory"] == tick["memory"]
    assert last["metrics"]["step"] == [2] and last["reason"] == "log"
    hub.publish(0, payload(0, 1.5))  # the next tick replaces everything
    assert "where" not in hub.last_payload[0]


def test_cpu_memory_sampler_tracks_heap_and_resets_peak_per_cell() -> None:
    sampler = MemorySampler(torch.device("cpu"))
    first = sampler.sample(cell=1)
    assert {"allocated", "reserved", "peak", "capacity", "rss"} <= first.keys()
    assert first["kind"] == "cpu" and first["capacity"] > first["reserved"] > 0
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    during = sampler.sample(cell=1)
    assert during["allocated"] - first["allocated"] > 60 * 2**20
    del big
    after = sampler.sample(cell=1)
    assert after["peak"] >= during["reserved"]  # the peak remembers the freed tensor
    next_cell = sampler.sample(cell=2)
    if first["heap_source"] == "mallinfo2":
        assert next_cell["allocated"] < during["allocated"] - 60 * 2**20
    assert next_cell["peak"] < during["peak"] - 30 * 2**20, "VmHWM was not reset at cell start"


def test_memory_provider_costs_well_under_a_millisecond() -> None:
    sampler = MemorySampler(torch.device("cpu"))
    sampler.sample(cell=1)
    started = time.perf_counter()
    for _ in range(200):
        sampler.sample(cell=1)
    assert (time.perf_counter() - started) / 200 < 1e-3


def test_install_memory_sampler_registers_a_provider() -> None:
    sent: list[dict] = []
    agent = TelemetryAgent(3, 0.5, sent.append)
    assert install_memory_sampler(agent, torch.device("cpu")) is not None
    agent.cell_started()
    agent.cell_finished()
    assert sent[-1]["nbdist"]["memory"]["kind"] == "cpu"


def test_a_short_cell_sends_one_payload_a_longer_one_its_start_too() -> None:
    sent: list[dict] = []
    agent = TelemetryAgent(0, 30.0, sent.append)  # no tick during the test
    agent.register("memory", lambda: {"allocated": 1})
    agent.start()
    try:
        agent.cell_started()
        agent.cell_finished()  # well within START_DELAY
        time.sleep(0.2)
        assert [b["nbdist"]["reason"] for b in sent] == ["cell_end"]
        agent.cell_started()
        _wait_for(lambda: len(sent) == 2, 10.0, "the start payload of a running cell")
        start = sent[1]["nbdist"]
        assert start["reason"] == "cell_start" and start["state"] == "running" and start["memory"]
        agent.cell_finished()
        assert [b["nbdist"]["reason"] for b in sent] == ["cell_end", "cell_start", "cell_end"]
    finally:
        agent.stop()


# -- downsampling ----------------------------------------------------------------------------------
def test_minmax_keeps_spikes_ends_and_budget() -> None:
    y = np.random.default_rng(0).random(100_000)
    y[31_337] = 50.0
    y[77_777] = -50.0
    index = minmax_indices(y, 500)
    assert index.size <= 500
    assert {0, 31_337, 77_777, 99_999} <= set(index.tolist())
    assert np.all(np.diff(index) > 0)
    assert minmax_indices(y[:10], 500).tolist() == list(range(10))


def test_minmax_ignores_nan() -> None:
    y = np.full(10_000, np.nan)
    y[5000] = 1.0
    assert 5000 in minmax_indices(y, 100)


def test_series_breaks_where_steps_restart() -> None:
    line = Series()
    line.extend(range(10), range(10))
    line.extend(range(5), [1.0] * 5)  # a new cell counting from 0 again
    x, y = line.downsampled(100)
    assert line.starts == [0, 10]
    assert np.isnan(x[10]) and x.size == 16


def test_series_thins_old_history_past_the_limit() -> None:
    line = Series(history_limit=1000)
    for chunk in range(30):
        line.extend(np.arange(chunk * 100, (chunk + 1) * 100), np.ones(100))
    assert line.n <= 1000
    assert line.last_x == 2999.0



def test_thirty_minutes_at_100_hz_on_8_ranks_stays_within_the_history_limit() -> None:
    """Issue 20: 180,000 log() records per rank (30 minutes at 100 Hz), arriving a second at a
    time as the agent ships them: every line holds at most history_limit points, the newest at
    full resolution, and the view stays within the point budget."""
    model = DashboardModel(8)
    limit = model.config.history_limit
    for second in range(1800):
        steps = list(range(second * 100, (second + 1) * 100))
        for rank in range(8):
            model.ingest(rank, payload(rank, 1000.0 + second, steps=steps, loss=[1.0 / (1 + second)] * 100))
    lines = [line for h in model.ranks.values() for t in (h.metrics, h.memory) for line in t.values()]
    loss = model.ranks[0].metrics["loss"]
    assert loss.n <= limit < 180_000 and loss.last_x == 179_999.0
    assert all(line.n <= limit for line in lines)
    newest = loss.x[loss.n - limit // 4: loss.n]
    assert np.all(np.diff(newest) == 1.0)  # the recent quarter is every step
    view, buffer = model.build_view()
    assert len(buffer) == 8 * view["points"] <= 8 * (model.config.point_budget + 8 * 3 * 4)

# -- states and rates --------------------------------------------------------------------------------
def test_states_running_idle_stale_dead_restarted() -> None:
    clock = FakeClock()
    model = DashboardModel(3, DashboardConfig(stale_after=5.0), clock=clock)
    assert model.status(0).state == "waiting"
    model.ingest(0, payload(0, 1.0, steps=[0, 1]))
    model.ingest(1, payload(1, 1.0, state="idle"))
    model.ingest(2, payload(2, 1.0))
    assert [model.status(r).state for r in range(3)] == ["running", "idle", "running"]
    clock.now += 6
    status = model.status(2)
    assert status.state == "stale" and "no telemetry for 6 s" in status.detail
    model.set_rank_state(2, "dead", "exit code -9")
    assert model.status(2).state == "dead" and model.status(2).detail == "exit code -9"
    model.set_rank_state(2, "restarted", "pid 123")
    assert model.status(2).state == "idle"


def test_stale_when_a_rank_stops_logging_but_still_sends_telemetry() -> None:
    clock = FakeClock()
    model = DashboardModel(2, DashboardConfig(stale_after=5.0), clock=clock)
    for tick in range(20):  # both log every 0.5 s
        clock.now += 0.5
        model.ingest(0, payload(0, tick, steps=[tick]))
        model.ingest(1, payload(1, tick, steps=[tick]))
    for tick in range(20, 34):  # rank 1 keeps ticking (memory) but logs nothing for 7 s
        clock.now += 0.5
        model.ingest(0, payload(0, tick, steps=[tick]))
        model.ingest(1, payload(1, tick))
    assert model.status(0).state == "running"
    status = model.status(1)
    assert status.state == "stale" and status.detail == "no log() for 7 s"


def test_stale_limit_adapts_to_a_slow_logger() -> None:
    clock = FakeClock()
    model = DashboardModel(1, DashboardConfig(stale_after=5.0), clock=clock)
    for tick in range(5):  # logs every 10 s, telemetry every 0.5 s
        for _ in range(20):
            clock.now += 0.5
            model.ingest(0, payload(0, clock.now))
        model.ingest(0, payload(0, clock.now, steps=[tick]))
    clock.now += 8
    model.ingest(0, payload(0, clock.now))
    assert model.status(0).state == "running"


def test_cell_end_makes_ranks_idle_and_late_ticks_do_not_revive_them() -> None:
    clock = FakeClock()
    model = DashboardModel(1, clock=clock)
    model.ingest(0, payload(0, 1.0, steps=[0]))
    model.cell_finished()
    model.ingest(0, payload(0, 1.1, cell=1))  # a tick that raced the execute reply
    clock.now += 60
    assert model.status(0).state == "idle"
    model.ingest(0, payload(0, 70.0, cell=2, reason="cell_start"))
    assert model.status(0).state == "running"


def test_steps_per_second_is_derived_from_rank_timestamps() -> None:
    model = DashboardModel(1)
    body = payload(0, 100.0)
    body["metrics"] = {"t": [100.0 + 0.1 * i for i in range(50)], "step": list(range(50)),
                       "values": {"loss": [1.0] * 50}}
    model.ingest(0, body)
    assert model.steps_per_second(0) == pytest.approx(10.0)


def test_listener_exceptions_never_reach_the_publisher(capsys) -> None:
    class Broken:
        def on_telemetry(self, rank, payload):
            raise RuntimeError("boom")

        def on_rank_state(self, rank, state, detail):
            raise RuntimeError("boom")

    hub = TelemetryHub()
    hub.subscribe(Broken())
    hub.publish(0, payload(0, 1.0, steps=[1]))
    hub.rank_state(0, "dead", "gone")
    assert "boom" in capsys.readouterr().err


# -- the view the browser gets --------------------------------------------------------------------
def big_model(ranks: int = 8, points: int = 100_000, metrics_names: tuple[str, ...] = ("loss",)) -> DashboardModel:
    model = DashboardModel(ranks)
    rng = np.random.default_rng(1)
    for rank in range(ranks):
        steps = np.arange(points)
        body = payload(rank, 1000.0)
        body["metrics"] = {"t": (1000.0 + steps / 100).tolist(), "step": steps.tolist(),
                           "values": {name: (np.exp(-steps / 3e4) + rng.random(points) * 0.05).tolist()
                                      for name in metrics_names}}
        model.ingest(rank, body)
        for second in range(600):
            model.ingest(rank, payload(rank, 1000.0 + second, allocated=2**30 + second * 2**20))
    return model


def test_view_respects_the_point_budget_with_8_ranks_of_100k_points() -> None:
    model = big_model()
    started = time.perf_counter()
    view, buffer = model.build_view()
    first = time.perf_counter() - started
    assert view["points"] <= model.config.point_budget + 8 * 3 * 4
    assert len(buffer) == 8 * view["points"]  # float32 x and y
    assert {s["total"] for s in view["series"] if s["chart"] == "metric"} == {100_000}
    assert first < 2.0, f"building the view took {first:.2f} s"
    model.ingest(0, payload(0, 2000.0, steps=[100_000]))
    started = time.perf_counter()
    model.build_view()
    assert time.perf_counter() - started < first  # unchanged lines come from the cache


def test_view_is_json_safe_with_nan_losses() -> None:
    import json

    model = DashboardModel(1)
    model.ingest(0, payload(0, 1.0, steps=[0, 1], loss=[float("nan"), 1.0]))
    view, buffer = model.build_view()
    json.dumps(view, allow_nan=False)
    points = np.frombuffer(buffer, dtype=np.float32).reshape(-1, 2)
    assert math.isnan(points[0, 1])  # the buffer keeps the diverged value


# -- static SVG ------------------------------------------------------------------------------------
def test_svg_is_valid_small_and_complete() -> None:
    model = big_model()
    model.set_rank_state(3, "dead", "engine died")
    svg = render_svg(model, log_scale=True)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    paths = [el for el in root.iter() if el.tag.endswith("path")]
    assert len(paths) == 8 + 16  # one loss line + allocated and reserved per rank
    for rank in range(8):
        assert rank_color(rank) in svg
    assert "dead" in svg and "GiB" in svg and "loss per rank (log)" in svg
    assert len(svg.encode()) < 60_000, f"{len(svg.encode())} bytes"


def test_svg_without_data_says_so() -> None:
    svg = render_svg(DashboardModel(2))
    ET.fromstring(svg)
    assert "no data yet" in svg


def test_units_ticks_and_palettes() -> None:
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(300 * 2**20) == "300 MiB"
    assert nice_ticks(0, 1, 4) == [0, 0.25, 0.5, 0.75, 1.0]
    assert len(PALETTE_LIGHT) == len(PALETTE_DARK) == len(set(PALETTE_LIGHT))
    assert rank_color(10) == rank_color(0)


# -- the widget without a browser -----------------------------------------------------------------
def test_widget_throttles_syncs_and_carries_the_static_svg() -> None:
    from nbdist.dashboard import Dashboard

    clock = FakeClock()
    dashboard = Dashboard(2, clock=clock)
    start_syncs = dashboard.syncs
    for tick in range(100):  # 100 payloads within 1 s of fake time
        clock.now += 0.01
        dashboard.on_telemetry(tick % 2, payload(tick % 2, 1000.0 + tick, steps=[tick]))
    assert dashboard.syncs - start_syncs <= 6
    dashboard.finalize()
    assert dashboard.view["ranks"][0]["step"] == 98.0
    assert dashboard.view["ranks"][0]["state"] == "idle"
    data, _ = dashboard._repr_mimebundle_()
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == dashboard.model_id
    assert data["image/svg+xml"].startswith("<svg")
    assert "rank 0: idle loss=1" in data["text/plain"]


def test_cell_end_replaces_the_live_view_with_the_static_svg() -> None:
    import base64

    from nbdist.dashboard import Dashboard

    class Handle:
        def __init__(self) -> None:
            self.updates: list[dict] = []

        def update(self, data: dict, metadata: dict, raw: bool) -> None:
            self.updates.append(data)

    dashboard = Dashboard(2)
    dashboard.on_telemetry(0, payload(0, 1000.0, steps=[1, 2], loss=[0.5, 0.25]))
    handle = Handle()
    dashboard._handles.append(handle)
    dashboard.finalize()
    (data,) = handle.updates
    # a saved output that kept the widget view would read "model not found" without the kernel
    assert set(data) == {"text/plain", "image/svg+xml", "text/html"}
    encoded = data["text/html"].split("base64,")[1].split('"')[0]
    assert base64.b64decode(encoded).decode() == data["image/svg+xml"]
    assert data["text/html"].startswith('<img class="nbdist-static-img"')
    assert dashboard._handles == []  # later cells do not touch this cell's snapshot


def test_widget_survives_garbage_payloads() -> None:
    from nbdist.dashboard import Dashboard

    dashboard = Dashboard(1)
    dashboard.on_telemetry(0, {"metrics": {"t": [1.0], "step": ["x"], "values": {}}})
    dashboard.on_telemetry(0, {"memory": "nonsense", "t": "later"})
    dashboard.on_rank_state(5, "dead", "")
    assert dashboard.view["ranks"][-1]["state"] == "dead"
