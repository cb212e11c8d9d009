"""The `%%distributed --profile` view in headless Debian Chromium, in JupyterLab 4 and Notebook 7:
live, one row per rank with the collectives marked (and the static copy above it hidden); in a
notebook executed headless and opened with no kernel, the static SVG with one row per rank.
Setup: ``bash tests/browser_setup.sh``; run with ``-m browser``."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from tests.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    browser_tools,
    cluster_notebook,
    lab_server,
    notebook_url,
    open_saved_notebook,
    run_all_cells,
)

pytestmark = pytest.mark.browser

_PROFILED_CELL = """%%distributed --profile trace.json
import time, torch, torch.distributed as dist
t = torch.ones(1000)
for _ in range(3):
    if rank == 1:
        time.sleep(0.2)
    dist.all_reduce(t)
"""


def _profile_notebook() -> nbformat.NotebookNode:
    return cluster_notebook("-n 2", _PROFILED_CELL)

_VIEW_STATE = """() => {
    const root = document.querySelector('.nbdist-profile');
    const rows = [...root.querySelectorAll('g.nbdist-profile-row')];
    const img = document.querySelector('img.nbdist-profile-img');
    const ticks = [...root.querySelectorAll('svg.nbdist-profile-timeline > text')].map(t => t.textContent);
    return {rows: rows.map(r => r.dataset.rank), segments: rows.map(r => +r.dataset.segments),
            marks: root.querySelectorAll('.nbdist-profile-collective').length,
            summary: root.querySelector('.nbdist-profile-summary').textContent,
            staticHidden: !img || img.offsetParent === null, ticks};
}"""


@pytest.mark.timeout(300)
def test_profile_view_renders_live(tmp_path: Path, frontend: str, artifacts: Path) -> None:
    browser_tools(frontend)
    from playwright.sync_api import sync_playwright

    nbformat.write(_profile_notebook(), tmp_path / "profile.ipynb")
    with lab_server(tmp_path, frontend=frontend) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(notebook_url(server, "profile.ipynb", frontend))
            page.wait_for_function(
                "() => window.jupyterapp && document.querySelector('.jp-NotebookPanel .jp-Notebook')",
                timeout=60_000)
            run_all_cells(page, kernel_timeout_ms=60_000)
            page.wait_for_selector(".nbdist-profile g.nbdist-profile-row", timeout=120_000)
            page.wait_for_function(
                "() => document.body.innerText.includes('NBDIST-STOPPED')", timeout=120_000)
            page.locator(".nbdist-profile").first.scroll_into_view_if_needed()
            state = page.evaluate(_VIEW_STATE)
            page.locator(".nbdist-profile").first.screenshot(
                path=str(artifacts / f"profile_live_{frontend}.png"))
            assert state["rows"] == ["0", "1"], state
            assert all(count > 0 for count in state["segments"]), state
            assert state["marks"] == 3, state  # one mark per all_reduce, over its last rank
            assert "straggler: rank 1" in state["summary"], state
            assert state["staticHidden"], state  # the saved copy is not shown twice
            # the wheel zooms: the time axis shows a shorter span
            box = page.locator("svg.nbdist-profile-timeline").bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            for _ in range(6):
                page.mouse.wheel(0, -100)
            page.wait_for_timeout(300)
            zoomed = page.evaluate(_VIEW_STATE)
            assert zoomed["ticks"] != state["ticks"], (state["ticks"], zoomed["ticks"])
            assert (tmp_path / "trace.json").exists()
        finally:
            browser.close()
    shutil.copy(tmp_path / "jupyterlab.log", artifacts / f"profile_{frontend}.log")


@pytest.mark.timeout(300)
def test_saved_profile_shows_its_svg_without_a_kernel(tmp_path: Path, frontend: str,
                                                      artifacts: Path) -> None:
    browser_tools(frontend)
    from nbclient import NotebookClient
    from playwright.sync_api import sync_playwright

    nb = _profile_notebook()
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, tmp_path / "saved.ipynb")
    options = ("--KernelSpecManager.allowed_kernelspecs=nbdist-no-kernel",)
    with lab_server(tmp_path, *options, frontend=frontend) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            open_saved_notebook(page, notebook_url(server, "saved.ipynb", frontend))
            page.wait_for_function(
                "() => { const i = document.querySelector('img.nbdist-profile-img');"
                " return i && i.complete && i.naturalWidth > 0 && i.offsetParent !== null; }",
                timeout=30_000)
            src = page.evaluate("() => document.querySelector('img.nbdist-profile-img').src")
            page.wait_for_timeout(2_000)  # a widget renderer would have reported by now
            page.locator(".jp-Cell").nth(1).screenshot(
                path=str(artifacts / f"profile_saved_{frontend}.png"))
            outputs = page.evaluate(
                "() => [...document.querySelectorAll('.jp-Cell')[1].querySelectorAll("
                "'.jp-OutputArea-output')].map(o => o.innerText)")
        finally:
            browser.close()
    svg = base64.b64decode(src.split(",", 1)[1]).decode()
    assert svg.count('class="nbdist-profile-row"') == 2, svg[:500]
    assert 'data-rank="0"' in svg and 'data-rank="1"' in svg
    assert "straggler: rank 1" in svg
    print(json.dumps({"frontend": frontend, "svg_bytes": len(svg), "outputs": outputs}))
