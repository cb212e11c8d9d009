"""Direct cells (issue 14): a cell goes to local ranks over nbdist's own signed socket, not
through ipyparallel's controller, and a user cannot tell the difference except by its speed.
Real engines, a real process group; the same cells also go through ipyparallel on the same
ranks (``NbdistConfig.direct_cells=False``) and must give the same outcome.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
import zmq
from jupyter_client.session import Session

from nbdist import Cluster

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


@pytest.fixture
def through(cluster2: Cluster) -> Iterator[object]:
    """`through(direct: bool)`: send the next cells directly or through ipyparallel."""
    config = cluster2.config

    def choose(direct: bool) -> None:
        cluster2.config = dataclasses.replace(config, direct_cells=direct)

    yield choose
    cluster2.config = config


def test_a_cell_gives_the_same_outcome_directly_and_through_ipyparallel(cluster2, through):
    assert all(p.cell_port for p in cluster2.ranks), "local ranks listen for direct cells"
    through(False)
    via_ipyparallel = [_outcome(cluster2, MIXED), _outcome(cluster2, "1/0")]
    through(True)
    direct = [_outcome(cluster2, MIXED), _outcome(cluster2, "1/0")]
    assert direct == via_ipyparallel
    assert direct[0]["values"] == {0: "3.0", 1: "3.0"}
    assert direct[0]["stdout"][1] == "out 1\nstep 2\r\n"  # as ipyparallel keeps it
    assert direct[1]["errors"][0] == ("root", "ZeroDivisionError", "division by zero")


def test_direct_cells_do_not_pass_through_the_controller(cluster2):
    """With ipyparallel's controller frozen, a direct cell still runs and answers: the proof
    that it took the other way (through the controller it would hang)."""
    controller = psutil.Process(cluster2._controller_pid[0])
    family = [controller, *controller.children(recursive=True)]  # its schedulers forward cells
    for proc in family:
        proc.suspend()
    try:
        result = cluster2.run("_u = torch.ones(2) * rank\ndist.all_reduce(_u)\nfloat(_u[0])", timeout=10)
    finally:
        for proc in family:
            proc.resume()
    assert result.ok and {r: result.value_text(r) for r in result.ranks} == {0: "1.0", 1: "1.0"}


def test_an_unsigned_or_wrongly_signed_cell_is_refused(cluster2, tmp_path):
    """Anyone on the machine can reach a loopback port: a cell must carry the cluster's signature."""
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')"
    context = zmq.Context()
    try:
        for key in (b"", b"not the cluster key"):
            dealer = context.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(f"tcp://127.0.0.1:{cluster2.ranks[0].cell_port}")
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
    cluster2.run("import threading\nthreading.Timer(0.2, lambda: print('late')).start()").raise_for_errors()
    time.sleep(0.8)
    later = cluster2.run("print('mine')").raise_for_errors()
    assert later.stdout == {0: "mine\n", 1: "mine\n"}


def test_a_cell_with_top_level_await(cluster2):
    result = cluster2.run("import asyncio\nawait asyncio.sleep(0.01)\nrank * 10").raise_for_errors()
    assert {r: result.value_text(r) for r in result.ranks} == {0: "0", 1: "10"}


def test_the_stop_button_interrupts_a_direct_cell_and_the_ranks_go_on(cluster2):
    import threading

    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.perf_counter()
    result = cluster2.run("import time\nfor _ in range(600): time.sleep(0.05)")
    assert time.perf_counter() - started < 10
    assert result.interrupted and {e.kind for e in result.errors.values()} == {"interrupted"}
    assert cluster2.run("_v = torch.ones(1)\ndist.all_reduce(_v)\nfloat(_v[0])").raise_for_errors()
