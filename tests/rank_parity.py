"""Checks that a rank behaves the same wherever it runs: each takes a running cluster (and the
rank to act on) and fails unless top-level await, the stop button, breakpoint() and a rank's own
widgets work there. tests/test_cell_channel.py runs them on local ranks, tests/test_multihost.py
on ranks on other hosts (SSH-launched engines in network namespaces)."""

from __future__ import annotations

import builtins
import os
import signal
import threading
import time
from typing import Any

import pytest

from nbdist import Cluster
from tests.sinks import RecordingSink

ALL_REDUCE = "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()"

# The rank named stops inside scale() while the others go on into the all_reduce and wait there.
BREAKPOINT_CELL = """
def scale(x, factor):
    y = x * factor
    if rank == {rank}:
        breakpoint()
    z = y + 1
    return z

out = scale(torch.ones(2) * (rank + 1), 3)
dist.all_reduce(out)
print("result", out.tolist())
out.tolist()
"""


def collective_works(cluster: Cluster) -> None:
    """Every rank alive and in one working process group."""
    n = cluster.world_size
    result = cluster.run(ALL_REDUCE, timeout=60).raise_for_errors()
    assert result.grouped_values() == [(list(range(n)), f"{float(n * (n + 1) // 2)}")]


def scripted_input(monkeypatch: pytest.MonkeyPatch, answers: list[Any]) -> list[str]:
    """builtins.input answers from `answers` (an exception instance is raised); returns the
    prompts it was asked with."""
    prompts: list[str] = []
    remaining = iter(answers)

    def ask(prompt: str = "") -> str:
        prompts.append(prompt)
        answer = next(remaining)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(builtins, "input", ask)
    return prompts


def check_top_level_await(cluster: Cluster) -> None:
    """An await cell runs on every rank, and its deadline interrupts it without killing any."""
    result = cluster.run("import asyncio\nawait asyncio.sleep(0.01)\nrank * 10", timeout=30)
    result.raise_for_errors()
    assert {r: result.value_text(r) for r in result.ranks} == {r: str(r * 10) for r in result.ranks}
    pids = [p.pid for p in cluster.ranks]
    started = time.perf_counter()
    stuck = cluster.run("import asyncio\nawait asyncio.sleep(600)", timeout=2)
    assert time.perf_counter() - started < 10
    assert stuck.timed_out and {e.kind for e in stuck.errors.values()} == {"interrupted"}, \
        stuck.failure_message()
    assert not any("SIGKILL" in action for action in stuck.actions), stuck.actions
    assert [p.pid for p in cluster.ranks] == pids and all(p.state == "alive" for p in cluster.ranks)
    collective_works(cluster)


def check_stop_button(cluster: Cluster, code: str) -> None:
    """The stop button (SIGINT to the notebook) interrupts `code` on every rank; none is killed."""
    pids = [p.pid for p in cluster.ranks]
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.perf_counter()
    try:
        result = cluster.run(code, timeout=60)
    finally:
        timer.join()
    assert time.perf_counter() - started < 15
    assert result.interrupted and {e.kind for e in result.errors.values()} == {"interrupted"}, \
        result.failure_message()
    assert all(e.where == "cell line 2" for e in result.errors.values()), result.errors
    assert [p.pid for p in cluster.ranks] == pids and all(p.state == "alive" for p in cluster.ranks)
    collective_works(cluster)


def check_breakpoint(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """`rank` stops at breakpoint(): its prompt comes to the notebook, the answers go back, the
    others wait in the all_reduce meanwhile."""
    prompts = scripted_input(monkeypatch, ["p x", "n", "p y", "c"])
    sink = RecordingSink()
    result = cluster.run(BREAKPOINT_CELL.format(rank=rank), sink=sink, timeout=60)
    result.raise_for_errors()
    n = cluster.world_size
    # each rank's (rank + 1) * 3 + 1, summed: the others waited for the stopped rank's part
    total = float(sum((r + 1) * 3 + 1 for r in range(n)))
    assert result.grouped_values() == [(list(range(n)), str([total, total]))]
    assert prompts == [f"(rank {rank} pdb) "] * 4
    shown = sink.text(rank)
    assert "scale()\n-> z = y + 1" in shown  # the rank's frame, where it stopped
    assert f"tensor([{rank + 1}., {rank + 1}.])" in shown  # p x
    assert "scale()\n-> return z" in shown and f"tensor([{3 * (rank + 1)}., " in shown  # n; p y
    assert all("pdb" not in sink.text(r) for r in range(n) if r != rank)
    assert not sink.statuses


class FrontendComm:
    """What a frontend holds of one comm the notebook kernel opened (as `comm.create_comm` makes
    them in a kernel): what the kernel sent, and a way to answer as the frontend would."""

    def __init__(self, comm_id: str, target_name: str, data: Any = None, metadata: Any = None,
                 buffers: Any = None, **_ignored: Any) -> None:
        self.comm_id, self.target_name, self.data = comm_id, target_name, data or {}
        self.sent: list[dict[str, Any]] = []
        self.closed = False
        self._on_msg: Any = None

    def on_msg(self, callback: Any) -> None:
        self._on_msg = callback

    def on_close(self, callback: Any) -> None:
        pass

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.sent.append(data or {})

    def close(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.closed = True

    def from_frontend(self, data: dict[str, Any]) -> None:
        self._on_msg({"content": {"comm_id": self.comm_id, "data": data}, "buffers": []})

    def states(self) -> list[dict[str, Any]]:
        updates = [m for m in self.sent if m.get("method") in ("update", "echo_update")]
        return [m.get("state", {}) for m in updates]


class Frontend:
    """The comms the notebook kernel opened, by id (install as `comm.create_comm`)."""

    def __init__(self) -> None:
        self.comms: dict[str, FrontendComm] = {}

    def create_comm(self, **kwargs: Any) -> FrontendComm:
        opened = FrontendComm(**kwargs)
        self.comms[opened.comm_id] = opened
        return opened

    def wait_for_state(self, comm_id: str, name: str, value: Any, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not any(s.get(name) == value for s in self.comms[comm_id].states()):
            assert time.monotonic() < deadline, (f"the frontend never got {name}={value!r}: "
                                                 f"{self.comms[comm_id].sent}")
            time.sleep(0.02)


def check_widget(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """A slider made on `rank` is drawn by the frontend from the rank's model, and its changes
    travel both ways: the frontend's to the rank, the rank's (in a cell or after it) to the
    frontend; a tqdm.notebook bar there ends at 100%."""
    import comm

    frontend = Frontend()
    monkeypatch.setattr(comm, "create_comm", frontend.create_comm)
    shown = cluster.run("import ipywidgets\nfrom IPython.display import display\n"
                        "slider = ipywidgets.IntSlider(value=3)\ndisplay(slider)",
                        ranks=[rank], timeout=30).raise_for_errors()
    view = shown.displays[rank][0]["data"]["application/vnd.jupyter.widget-view+json"]
    twin = frontend.comms[view["model_id"]]
    assert twin.target_name == "jupyter.widget" and twin.data["state"]["value"] == 3
    twin.from_frontend({"method": "update", "state": {"value": 7}, "buffer_paths": []})
    assert cluster.run("slider.value", ranks=[rank], timeout=30).value_text(rank) == "7"
    cluster.run("slider.value = 9", ranks=[rank], timeout=30).raise_for_errors()
    frontend.wait_for_state(twin.comm_id, "value", 9)
    cluster.run("import threading\nthreading.Timer(0.3, setattr, (slider, 'value', 11)).start()",
                ranks=[rank], timeout=30).raise_for_errors()
    frontend.wait_for_state(twin.comm_id, "value", 11)  # sent while no cell runs
    bar = cluster.run("from tqdm.notebook import tqdm\nfor _ in tqdm(range(5)): pass",
                      ranks=[rank], timeout=30).raise_for_errors()
    assert "%|" not in bar.stderr[rank]  # drawn as a widget, not as text
    models = {c.comm_id: c.data["state"].get("_model_name") for c in frontend.comms.values()}
    progress = [comm_id for comm_id, model in models.items() if model == "FloatProgressModel"]
    assert len(progress) == 1, models
    frontend.wait_for_state(progress[0], "value", 5)
