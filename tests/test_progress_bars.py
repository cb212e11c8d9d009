"""tqdm in the ranks: one display per rank, updated in place, in a real kernel (its IOPub messages
as the notebook frontend receives them), never one printed line per redraw."""

from __future__ import annotations

from typing import Any

from nbdist.notebook.progress import ProgressBars, visible_text
from tests.kernels import KernelSession

TQDM_CELL = """%%distributed
from tqdm.auto import tqdm  # what most code imports: in a rank it must be the console bar
import time
print("before")
for _ in tqdm(range(30), desc=f"rank{rank} epoch", mininterval=0.05):
    time.sleep(0.02 + 0.02 * rank)
print("after")
"""


class _Recorder:
    def __init__(self) -> None:
        self.texts: list[str] = []

    def update(self, text: str) -> None:
        self.texts.append(text)


def test_redraws_update_one_display_and_the_newline_leaves_the_last() -> None:
    shown: list[_Recorder] = []
    clock = iter(float(t) for t in range(100))

    def show(text: str) -> _Recorder:
        shown.append(_Recorder())
        shown[-1].texts.append(text)
        return shown[-1]

    bars = ProgressBars(show, min_interval=0.5, clock=lambda: next(clock))
    for i in range(5):
        assert bars.redraw((0, "stderr"), f"{i * 20}%")
    bars.finish((0, "stderr"), "100%")
    assert len(shown) == 1 and shown[0].texts == ["0%", "20%", "40%", "60%", "80%", "100%"]
    assert visible_text("\r 10%|#\r 20%|##\r") == " 20%|##"


def test_without_a_frontend_a_bar_prints_its_final_state_once(capsys: Any) -> None:
    from nbdist.notebook.sink import NotebookSink

    sink = NotebookSink()
    sink.bars = ProgressBars(lambda text: None)  # what a plain Python process has
    for percent in (0, 25, 50, 75, 100):
        sink.on_stream(0, "stderr", f"\rbar {percent}%")
    sink.on_stream(0, "stderr", "\n")
    sink.on_stream(0, "stdout", "plain line\n")
    sink.on_stream(1, "stderr", "\rbar 50%")
    sink.flush()
    err = capsys.readouterr()
    assert err.err.count("bar") == 2 and "bar 100%\n" in err.err and "bar 50%\n" in err.err
    assert "\r" not in err.err and "plain line" in err.out


def _iopub(kernel: KernelSession, code: str, timeout: float = 180) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    reply = kernel.run(code, timeout, output_hook=messages.append)
    assert reply["status"] == "ok", messages[-3:]
    return messages


def test_tqdm_in_two_ranks_is_two_bars_updated_in_place(real_kernel: KernelSession) -> None:
    _iopub(real_kernel, "%load_ext nbdist\n%dist_start -n 2")
    messages = _iopub(real_kernel, TQDM_CELL)
    streams = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert "%|" not in streams, streams  # no bar redraw printed as a line
    assert "before" in streams and "after" in streams
    created = {m["content"]["transient"]["display_id"]: m["content"]["data"]["text/plain"]
               for m in messages if m["msg_type"] == "display_data"
               and "epoch" in m["content"]["data"].get("text/plain", "")}
    assert len(created) == 2, created  # one bar per rank
    last: dict[str, str] = {}
    updates = 0
    for m in messages:
        if m["msg_type"] == "update_display_data":
            last[m["content"]["transient"]["display_id"]] = m["content"]["data"]["text/plain"]
            updates += 1
    assert set(last) == set(created) and updates >= 6, (updates, last)
    for rank in (0, 1):
        final = next(text for text in last.values() if f"rank{rank} epoch" in text)
        assert "100%" in final and "30/30" in final, final
