"""README's quickstart, run as a reader runs it: each ```python block is one cell of a real kernel,
and what the cell prints is the ```text block under it, up to what changes from run to run (the
cluster's directory, seconds, PIDs, the host's name, the order in which ranks' lines arrive)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.kernels import KernelSession

pytestmark = pytest.mark.timeout(600)  # a cluster start on 2 busy cores, and four cells

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_VARYING = [  # what differs between two runs of the same cells, and the word it becomes
    (re.compile(r" in \S*nbdist-\S+"), " in DIR"),
    (re.compile(r"\b\d+(\.\d+)? s\b"), "T s"),
    (re.compile(r"\(PIDs [\d, ]+\)"), "(PIDs P)"),
    (re.compile(r"stopped \d+ process"), "stopped N process"),
    # a row of %dist_status's table: rank, local rank, host, pid, device, ...
    (re.compile(r"^(\d+ +\d+ +)\S+ +\d+ "), r"\1HOST PID "),
]


def quickstart_cells(readme: str) -> list[tuple[str, str]]:
    """README's Quickstart section as (cell source, the output README shows for it)."""
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = _BLOCK.findall(section)
    cells = []
    for (kind, source), (out_kind, output) in zip(blocks[::2], blocks[1::2], strict=True):
        assert (kind, out_kind) == ("python", "text"), "each cell is a python block, then text"
        cells.append((source, output))
    return cells


def _lines(text: str) -> list[str]:
    lines = []
    for line in _ANSI.sub("", text).splitlines():
        line = " ".join(line.split())
        for pattern, word in _VARYING:
            line = pattern.sub(word, line)
        if line:
            lines.append(line)
    return sorted(lines)  # ranks print in whichever order their lines arrive


def _run(kernel: KernelSession, source: str) -> str:
    shown: list[str] = []

    def keep(msg: dict) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            shown.append(content["text"])
        elif msg["msg_type"] in ("execute_result", "display_data"):
            shown.append(content["data"].get("text/plain", "") + "\n")

    reply = kernel.run(source, output_hook=keep)
    assert reply["status"] == "ok", f"README's cell failed:\n{source}\n{reply}"
    return "".join(shown)


def test_the_quickstart_has_four_cells_each_magic_first() -> None:
    cells = quickstart_cells((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(cells) == 4
    for source, _ in cells:
        assert "%%" not in source or source.startswith("%%"), f"a cell magic mid-cell:\n{source}"


def test_the_quickstart_cells_print_what_readme_shows(tmp_path: Path) -> None:
    cells = quickstart_cells((ROOT / "README.md").read_text(encoding="utf-8"))
    # README shows CPU ranks: a GPU machine would start NCCL ranks and print other devices
    kernel = KernelSession(tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        for source, shown in cells:
            assert _lines(_run(kernel, source)) == _lines(shown), source
    finally:
        kernel.close()


def _tutorial_order(text: str) -> list[str]:
    found = re.findall(r"notebooks/(\d\d_\w+)\.ipynb", text)
    return list(dict.fromkeys(found))  # first mention of each, in order


def test_readme_docs_and_site_list_every_tutorial_in_one_reading_order() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("\n## Tutorials\n", 1)[1].split("\n## ", 1)[0]
    order = _tutorial_order(table)
    assert sorted(order) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert _tutorial_order((ROOT / "docs/TUTORIALS.md").read_text(encoding="utf-8")) == order
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    assert _tutorial_order(nav) == order
    # what each builds on: 06's memory lesson before FSDP in 04, 14's profile of 02's DDP step
    assert order.index("06_memory_anatomy") < order.index("04_fsdp")
    assert order.index("02_ddp") < order.index("14_where_did_my_step_go")
