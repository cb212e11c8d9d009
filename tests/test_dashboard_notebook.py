"""A notebook executed headless (nbclient) keeps the dashboard's static SVG in its saved outputs,
and an HTML export shows the final charts without JavaScript or network.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import nbformat
import pytest


def _svg_outputs(cell: nbformat.NotebookNode) -> list[str]:
    return [out["data"]["image/svg+xml"] for out in cell.get("outputs", [])
            if out.get("output_type") == "display_data" and "image/svg+xml" in out.get("data", {})]


@pytest.mark.timeout(240)
def test_headless_execution_saves_the_final_svg(tmp_path: Path, dashboard_notebook) -> None:
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = dashboard_notebook(seconds=3.0)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, path)
    saved = nbformat.read(path, as_version=4)
    train = saved.cells[1]
    svgs = _svg_outputs(train)
    assert len(svgs) == 1, [out.get("output_type") for out in train.outputs]
    svg = svgs[0]
    # the snapshot is the one refreshed at cell end, not the near-empty one from the first log()
    assert "loss per rank" in svg and "no data yet" not in svg
    assert svg.count("<path") >= 2 * 3  # loss + allocated + reserved for each of 2 ranks
    assert "idle" in svg and "running" not in svg
    final = next(out for out in train.outputs if "image/svg+xml" in out.get("data", {}))
    # no widget view left: JupyterLab would show "model not found" for it without a live kernel
    # (nbclient's stored widget state is only loaded once a kernel runs) instead of the SVG
    assert "application/vnd.jupyter.widget-view+json" not in final["data"]
    # the same SVG as an <img> in text/html: what an untrusted notebook shows in JupyterLab
    img = re.fullmatch(r'<img class="nbdist-static-img" alt="([^"]*)" [^>]*'
                       r'src="data:image/svg\+xml;base64,([^"]+)">', final["data"]["text/html"])
    assert img is not None, final["data"]["text/html"][:300]
    assert "idle" in img.group(1) and base64.b64decode(img.group(2)).decode() == svg
    assert len(path.read_bytes()) < 200_000
    # HTML export (widget state left in the metadata, as nbclient stores it): the charts are there
    # offline, with no widget manager or CDN
    html, _ = HTMLExporter().from_notebook_node(saved)
    embedded = re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', html)
    texts = [base64.b64decode(data).decode() for data in embedded]
    assert any("loss per rank" in text and "nbdist-static" in text for text in texts)
