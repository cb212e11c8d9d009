"""The cell channel: every cell goes to every rank over nbdist's own signed socket, not through
ipyparallel's controller, and a user cannot tell the difference except by its speed. Real
engines, a real process group; the same cell through ipyparallel's own `execute` on the same
engines is the reference its outcome must match. The checks of tests/rank_parity.py (await, the
stop button, breakpoint(), widgets) run here on local ranks and in tests/test_multihost.py on
ranks on other hosts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest
import zmq
from jupyter_client.session import Session

from nbdist import Cluster
from nbdist.cells.rank_errors import rank_error_from_remote
from nbdist.config import NbdistConfig
from tests import rank_parity
from tests.sinks import RecordingSink

MIXED = """
import sys
from IPython.display import HTML, display
print("out", rank)
print("err", rank, file=sys.stderr)
display(HTML(f"<b>rank {rank}</b>"))
for i in range(3):
    print(f"step {i}", end="\\r")
print()
_t = torch.ones(4) * (rank + 1)
dist.all_reduce(_t)
float(_t[0])
"""


def _outcome(cluster: Cluster, code: str) -> dict[str, object]:
    result = cluster.run(code)
    return {
        "stdout": result.stdout, "stderr": result.stderr,
        "displays": {r: [d["data"] for d in ds] for r, ds in result.displays.items()},
        "values": {r: result.value_text(r) for r in result.ranks},
        "errors": {r: (e.kind, e.ename, e.evalue) for r, e in result.errors.items()},
    }


def _outcome_through_ipyparallel(cluster: Cluster, code: str) -> dict[str, object]:
    """The same cell through ipyparallel's own execute on the same engines: what a plain
    ipyparallel user would get."""
    asyncs = {p.spec.rank: cluster.client[p.spec.engine_id].execute(code, silent=False, block=False)
              for p in cluster.ranks}
    for ar in asyncs.values():
        ar.wait(60)
        ar.wait_for_output(60)  # its output may come after the reply
    values: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    for rank, ar in asyncs.items():
        result = ar.execute_result
        values[rank] = result["data"]["text/plain"] if result else None
        if not ar.successful():
            error = rank_error_from_remote(rank, ar.exception())
            errors[rank] = (error.kind, error.ename, error.evalue)
    return {
        "stdout": {r: ar.stdout for r, ar in asyncs.items()},
        "stderr": {r: ar.stderr for r, ar in asyncs.items()},
        "displays": {r: [d["data"] for d in ar.outputs] for r, ar in asyncs.items()},
        "values": values, "errors": errors,
    }


def test_a_cell_gives_the_same_outcome_as_through_ipyparallel(cluster2):
    assert all(p.endpoint and p.endpoint.address.startswith("tcp://127.0.0.1:")
               for p in cluster2.ranks), "local ranks listen on loopback"
    reference = [_outcome_through_ipyparallel(cluster2, MIXED),
                 _outcome_through_ipyparallel(cluster2, "1/0")]
    channel = [_outcome(cluster2, MIXED), _outcome(cluster2, "1/0")]
    for ours, theirs in zip(channel, reference, strict=True):
        for key, value in theirs.items():
            assert ours[key] == value, key
    assert channel[0]["values"] == {0: "3.0", 1: "3.0"}
    assert channel[0]["stdout"][1] == "out 1\nstep 2\r\n"  # as ipyparallel keeps it
    assert channel[1]["errors"][0] == ("root", "ZeroDivisionError", "division by zero")


def test_cells_do_not_pass_through_the_controller(cluster2):
    """With ipyparallel's controller frozen, a cell still runs and answers: the proof that it
    took the other way (through the controller it would hang)."""
    controller = psutil.Process(cluster2._processes.controller[0])
    family = [controller, *controller.children(recursive=True)]  # its schedulers forward cells
    for proc in family:
        proc.suspend()
    try:
        result = cluster2.run("_u = torch.ones(2) * rank\ndist.all_reduce(_u)\nfloat(_u[0])",
                              timeout=10)
    finally:
        for proc in family:
            proc.resume()
    assert result.ok and {r: result.value_text(r) for r in result.ranks} == {0: "1.0", 1: "1.0"}


def test_an_unsigned_or_wrongly_signed_cell_is_refused(cluster2, tmp_path):
    """Anyone on the machine can reach a loopback port: a cell must carry the cluster's key."""
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')"
    context = zmq.Context()
    try:
        for key in (b"", b"not the cluster key"):
            dealer = context.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(cluster2.ranks[0].endpoint.address)
            Session(key=key).send(dealer, "nbdist_cell", content={"token": "forged", "code": code})
            dealer.close()
        time.sleep(0.5)
        assert not marker.exists()
        assert cluster2.run("rank").ok  # and the rank still takes real cells
    finally:
        context.term()


def test_output_printed_between_cells_does_not_reach_the_next(cluster2):
    """A thread that prints after its cell ended, while no cell runs: as through ipyparallel, the
    next cell does not show it (the engine hands its output to the channel only during a cell)."""
    timer = cluster2.run("import threading\nthreading.Timer(0.2, lambda: print('late')).start()")
    timer.raise_for_errors()
    time.sleep(0.8)
    later = cluster2.run("print('mine')").raise_for_errors()
    assert later.stdout == {0: "mine\n", 1: "mine\n"}


def test_direct_cells_is_accepted_with_a_deprecation_warning(cluster2):
    with pytest.warns(DeprecationWarning, match="direct_cells is deprecated"):
        config = NbdistConfig(direct_cells=False)
    with pytest.warns(DeprecationWarning, match="direct_cells is deprecated"):
        config.direct_cells = False
    assert "direct_cells" not in vars(config)
    saved = cluster2.config
    cluster2.config = config.replace(process_group_timeout=saved.process_group_timeout)
    try:
        rank_parity.collective_works(cluster2)  # over the channel all the same
    finally:
        cluster2.config = saved


def test_curve_encrypts_the_channel_and_a_plain_socket_gets_nothing_through(cluster_factory):
    cluster = cluster_factory(2, launcher_options={"curve": True})
    channel = cluster.cell_channel
    assert channel is not None and channel.public_key is not None
    assert all(p.endpoint.public_key for p in cluster.ranks)
    rank_parity.collective_works(cluster)
    # a correctly signed cell, sent without the CurveZMQ handshake: the rank never sees it
    marker = f"/tmp/nbdist-curve-{id(cluster)}"
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(cluster.ranks[0].endpoint.address)
        channel.session.send(dealer, "nbdist_cell",
                             content={"token": "plain", "code": f"open({marker!r}, 'w')"})
        time.sleep(0.5)
        dealer.close()
    finally:
        context.term()
    assert cluster.run(f"import os\nos.path.exists({marker!r})", ranks=[0]).value_text(0) == "False"


def test_top_level_await_and_its_deadline(cluster2):
    rank_parity.check_top_level_await(cluster2)


def test_an_await_cell_ends_with_ipythons_post_run_cell_like_any_other(cluster2):
    """The rank's own hooks (telemetry's cell end, the profiler, the in-flight wait) hang on it."""
    cluster2.run("ended = []\ndef _count(result=None): ended.append(1)\n"
                 "get_ipython().events.register('post_run_cell', _count)").raise_for_errors()
    try:
        cluster2.run("import asyncio\nawait asyncio.sleep(0)").raise_for_errors()
        assert cluster2.pull("ended") == {0: [1, 1], 1: [1, 1]}
    finally:
        cluster2.run("get_ipython().events.unregister('post_run_cell', _count)")


@pytest.mark.parametrize("code", ["import time\nfor _ in range(600): time.sleep(0.05)",
                                  "import asyncio\nawait asyncio.sleep(600)"],
                         ids=["sync", "await"])
def test_the_stop_button_interrupts_a_cell_and_the_ranks_go_on(cluster2, code):
    rank_parity.check_stop_button(cluster2, code)


def test_breakpoint_answers_over_the_channel(cluster2, monkeypatch):
    rank_parity.check_breakpoint(cluster2, monkeypatch, rank=1)


def test_a_ranks_widget_works_both_ways(cluster2, monkeypatch):
    rank_parity.check_widget(cluster2, monkeypatch, rank=0)


def test_a_widget_moved_during_a_pdb_prompt_moves_once_the_cell_ends(cluster2, monkeypatch):
    """The rank reads its channel itself while pdb waits: a widget message that comes meanwhile
    waits, as ipykernel would keep it, and reaches the widget once the cell is over."""
    import builtins

    import comm

    frontend = rank_parity.Frontend()
    monkeypatch.setattr(comm, "create_comm", frontend.create_comm)
    shown = cluster2.run("import ipywidgets\nfrom IPython.display import display\n"
                         "knob = ipywidgets.IntSlider(value=1)\ndisplay(knob)", ranks=[1])
    model = shown.raise_for_errors().displays[1][0]["data"][
        "application/vnd.jupyter.widget-view+json"]["model_id"]

    def ask(prompt: str = "") -> str:
        frontend.comms[model].from_frontend({"method": "update", "state": {"value": 5},
                                             "buffer_paths": []})
        return "c"

    monkeypatch.setattr(builtins, "input", ask)
    stopped = cluster2.run("seen = knob.value\nbreakpoint()\n(seen, knob.value)", ranks=[1],
                           timeout=30)
    assert stopped.raise_for_errors().value_text(1) == "(1, 1)"
    assert cluster2.run("knob.value", ranks=[1], timeout=30).value_text(1) == "5"


class _CallingSink(RecordingSink):
    """At rank 1's first line, has rank 0 (done with the cell) sleep 0.3 s through the channel
    (a command the test registered there), as the fault policy calls ranks done with a cell
    while others still run it: rank 1's lines keep coming meanwhile."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__()
        self.cluster = cluster
        self.answer: Any = None

    def on_stream(self, rank: int, name: str, text: str) -> None:
        super().on_stream(rank, name, text)
        if rank == 1 and self.answer is None:
            self.answer = self.cluster.call("test.sleep", 0.3, ranks=[0], timeout=10)


def test_a_call_made_while_a_cell_waits_leaves_the_cell_all_its_output(cluster2):
    code = ("import time\nif rank == 1:\n    for i in range(60):\n"
            "        print('line', i, flush=True)\n        time.sleep(0.01)\n")
    register = ("import time\nfrom nbdist.worker.rank_service import command\n"
                "command('test.sleep', main_thread=True)(time.sleep)\n")
    cluster2.run(register, ranks=[0], timeout=30).raise_for_errors()
    sink = _CallingSink(cluster2)
    cluster2.run(code, sink=sink, timeout=30).raise_for_errors()
    assert sink.answer is not None and sink.answer.results == {0: None}, sink.answer.failures
    assert sink.text(1, "stdout") == "".join(f"line {i}\n" for i in range(60))
    # and the channel reads as before once the cell is done
    pids = {rank: env.pid for rank, env in cluster2.call("env.collect").results.items()}
    assert pids == {p.spec.rank: p.pid for p in cluster2.ranks}


def test_a_notebook_without_torch_calls_ranks_and_handles_a_failed_cell_without_importing_it():
    """Torch takes seconds to import: a kernel that never imported it must not pay that in the
    fault policy's first call (it once did, and the stop-button ladder escalated meanwhile)."""
    script = """
import sys
from nbdist import Cluster
with Cluster(n=2, threads=1) as cluster:
    result = cluster.run("x = torch.ones(1)\\nif rank == 1:\\n    raise ValueError('broke')\\n"
                         "dist.all_reduce(x)\\n", timeout=60)
    assert [r for r, e in result.errors.items() if e.kind == "root"] == [1], result.errors
    assert not any("SIGINT" in action for action in result.actions), result.actions
    assert sorted(cluster.call("env.collect").results) == [0, 1]
print("torch imported:", "torch" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "torch imported: False" in proc.stdout, proc.stdout[-2000:]
