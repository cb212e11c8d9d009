"""What the browser tests share: headless Debian Chromium, a JupyterLab 4 or Notebook 7 server on
loopback, the notebook they open, and the steps a person takes there (run every cell, read a
cell's outputs, open a saved notebook with no kernel). Setup: ``bash tests/browser_setup.sh``."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


FRONTENDS = ("lab", "notebook")
"""`jupyter lab` (JupyterLab 4) and `jupyter notebook` (Notebook 7, built on JupyterLab's parts)."""

_FRONTEND_OPTIONS = {
    "lab": ("--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"),
    "notebook": ("--JupyterNotebookApp.expose_app_in_browser=True",),
}


def browser_tools(frontend: str = "lab") -> None:
    """Skip the test where Chromium, Playwright or the frontend is missing."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium missing: run bash tests/browser_setup.sh")
    pytest.importorskip("playwright")
    pytest.importorskip("jupyterlab")
    if frontend == "notebook":
        notebook = pytest.importorskip("notebook", reason="install the browser extra (notebook>=7)")
        if int(notebook.__version__.split(".")[0]) < 7:
            pytest.skip(f"Notebook {notebook.__version__}: the test needs Notebook 7")


@contextmanager
def lab_server(root: Path, *options: str, frontend: str = "lab") -> Iterator[str]:
    """JupyterLab (or Notebook 7) on 127.0.0.1 serving ``root``; yields ``url?token``."""
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for name in ("JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR"):
        env[name] = str(root / name.lower())  # never touch the user's Jupyter state
    log = open(root / "jupyterlab.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", frontend, "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         *_FRONTEND_OPTIONS[frontend], *options],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
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
                    raise RuntimeError(f"jupyter {frontend} did not answer /api/status in 60 s:\n"
                                       + (root / "jupyterlab.log").read_text()[-3000:]) from None
                time.sleep(0.25)
        yield f"{url}?token={token}"
    finally:
        server.terminate()  # by PID: it shuts its kernels down; engines end with their kernel
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=5)
        log.close()


def open_saved_notebook(page: Any, url: str) -> None:
    """Open a saved notebook with no kernel: wait for its outputs, dismiss the kernel dialog."""
    page.goto(url)
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.node.querySelector('.jp-OutputArea-output')",
        timeout=60_000)
    # the kernel dialog (only "No Kernel" to pick) appears once the session is set up
    try:
        page.wait_for_selector(".jp-Dialog .jp-mod-accept", timeout=15_000)
        page.click(".jp-Dialog .jp-mod-accept")
    except Exception:
        pass  # no dialog: nothing to dismiss


def notebook_url(server: str, name: str, frontend: str = "lab") -> str:
    base, token = server.split("?")
    if frontend == "notebook":
        return f"{base}/notebooks/{name}?{token}"
    return f"{base}/lab/tree/{name}?reset&{token}"  # reset: no workspace reopens other notebooks


def cluster_notebook(start: str, cell: str) -> nbformat.NotebookNode:
    """Three cells: load nbdist and ``%dist_start {start}``, then `cell`, then stop the cluster
    and print NBDIST-STOPPED (what a test waits for to know every cell ran)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(f"%load_ext nbdist\n%dist_start {start}"),
                nbformat.v4.new_code_cell(cell),
                nbformat.v4.new_code_cell("%dist_stop\nprint('NBDIST-STOPPED')")]
    return nb


_KERNEL_IDLE = (
    "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
    " return w && w.sessionContext && w.sessionContext.session"
    " && w.sessionContext.session.kernel"
    " && w.sessionContext.session.kernel.status === 'idle'; }")


def run_all_cells(page: Any, kernel_timeout_ms: int) -> None:
    """Wait for the open notebook's kernel to be idle, then run every cell as a person would."""
    page.wait_for_function(_KERNEL_IDLE, timeout=kernel_timeout_ms)
    # not awaited: the command's promise resolves only when every cell has finished
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def cell_outputs(page: Any, index: int) -> list[str]:
    """The cell's outputs as drawn (scrolled into view: both frontends window long notebooks)."""
    page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                  ".scrollIntoView()", index)
    page.wait_for_function(
        "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
        ".querySelector('.jp-OutputArea-output')", arg=index, timeout=10_000)
    return page.evaluate(
        "(i) => [...window.jupyterapp.shell.currentWidget.content.widgets[i].node"
        ".querySelectorAll('.jp-OutputArea-output')].map(o => o.innerText)", index)
