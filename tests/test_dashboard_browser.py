"""JupyterLab in headless Debian Chromium: the dashboard appears under a %%distributed cell and
grows while 2 ranks train for ~10 s. Setup: ``bash tests/browser_setup.sh``; run with ``-m browser``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from tests.test_dashboard_notebook import dashboard_notebook

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).parent / "artifacts"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium missing: run bash tests/browser_setup.sh")
    pytest.importorskip("playwright")
    pytest.importorskip("jupyterlab")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for name in ("JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR"):
        env[name] = str(tmp_path / name.lower())  # never touch the user's Jupyter state
    log = open(tmp_path / "jupyterlab.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("JupyterLab did not answer /api/status within 60 s:\n"
                                       + (tmp_path / "jupyterlab.log").read_text()[-3000:]) from None
                time.sleep(0.25)
        yield f"{url}/lab/tree/dashboard.ipynb?token={token}", tmp_path
    finally:
        server.terminate()  # by PID: it shuts its kernels down, whose watchdogs end the engines
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=5)
        log.close()


@pytest.mark.timeout(300)
def test_dashboard_updates_live_in_jupyterlab(jupyterlab: tuple[str, Path]) -> None:
    from playwright.sync_api import sync_playwright

    url, root = jupyterlab
    nbformat.write(dashboard_notebook(seconds=10.0), root / "dashboard.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(url)
            page.wait_for_function(
                "() => window.jupyterapp && document.querySelector('.jp-NotebookPanel .jp-Notebook')",
                timeout=60_000)
            # wait for the kernel, then run everything as a user would
            page.wait_for_function(
                "() => { const w = window.jupyterapp.shell.currentWidget;"
                " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
                " && w.sessionContext.session.kernel.status === 'idle'; }", timeout=60_000)
            # not awaited: the command's promise resolves only when every cell has finished
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
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
                path = ARTIFACTS / f"dashboard_live_{index}.png"
                page.locator(".nbdist-dash").first.screenshot(path=str(path))
                shots.append(state)
            first, second = shots
            # both screenshots were taken mid-run: every rank still running
            assert first["states"] == second["states"] == "running,running", shots
            assert first["rows"] == 2
            assert second["points"] > first["points"], shots
            assert second["maxStep"] > first["maxStep"], shots
            assert second["memoryPoints"] >= first["memoryPoints"] > 0, shots
            # the cell ends: ranks go idle, the output is refreshed with the final static SVG
            page.wait_for_function(
                "() => document.body.innerText.includes('NBDIST-STOPPED')", timeout=120_000)
            page.wait_for_function(
                "() => (document.querySelector('.nbdist-dash') || {dataset: {}}).dataset.states === 'idle,idle'",
                timeout=30_000)
            latencies = page.evaluate("() => window.__b6")
            summary = {"screens": shots, "b6_browser_ms": {
                "samples": len(latencies),
                "median": 1e3 * statistics.median(latencies),
                "max": 1e3 * max(latencies)}}
            (ARTIFACTS / "dashboard_browser.json").write_text(json.dumps(summary, indent=1))
            print(json.dumps(summary))
            assert len(latencies) >= 5 and statistics.median(latencies) < 2.0, summary
        finally:
            browser.close()
    shutil.copy(root / "jupyterlab.log", ARTIFACTS / "jupyterlab.log")
