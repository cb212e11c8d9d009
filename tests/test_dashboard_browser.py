"""JupyterLab 4 and Notebook 7 in headless Debian Chromium: the dashboard appears under a
%%distributed cell and grows while 2 ranks train for ~10 s, names the rank slowed on purpose as
the straggler, and a notebook executed headless shows its final charts when opened without a
kernel. Setup: ``bash tests/browser_setup.sh``; run with ``-m browser``.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tests.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    browser_tools,
    cell_outputs,
    lab_server,
    notebook_url,
    open_saved_notebook,
    run_all_cells,
)

pytestmark = pytest.mark.browser


@pytest.fixture
def jupyterlab(tmp_path: Path, frontend: str) -> Iterator[tuple[str, Path]]:
    browser_tools(frontend)
    with lab_server(tmp_path, frontend=frontend) as server:
        yield notebook_url(server, "dashboard.ipynb", frontend), tmp_path


# DDP on 2 ranks, rank 1 sleeping 0.1 s more per step: the dashboard must name it the straggler
_STRAGGLER_CELL = """%%distributed
import time, torch, nbdist
layer = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(layer.parameters(), lr=0.05)
data = torch.randn(32, 64)
end = time.time() + {seconds}
step = 0
while time.time() < end:
    time.sleep(0.02 + (0.1 if rank == 1 else 0.0))
    loss = layer(data).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss, wall=time.time())
    step += 1
"""


# tqdm.auto in the ranks: one bar per rank, updated in place, ending at 100 %
_TQDM_CELL = """%%distributed
from tqdm.auto import tqdm
for _ in tqdm(range(25), desc=f"rank{rank} bar", mininterval=0.05):
    time.sleep(0.03)
"""


def _straggler_notebook(dashboard_notebook: Any, seconds: float) -> nbformat.NotebookNode:
    nb = dashboard_notebook(seconds=seconds)
    nb.cells[1] = nbformat.v4.new_code_cell(_STRAGGLER_CELL.format(seconds=seconds))
    nb.cells.insert(2, nbformat.v4.new_code_cell(_TQDM_CELL))
    return nb


@pytest.mark.timeout(300)
def test_dashboard_updates_live_in_jupyterlab(jupyterlab: tuple[str, Path], frontend: str,
                                              dashboard_notebook,
                                              artifacts: Path) -> None:
    from playwright.sync_api import sync_playwright

    url, root = jupyterlab
    nbformat.write(_straggler_notebook(dashboard_notebook, seconds=10.0), root / "dashboard.ipynb")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(url)
            page.wait_for_function(
                "() => window.jupyterapp && document.querySelector('.jp-NotebookPanel .jp-Notebook')",
                timeout=60_000)
            run_all_cells(page, kernel_timeout_ms=60_000)
            page.wait_for_selector(".nbdist-dash", timeout=90_000)
            # watch row 0's latest `wall` (the rank's time.time() at log()) to time log() → DOM (B6)
            page.evaluate("""() => {
                window.__b6 = []; let last = null;
                const poll = () => {
                  const row = document.querySelector('.nbdist-dash tr.nbd-rank');
                  const wall = row && JSON.parse(row.dataset.last || '{}').wall;
                  if (wall && wall !== last) { last = wall; window.__b6.push(Date.now() / 1000 - wall); }
                  if (window.__b6.length < 10000) requestAnimationFrame(poll);
                };
                requestAnimationFrame(poll);
            }""")
            page.wait_for_function(
                "() => +document.querySelector('.nbdist-dash').dataset.metricPoints >= 20", timeout=30_000)
            # the straggler view: rank 1's row highlighted, the line above the charts names it
            page.wait_for_function(
                "() => document.querySelector('.nbdist-dash').dataset.straggler === '1'", timeout=30_000)
            straggler = page.evaluate("""() => {
                const root = document.querySelector('.nbdist-dash');
                return {line: root.querySelector('.nbd-stragglers').textContent,
                        rows: [...root.querySelectorAll('tr.nbd-straggler')].map(r => r.dataset.rank),
                        late: [...root.querySelectorAll('td.nbd-lateby')].map(td => td.textContent)};
            }""")
            assert straggler["rows"] == ["1"], straggler
            assert straggler["line"].startswith("straggler: rank 1 arrived last"), straggler
            shots = []
            for index in (1, 2):
                if index == 2:
                    page.wait_for_timeout(3_000)
                page.locator(".nbdist-dash").first.scroll_into_view_if_needed()
                state = page.evaluate("""() => {
                    const root = document.querySelector('.nbdist-dash');
                    const canvas = root.querySelector('.nbd-metric-canvas');
                    return {points: +root.dataset.metricPoints, maxStep: +canvas.dataset.maxX,
                            states: root.dataset.states, renderMs: +root.dataset.renderMs,
                            rows: root.querySelectorAll('tr.nbd-rank').length,
                            memoryPoints: +root.querySelector('.nbd-memory-canvas').dataset.points};
                }""")
                path = artifacts / f"dashboard_live_{frontend}_{index}.png"
                page.locator(".nbdist-dash").first.screenshot(path=str(path))
                shots.append(state)
            first, second = shots
            # both screenshots were taken mid-run: every rank still running
            assert first["states"] == second["states"] == "running,running", shots
            assert first["rows"] == 2
            assert second["points"] > first["points"], shots
            assert second["maxStep"] > first["maxStep"], shots
            assert second["memoryPoints"] >= first["memoryPoints"] > 0, shots
            # the cell ends: its live output is replaced by the final static SVG (ranks idle)
            page.wait_for_function(
                "() => document.body.innerText.includes('NBDIST-STOPPED')", timeout=120_000)
            page.wait_for_function(
                "() => !document.querySelector('.nbdist-dash') && document.querySelector('img.nbdist-static-img')",
                timeout=30_000)
            # (the page holds 'NBDIST-STOPPED' in its source from the start: wait for the cell)
            page.wait_for_function(
                "() => window.jupyterapp.shell.currentWidget.content.widgets[2].model"
                ".executionCount != null", timeout=60_000)
            bars = cell_outputs(page, 2)
            assert len(bars) == 2, bars  # one output per rank, no line per redraw
            for rank in (0, 1):
                (bar,) = [text for text in bars if f"rank{rank} bar" in text]
                assert "[rank " in bar and "100%" in bar and "25/25" in bar, bars
            final = _static_chart(page)
            assert final["svg"] and "idle" in final["alt"] and "running" not in final["alt"], final
            assert final["straggler"], final  # the saved output names the straggler too
            page.locator("img.nbdist-static-img").first.screenshot(path=str(artifacts / "dashboard_final.png"))
            latencies = page.evaluate("() => window.__b6")
            summary = {"frontend": frontend, "straggler": straggler, "screens": shots, "b6_browser_ms": {
                "samples": len(latencies),
                "median": 1e3 * statistics.median(latencies),
                "max": 1e3 * max(latencies)}}
            (artifacts / "dashboard_browser.json").write_text(json.dumps(summary, indent=1))
            print(json.dumps(summary))
            assert len(latencies) >= 5 and statistics.median(latencies) < 2.0, summary
        finally:
            browser.close()
    shutil.copy(root / "jupyterlab.log", artifacts / "jupyterlab.log")


def _static_chart(page: object) -> dict[str, object]:
    """The static dashboard image in the current notebook: decoded, laid out, and its SVG text."""
    return page.evaluate("""() => {
        const panel = window.jupyterapp.shell.currentWidget.node;
        const img = panel.querySelector('img.nbdist-static-img');
        if (!img) return {found: false, text: panel.innerText};
        const box = img.getBoundingClientRect();
        const src = img.getAttribute('src') || '';
        const svg = src.startsWith('data:image/svg+xml;base64,') ? atob(src.split(',')[1]) : '';
        return {found: true, loaded: img.complete && img.naturalWidth > 0, width: box.width,
                height: box.height, alt: img.alt, svg: svg.includes('loss per rank') && svg.includes('nbdist-static'),
                straggler: svg.includes('straggler: rank 1 arrived last'),
                text: panel.innerText};
    }""")  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_headless_executed_notebook_shows_its_charts_without_a_kernel(tmp_path: Path, frontend: str,
                                                                      dashboard_notebook,
                                                                      artifacts: Path) -> None:
    """Executed by nbclient, opened in JupyterLab where no kernel can start: the final SVG shows,
    in an untrusted notebook (as nbclient leaves it) and in a trusted one, with no widget error."""
    browser_tools(frontend)
    from nbclient import NotebookClient
    from nbformat.sign import NotebookNotary
    from playwright.sync_api import sync_playwright

    nb = dashboard_notebook(seconds=3.0)
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    (tmp_path / "notary").mkdir()
    NotebookNotary(data_dir=str(tmp_path / "notary")).sign(nb)
    nbformat.write(nb, tmp_path / "trusted.ipynb")
    # the notary trusts any notebook whose digest it has signed: the untrusted copy must differ
    nb.metadata.pop("signature", None)
    nb.metadata["nbdist_test"] = "unsigned copy"
    nbformat.write(nb, tmp_path / "untrusted.ipynb")
    # no kernelspec is allowed: JupyterLab can start no kernel and offers "No Kernel" only
    options = ("--KernelSpecManager.allowed_kernelspecs=nbdist-no-kernel",
               f"--NotebookNotary.data_dir={tmp_path / 'notary'}")
    seen = {}
    with lab_server(tmp_path, *options, frontend=frontend) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for name in ("untrusted", "trusted"):
                page = browser.new_page(viewport={"width": 1280, "height": 1100})
                open_saved_notebook(page, notebook_url(server, f"{name}.ipynb", frontend))
                page.wait_for_function(
                    "() => { const i = window.jupyterapp.shell.currentWidget.node.querySelector("
                    "'img.nbdist-static-img'); return i && i.complete && i.naturalWidth > 0; }",
                    timeout=30_000)
                page.wait_for_timeout(2_000)  # a widget renderer would have reported by now
                kernel = page.evaluate(
                    "() => { const s = window.jupyterapp.shell.currentWidget.sessionContext;"
                    " return s.session && s.session.kernel ? s.session.kernel.name : null; }")
                trusted = page.evaluate(
                    "() => window.jupyterapp.shell.currentWidget.content.widgets[1].model.trusted")
                chart = _static_chart(page)
                page.locator("img.nbdist-static-img").first.screenshot(
                    path=str(artifacts / f"dashboard_saved_{frontend}_{name}.png"))
                seen[name] = {key: value for key, value in chart.items() if key != "text"}
                assert kernel is None, (name, kernel)
                assert trusted == (name == "trusted"), (name, trusted)
                assert chart["loaded"] and chart["svg"] and chart["width"] > 400 and chart["height"] > 200, (name, seen)
                text = str(chart["text"])
                for bad in ("model not found", "Error displaying widget", "Loading widget"):
                    assert bad not in text, (name, bad, text[-2000:])
                page.close()
        finally:
            browser.close()
    shutil.copy(tmp_path / "jupyterlab.log", artifacts / f"{frontend}_saved.log")
    print(json.dumps(seen))
