"""The per-rank view in JupyterLab 4 and Notebook 7 (headless Debian Chromium), as a person sees
it: 8 ranks print while a cell runs; the filter switches the view to rank 5, then to ranks 3 and
5, then to 0-3; a rank fails and, once the cell ends, the saved view lists it first, open, and
the lines every rank printed read once in the cell's text. Screenshots land under the test's
artifacts directory. Setup: ``bash tests/browser_setup.sh``; run with ``-m browser``."""

from __future__ import annotations

import shutil
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
    cluster_notebook,
    lab_server,
    notebook_url,
    run_all_cells,
)

pytestmark = pytest.mark.browser

_CELL = """%%distributed
import time
dist.barrier()
print("same on all ranks")
for step in range(30):
    print(f"rank {rank} step {step}" + (" (the odd one)" if rank == 3 else ""))
    time.sleep(0.2)
if rank == 6:
    raise RuntimeError("rank 6 gave up")
"""


@pytest.fixture
def server(tmp_path: Path, frontend: str) -> Iterator[tuple[str, Path]]:
    browser_tools(frontend)
    with lab_server(tmp_path, frontend=frontend) as url:
        yield notebook_url(url, "ranks.ipynb", frontend), tmp_path


def _shown(page: Any) -> dict[str, Any]:
    return page.evaluate("""() => {
        const root = document.querySelector('.nbdist-ranks');
        return {selected: root.dataset.selected, states: root.dataset.states,
                panes: [...root.querySelectorAll('.nbr-out')].map(p => p.dataset.rank),
                text: [...root.querySelectorAll('.nbr-out pre')].map(p => p.textContent)};
    }""")


@pytest.mark.timeout(300)
def test_the_filter_switches_ranks_live_and_the_saved_view_lists_errors_first(
        server: tuple[str, Path], frontend: str, artifacts: Path) -> None:
    from playwright.sync_api import sync_playwright

    url, root = server
    nbformat.write(cluster_notebook("-n 8 --threads 1", _CELL), root / "ranks.ipynb")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(url)
            run_all_cells(page, kernel_timeout_ms=90_000)
            page.wait_for_selector(".nbdist-ranks .nbr-chip", timeout=120_000)
            page.wait_for_function(
                "() => (document.querySelector('.nbdist-ranks').dataset.states.match(/running/g)"
                " || []).length === 8 && document.querySelector('.nbdist-ranks .nbr-last')"
                ".textContent.includes('step')", timeout=60_000)
            filter_box = page.locator(".nbdist-ranks .nbr-filter")
            filter_box.fill("5")
            page.wait_for_timeout(1_200)  # two view updates: the reader's choice must survive them
            one = _shown(page)
            assert one["selected"] == "5" and one["panes"] == ["5"], one
            assert "rank 5 step" in one["text"][0] and "rank 3" not in one["text"][0], one
            view = page.locator(".nbdist-ranks")
            view.screenshot(path=str(artifacts / f"live_rank5_{frontend}.png"))
            page.locator('.nbdist-ranks .nbr-chip[data-rank="3"]').click(modifiers=["Shift"])
            two = _shown(page)
            assert two["selected"] == "3,5" and "(the odd one)" in two["text"][0], two
            filter_box.fill("0-3")
            assert _shown(page)["panes"] == ["0", "1", "2", "3"]
            view.screenshot(path=str(artifacts / f"live_group_{frontend}.png"))
            _check_saved(page, frontend, artifacts)
        finally:
            browser.close()
    shutil.copy(root / "jupyterlab.log", artifacts / f"{frontend}.log")


def _check_saved(page: Any, frontend: str, artifacts: Path) -> None:
    """The cell ended: the widget gave way to the static view, rank 6 first and open."""
    page.wait_for_function("() => document.querySelector('.nbdist-ranks-static')"
                           " && !document.querySelector('.nbdist-ranks')", timeout=120_000)
    saved = page.evaluate("""() => {
        const root = document.querySelector('.nbdist-ranks-static');
        return [...root.querySelectorAll('details')].map(d => ({
            summary: d.querySelector('summary').innerText, open: d.open}));
    }""")
    assert saved[0]["summary"].startswith("rank 6") and saved[0]["open"], saved
    assert "failed" in saved[0]["summary"] and not any(d["open"] for d in saved[1:]), saved
    page.locator(".nbdist-ranks-static details").nth(1).locator("summary").click()
    assert page.locator(".nbdist-ranks-static details").nth(1).evaluate("d => d.open")
    page.locator(".nbdist-ranks-static").screenshot(path=str(artifacts / f"saved_{frontend}.png"))
    text = "\n".join(cell_outputs(page, 1))
    assert text.count("same on all ranks") == 1 and "[ranks 0-7] same on all ranks" in text, text
    assert "rank 6 raised RuntimeError: rank 6 gave up" in text
