"""A rank's own widgets in a real notebook kernel: the kernel relays the rank's comm messages to
the frontend (here a jupyter_client, reading IOPub as JupyterLab would) and the frontend's back
to the rank. tests/rank_parity.check_widget covers the same through the Python API, on local
and on remote ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.kernels import KernelSession

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class Frontend(KernelSession):
    """A kernel driven as JupyterLab drives it: cells in, every IOPub message recorded."""

    def __init__(self, cwd: Path) -> None:
        super().__init__(cwd)
        self.messages: list[dict[str, Any]] = []

    def run(self, code: str, timeout: float = 180) -> list[dict[str, Any]]:
        """Every IOPub message until the cell's kernel goes idle (any parent: a comm opened
        from the kernel's channel thread counts too)."""
        msg_id = self.client.execute(code)
        seen: list[dict[str, Any]] = []
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            seen.append(msg)
            if (msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
                    and msg["parent_header"].get("msg_id") == msg_id):
                break
        reply = self.client.get_shell_msg(timeout=timeout)
        assert reply["content"]["status"] == "ok", seen[-5:]
        self.messages += seen
        return seen

    def send_comm(self, comm_id: str, data: dict[str, Any]) -> None:
        """What the frontend sends when the user moves a widget."""
        msg = self.client.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.client.shell_channel.send(msg)


@pytest.fixture
def frontend(tmp_path: Path) -> Any:
    session = Frontend(tmp_path)
    try:
        yield session
    finally:
        session.close()


def _streams(messages: list[dict[str, Any]]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


def test_a_slider_on_rank_0_is_drawn_and_moved(frontend: Frontend) -> None:
    frontend.run("%load_ext nbdist\n%dist_start -n 2")
    shown = frontend.run("%%distributed --ranks 0\nimport ipywidgets\n"
                         "slider = ipywidgets.IntSlider(value=3, description='lr')\n"
                         "display(slider)")
    opened = {m["content"]["comm_id"]: m["content"] for m in shown if m["msg_type"] == "comm_open"}
    views = [m["content"]["data"][WIDGET_VIEW]["model_id"] for m in shown
             if m["msg_type"] == "display_data" and WIDGET_VIEW in m["content"]["data"]]
    assert len(views) == 1, [m["msg_type"] for m in shown]
    model = opened[views[0]]  # the model the view needs, opened before it was shown
    assert model["target_name"] == "jupyter.widget" and model["data"]["state"]["value"] == 3
    order = [m["content"].get("comm_id") or m["msg_type"] for m in shown]
    assert order.index(views[0]) < order.index("display_data")

    frontend.send_comm(views[0], {"method": "update", "state": {"value": 7}, "buffer_paths": []})
    moved = frontend.run("%%distributed --ranks 0\nprint('value', slider.value)")
    assert "value 7" in _streams(moved)

    changed = frontend.run("%%distributed --ranks 0\nslider.value = 9")
    updates = [m["content"]["data"] for m in changed
               if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == views[0]]
    assert any(u.get("state", {}).get("value") == 9 for u in updates), updates


def test_a_tqdm_notebook_bar_on_a_rank_is_a_widget(frontend: Frontend) -> None:
    frontend.run("%load_ext nbdist\n%dist_start -n 2")
    ran = frontend.run("%%distributed\nfrom tqdm.notebook import tqdm\n"
                       "for _ in tqdm(range(20), desc=f'rank{rank}'): pass")
    bars = [m["content"]["comm_id"] for m in ran if m["msg_type"] == "comm_open"
            and m["content"]["data"]["state"].get("_model_name") == "FloatProgressModel"]
    assert len(bars) == 2  # one per rank
    values: dict[str, list[float]] = {bar: [] for bar in bars}
    for m in ran:
        state = m["content"].get("data", {}).get("state", {}) if m["msg_type"] == "comm_msg" else {}
        if m["content"].get("comm_id") in values and "value" in state:
            values[m["content"]["comm_id"]].append(state["value"])
    assert all(steps and steps[-1] == 20 for steps in values.values()), values
    assert "%|" not in _streams(ran)  # no text bar printed
