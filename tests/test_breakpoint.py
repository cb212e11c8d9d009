"""`breakpoint()` in a `%%distributed` cell, against real engines: the rank's pdb prompt comes to
the notebook, a peer waiting in a collective waits, `c` resumes, `q` fails that rank, the stop
button and a headless run never leave a rank hanging."""

from __future__ import annotations

from typing import Any

from IPython.core.error import StdinNotImplementedError

from tests.rank_parity import scripted_input
from tests.sinks import RecordingSink

# Rank 1 stops inside scale() while rank 0 goes on into the all_reduce and waits there.
CELL = """
def scale(x, factor):
    y = x * factor
    if rank == 1:
        breakpoint()
    z = y + 1
    return z

out = scale(torch.ones(2) * (rank + 1), 3)
dist.all_reduce(out)
print("result", out.tolist())
out.tolist()
"""


def _collective_works(cluster: Any) -> None:
    after = cluster.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()", timeout=30)
    after.raise_for_errors()
    assert after.grouped_values() == [([0, 1], "3.0")]


def test_step_print_and_continue(cluster2, monkeypatch):
    prompts = scripted_input(monkeypatch, ["p x", "n", "p y", "c"])
    sink = RecordingSink()
    result = cluster2.run(CELL, sink=sink, timeout=60)
    result.raise_for_errors()
    # (2 + 1) * 3 + 1 on rank 0 plus (1 + 1) * 3 + 1 on rank 1: rank 0 waited for rank 1's part
    assert result.grouped_values() == [([0, 1], "[11.0, 11.0]")]
    assert prompts == ["(rank 1 pdb) "] * 4
    shown = sink.text(1)
    assert "scale()\n-> z = y + 1" in shown  # rank 1's frame, where it stopped
    assert "tensor([2., 2.])" in shown  # p x
    assert "scale()\n-> return z" in shown and "tensor([6., 6.])" in shown  # n, then p y
    assert "pdb" not in sink.text(0) and not sink.statuses
    assert "result [11.0, 11.0]" in result.stdout[0]


def test_quit_fails_the_rank_and_releases_its_peer(cluster2, monkeypatch):
    scripted_input(monkeypatch, ["q"])
    result = cluster2.run(CELL, timeout=60)
    assert result.errors[1].kind == "root" and result.errors[1].ename == "BdbQuit"
    assert result.errors[0].kind == "collective"  # released by the normal fault policy
    assert any(a.startswith("tore down the process group on rank(s) 1") for a in result.actions)
    _collective_works(cluster2)


def test_stepping_past_the_end_of_the_cell_lets_it_finish(cluster2, monkeypatch):
    """`n` past the cell's last line leaves the cell: nbdist's after-cell code runs untraced (no
    one would answer a prompt there, and it holds the telemetry lock)."""
    prompts = scripted_input(monkeypatch, ["n"] * 20)
    result = cluster2.run("a = 1\nbreakpoint()\nb = a + 1\nb", ranks=[1], timeout=30)
    result.raise_for_errors()
    assert result.grouped_values() == [([1], "2")] and 2 <= len(prompts) < 20
    assert cluster2.run("b * 10", ranks=[1], timeout=10).grouped_values() == [([1], "20")]


def test_headless_run_continues_and_says_so_once(cluster2, monkeypatch):
    prompts = scripted_input(monkeypatch, [StdinNotImplementedError("no stdin")])
    sink = RecordingSink()
    looped = "for step in range(3):\n    if rank == 1:\n        breakpoint()\n" + CELL
    result = cluster2.run(looped, sink=sink, timeout=60)
    result.raise_for_errors()
    assert result.grouped_values() == [([0, 1], "[11.0, 11.0]")]
    assert len(prompts) == 1  # four stops on rank 1, one attempt to ask
    assert sink.statuses == ["nbdist: rank 1 stopped at breakpoint() but no one can answer "
                             "(StdinNotImplementedError): continuing"]


def test_stop_button_at_the_prompt_interrupts_the_ranks(cluster2, monkeypatch):
    scripted_input(monkeypatch, ["p x", KeyboardInterrupt()])
    result = cluster2.run(CELL, timeout=60)
    assert result.interrupted
    assert result.errors[1].ename == "KeyboardInterrupt"
    assert 0 in result.errors and cluster2.ranks[0].state == "alive"
    assert cluster2.ranks[1].state == "alive"  # SIGINT was enough: nothing was killed
    _collective_works(cluster2)


def test_without_the_channel_or_outside_the_main_thread_it_says_why(cluster2, monkeypatch):
    prompts = scripted_input(monkeypatch, [])
    result = cluster2.run(
        "import threading\nfrom nbdist.worker import cell_channel\n"
        "worker = threading.Thread(target=breakpoint)\nworker.start(); worker.join()\n"
        "saved, cell_channel.SERVER = cell_channel.SERVER, None\n"
        "try:\n    breakpoint()\nfinally:\n    cell_channel.SERVER = saved\n",
        ranks=[1], timeout=30)
    result.raise_for_errors()
    assert prompts == []
    lines = result.stderr[1].splitlines()
    assert lines[0].startswith("nbdist: rank 1: breakpoint() skipped: only a cell's main thread")
    assert lines[1].startswith("nbdist: rank 1: breakpoint() skipped: the rank has no cell "
                               "channel")


def test_breakpoint_in_a_real_kernel(real_kernel):
    """ipykernel: the prompt is an input_request on the stdin channel, labelled with the rank."""
    real_kernel.answer_with(["p x", "c"])
    assert real_kernel.run("%load_ext nbdist\n%dist_start -n 2")["status"] == "ok"
    assert real_kernel.run("%%distributed\nimport torch\n" + CELL)["status"] == "ok"
    text = real_kernel.text()
    assert real_kernel.prompts == ["(rank 1 pdb) "] * 2
    assert "scale()" in text and "tensor([2., 2.])" in text
    assert "result [11.0, 11.0]" in text
