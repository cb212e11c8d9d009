"""Measurement helpers for the dashboard figures: B5 (sampler + log() overhead), B6 (log() → model).

Also the numbers behind the stack choice: kernel cost and bytes per sync, saved bytes per output,
and canvas render time in Chromium with 8 ranks × 100k points. Run: ``python tests/benchmarks/bench_dashboard.py``.
"""

from __future__ import annotations

import json
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


# -- B5: overhead of the sampler thread + log() every step, in one process ------------------------
def _training_step_factory(width: int = 1024, depth: int = 4, batch: int = 64) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(batch, width)

    def step() -> Any:
        loss = model(data).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return step


def bench_overhead(steps: int = 40, rounds: int = 10, width: int = 1024, interval: float = 0.5) -> dict[str, Any]:
    """B5: step time with (telemetry thread + memory sampler + ``log()`` every step) ÷ without.

    Three views, because wall time on a shared, oversubscribed machine is mostly noise:
    paired wall ratio (off/on rounds adjacent, median of ratios); process CPU time per step (the
    telemetry thread's CPU included); and the cost model log() µs / step + tick µs / interval.
    Payloads are pickled as ipyparallel would, so serialisation is counted.
    """
    import torch

    from nbdist.worker import metrics
    from nbdist.worker.agent import LOG_SPACING, TelemetryAgent
    from nbdist.worker.rank_memory import install_memory_sampler

    torch.set_num_threads(1)
    step = _training_step_factory(width)
    for _ in range(5):
        step()
    published = [0]

    def publish(body: dict[str, Any]) -> None:
        published[0] += len(pickle.dumps(body))

    wall_ratios: list[float] = []
    cpu_ratios: list[float] = []
    wall_off: list[float] = []
    cpu_off: list[float] = []
    for _ in range(rounds):
        measured: dict[bool, tuple[float, float]] = {}
        for enabled in (False, True):
            agent = TelemetryAgent(0, interval, publish)
            if enabled:
                install_memory_sampler(agent, torch.device("cpu"))
                metrics.install_metrics(agent)
                agent.start()
                agent.cell_started()
            times = []
            cpu_start = time.process_time()
            for index in range(steps):
                started = time.perf_counter()
                loss = step()
                if enabled:
                    metrics.log(step=index, loss=loss, lr=1e-3)
                times.append(time.perf_counter() - started)
            if enabled:
                agent.stop()  # joins the thread, so its CPU time is inside this round's figure
                metrics.uninstall_metrics(agent)
            measured[enabled] = (statistics.median(times), (time.process_time() - cpu_start) / steps)
        wall_ratios.append(measured[True][0] / measured[False][0])
        cpu_ratios.append(measured[True][1] / measured[False][1])
        wall_off.append(measured[False][0])
        cpu_off.append(measured[False][1])
    log_cost = _log_call_cost()
    tick_cost = _tick_cost()
    light_cost = _tick_cost(logs_per_tick=3, only=("metrics",))
    step_seconds = statistics.median(cpu_off)
    return {
        "width": width,
        "step_ms_wall": 1e3 * statistics.median(wall_off),
        "step_ms_cpu": 1e3 * step_seconds,
        "ratio_wall_paired": statistics.median(wall_ratios),
        "ratio_cpu_paired": statistics.median(cpu_ratios),
        "log_call_us": log_cost * 1e6,
        "tick_us": tick_cost * 1e6,
        "log_publish_us": light_cost * 1e6,
        # worst case: log() wakes the agent for a light payload every LOG_SPACING
        "model_overhead_pct": 100 * (log_cost / step_seconds + tick_cost / interval + light_cost / LOG_SPACING),
        "published_bytes": published[0],
    }


def _tick_cost(ticks: int = 200, logs_per_tick: int = 50, only: tuple[str, ...] | None = None) -> float:
    """CPU of one telemetry tick: memory sample + metrics drain + pickling the payload (with
    ``only=("metrics",)``: the light payload a ``log()`` wakes the agent for)."""
    import torch

    from nbdist.worker import metrics
    from nbdist.worker.agent import TelemetryAgent
    from nbdist.worker.rank_memory import install_memory_sampler

    agent = TelemetryAgent(0, 0.5, lambda body: pickle.dumps(body))
    install_memory_sampler(agent, torch.device("cpu"))
    metrics.install_metrics(agent)
    agent.cell_running = True
    total = 0.0
    for tick in range(ticks):
        for index in range(logs_per_tick):
            metrics.log(step=tick * logs_per_tick + index, loss=0.5, lr=1e-3)
        started = time.process_time()
        agent.publish_now("tick" if only is None else "log", only=only)
        total += time.process_time() - started
    metrics.uninstall_metrics(agent)
    return total / ticks


def _log_call_cost(calls: int = 50_000) -> float:
    import torch

    from nbdist.worker import metrics
    from nbdist.worker.agent import TelemetryAgent

    agent = TelemetryAgent(0, 0.5, lambda body: None)
    metrics.install_metrics(agent)
    loss = torch.tensor(0.25)
    started = time.perf_counter()
    for index in range(calls):
        metrics.log(step=index, loss=loss, lr=1e-3)
    cost = (time.perf_counter() - started) / calls
    metrics.uninstall_metrics(agent)
    return cost


def _sample_cost(calls: int = 500) -> float:
    import torch

    from nbdist.worker.rank_memory import MemorySampler

    sampler = MemorySampler(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    sampler.sample(cell=1)
    started = time.perf_counter()
    for _ in range(calls):
        sampler.sample(cell=1)
    return (time.perf_counter() - started) / calls


# -- B6: log() on a rank → value set on the notebook's widget model -------------------------------
def bench_latency(ranks: int = 2, seconds: float = 6.0, interval: float | None = None) -> dict[str, Any]:
    """B6 on a real cluster: every record's (sync wall time − rank's log() wall time)."""
    import nbdist
    from nbdist.config import NbdistConfig
    from nbdist.dashboard import Dashboard

    config = NbdistConfig() if interval is None else NbdistConfig(telemetry_interval=interval)
    cluster = nbdist.Cluster(n=ranks, config=config)
    cluster.start()
    try:
        dashboard = Dashboard(ranks)
        cluster.telemetry.subscribe(dashboard)
        code = (
            "import time, nbdist\n"
            f"end = time.time() + {seconds}\n"
            "step = 0\n"
            "while time.time() < end:\n"
            "    nbdist.log(step=step, loss=1.0 / (step + 1)); step += 1; time.sleep(0.02)\n"
        )
        cluster.run(code, timeout=seconds + 60).raise_for_errors()
        latency = np.array(dashboard.log_latency)
        return {
            "telemetry_interval": config.telemetry_interval,
            "records": int(latency.size),
            "median_ms": 1e3 * float(np.median(latency)),
            "p90_ms": 1e3 * float(np.percentile(latency, 90)),
            "max_ms": 1e3 * float(latency.max()),
            "syncs": dashboard.syncs,
            "sync_ms_median": 1e3 * statistics.median(dashboard.sync_seconds),
        }
    finally:
        cluster.stop()


# -- stack numbers: kernel cost per sync, bytes, static SVG -------------------------------------
def synthetic_model(ranks: int = 8, points: int = 100_000, names: tuple[str, ...] = ("loss", "lr")) -> Any:
    from nbdist.dashboard.model import DashboardModel

    model = DashboardModel(ranks)
    rng = np.random.default_rng(0)
    for rank in range(ranks):
        steps = np.arange(points, dtype=np.float64)
        body = {"rank": rank, "t": 1000.0, "state": "running", "cell": 1, "reason": "tick",
                "metrics": {"t": (1000.0 + steps / 100).tolist(), "step": steps.tolist(),
                            "values": {n: (np.exp(-steps / 3e4) * (1 + rank / 8) + rng.random(points) * 0.05).tolist() for n in names}}}
        model.ingest(rank, body)
        for second in range(1000):
            model.ingest(rank, {"rank": rank, "t": 1000.0 + second, "state": "running", "cell": 1,
                                "memory": {"kind": "cuda", "allocated": (2 + np.sin(second / 50 + rank)) * 2**30,
                                           "reserved": 3.5 * 2**30, "peak": 3.2 * 2**30, "capacity": 80 * 2**30}})
    return model


def bench_sync_and_bytes(ranks: int = 8, points: int = 100_000) -> dict[str, Any]:
    from nbdist.dashboard import Dashboard
    from nbdist.dashboard.svg import render_svg

    model = synthetic_model(ranks, points)
    started = time.perf_counter()
    view, buffer = model.build_view()
    cold = time.perf_counter() - started
    # a live tick: every rank appended a few records, so every line is re-downsampled
    for rank in range(ranks):
        model.ingest(rank, {"rank": rank, "t": 3000.0, "state": "running", "cell": 1,
                            "metrics": {"t": [3000.0], "step": [float(points)], "values": {"loss": [0.1], "lr": [0.1]}}})
    started = time.perf_counter()
    view, buffer = model.build_view()
    warm = time.perf_counter() - started
    started = time.perf_counter()
    svg = render_svg(model)
    svg_seconds = time.perf_counter() - started
    dashboard = Dashboard(ranks)
    dashboard.model = model
    data, _ = dashboard._repr_mimebundle_()
    output = {"output_type": "display_data", "data": data, "metadata": {}}
    return {
        "ranks": ranks,
        "points_per_line": points,
        "view_points": view["points"],
        "sync_bytes": len(buffer) + len(json.dumps(view)),
        "sync_ms_all_lines_changed": 1e3 * warm,
        "sync_ms_cold": 1e3 * cold,
        "svg_bytes": len(svg.encode()),
        "svg_ms": 1e3 * svg_seconds,
        "saved_output_bytes": len(json.dumps(output)),
        "max_syncs_per_s": 1 / dashboard.config.sync_interval,
    }


# -- front-end render time in Chromium (no JupyterLab: the ESM with a stand-in model) ----------
HARNESS = """
<!doctype html><html><head><style>%(css)s</style></head><body style="margin:0;width:1100px;%(body)s">
<div id="out"></div>
<script type="module">
%(esm)s
const listeners = {};
const state = %(state)s;
state.points = Uint8Array.from(atob(%(points)s), c => c.charCodeAt(0)).buffer;
state.points = new DataView(state.points);
const model = {
  get: (k) => state[k], set: (k, v) => { state[k] = v; },
  on: (e, f) => { (listeners[e] ??= []).push(f); }, off: () => {}, save_changes: () => {},
};
window.__nbdistModel = { state, listeners };
window.__nbdistRender = () => render({ model, el: document.getElementById("out") });
window.__ready = true;
</script></body></html>
"""


def harness_html(view: dict[str, Any], points: bytes, theme: str = "auto") -> str:
    import base64

    esm = (ROOT / "nbdist" / "dashboard" / "dashboard.js").read_text().replace("export default { render };", "")
    state = {"view": view, "metric": "", "log_scale": False, "theme": theme, "title": "nbdist"}
    css = (ROOT / "nbdist" / "dashboard" / "dashboard.css").read_text()
    # JupyterLab's dark theme variables, so the harness can show what dark users see
    body = ("--jp-layout-color0:#111;--jp-layout-color1:#222;--jp-layout-color2:#333;--jp-ui-font-color1:#e6e6e6;"
            "--jp-ui-font-color2:#a0a0a0;--jp-border-color1:#555;--jp-border-color2:#333;background:#111") if theme == "dark" else ""
    return HARNESS % {"css": css, "body": body, "esm": esm, "state": json.dumps(state), "points": json.dumps(base64.b64encode(points).decode())}


CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def bench_render(ranks: int = 8, points: int = 100_000, screenshot: str | None = None, theme: str = "auto") -> dict[str, Any]:
    """Canvas render time of the downsampled view vs drawing every point (no downsampling)."""
    from playwright.sync_api import sync_playwright

    model = synthetic_model(ranks, points)
    results: dict[str, Any] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            for label, per_series in (("downsampled", None), ("all_points", points)):
                view, buffer = model.build_view(per_series=per_series)
                page = browser.new_page(viewport={"width": 1100, "height": 800})
                page.set_content(harness_html(view, buffer, theme))
                page.wait_for_function("window.__ready === true")
                timings = page.evaluate(
                    """async () => {
                       const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
                       window.__nbdistRender();
                       const root = document.querySelector('.nbdist-dash');
                       const out = [parseFloat(root.dataset.renderMs)];
                       for (let i = 0; i < 7; i++) {
                         window.__nbdistModel.listeners['change:view'].forEach(f => f());
                         await frame();
                         out.push(parseFloat(root.dataset.renderMs));
                       }
                       return out; }"""
                )
                results[label] = {"points": view["points"], "bytes": len(buffer),
                                  "first_render_ms": timings[0], "render_ms_median": statistics.median(timings[1:])}
                if screenshot and label == "downsampled":
                    page.screenshot(path=screenshot, full_page=True)
                page.close()
        finally:
            browser.close()
    return results


if __name__ == "__main__":
    which = set(sys.argv[1:]) or {"b5", "b6", "sync", "render"}
    if "b5" in which:
        print("B5", json.dumps(bench_overhead(), indent=1))
        print("B5 small step", json.dumps(bench_overhead(width=256), indent=1))
    if "sync" in which:
        print("sync", json.dumps(bench_sync_and_bytes(), indent=1))
        print("sync 2 ranks × 2k", json.dumps(bench_sync_and_bytes(2, 2000), indent=1))
    if "render" in which:
        print("render", json.dumps(bench_render(screenshot=str(ROOT / "tests" / "artifacts" / "dashboard_8x100k.png")), indent=1))
        bench_render(2, 2000, screenshot=str(ROOT / "tests" / "artifacts" / "dashboard_dark.png"), theme="dark")
    if "b6" in which:
        print("B6", json.dumps(bench_latency(), indent=1))
