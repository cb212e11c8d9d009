"""A rank ends itself, its children first, once the notebook kernel is gone (nbdist.worker.orphan_
guard), between two small processes that stand for them: no engine, no torch. The whole cluster
after a kernel's SIGKILL: tests/test_faults.py, row 10."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

NOTEBOOK = """
import sys, time, psutil, zmq
pull = zmq.Context().socket(zmq.PULL)
port = pull.bind_to_random_port("tcp://127.0.0.1")
print(f"tcp://127.0.0.1:{port}", psutil.Process().create_time(), flush=True)
if sys.stdin.readline().strip() == "close":
    pull.close(linger=0)
    print("closed", flush=True)
time.sleep(600)
"""

RANK = """
import subprocess, sys, time, zmq
from nbdist.worker import orphan_guard
address, pid, created, grace = sys.argv[1:]
push = zmq.Context().socket(zmq.PUSH)
orphan_guard.guard(push, (int(pid), float(created)), float(grace))
push.connect(address)
child = subprocess.Popen(["sleep", "600"])
print(child.pid, flush=True)
time.sleep(600)
"""


ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's nbdist


class Pair:
    """A notebook process and a rank process connected to it, both killed at the end."""

    def __init__(self, grace: float, create_time_offset: float = 0.0) -> None:
        self.notebook = subprocess.Popen([sys.executable, "-c", NOTEBOOK], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        address, created = self.notebook.stdout.readline().split()
        self.rank = subprocess.Popen(
            [sys.executable, "-c", RANK, address, str(self.notebook.pid),
             # another create time: a process of that PID on another machine, as the rank sees it
             repr(float(created) + create_time_offset), str(grace)],
            stdout=subprocess.PIPE, text=True, env=ENV)
        self.child = int(self.rank.stdout.readline())
        self._wait_connected()

    def _wait_connected(self) -> None:
        deadline = time.monotonic() + 10
        me = psutil.Process(self.notebook.pid)
        while not any(c.status == psutil.CONN_ESTABLISHED for c in me.net_connections("tcp")):
            assert time.monotonic() < deadline, "the rank never connected to the notebook"
            time.sleep(0.02)

    def kill_notebook(self) -> float:
        self.notebook.kill()
        self.notebook.wait()
        return time.perf_counter()

    def close(self) -> None:
        for proc in (self.notebook, self.rank):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if psutil.pid_exists(self.child):
            psutil.Process(self.child).kill()


@pytest.fixture
def pairs():
    made: list[Pair] = []
    yield lambda *args: made.append(Pair(*args)) or made[-1]
    for pair in made:
        pair.close()


def test_a_rank_on_the_kernels_machine_ends_at_once_with_its_children(pairs, assert_all_gone):
    pair = pairs(5.0)
    killed = pair.kill_notebook()
    assert pair.rank.wait(timeout=10) == 0
    assert_all_gone([pair.child], within=5)
    assert time.perf_counter() - killed < 3.0  # well within the 5 s grace: the PID said so


def test_a_rank_elsewhere_waits_the_grace_for_a_reconnection_then_ends(pairs, assert_all_gone):
    pair = pairs(1.0, 1000.0)
    killed = pair.kill_notebook()
    assert pair.rank.wait(timeout=10) == 0
    assert time.perf_counter() - killed >= 1.0
    assert_all_gone([pair.child], within=5)


def test_a_notebook_that_closes_its_end_and_lives_on_never_ends_the_rank(pairs, assert_all_gone):
    pair = pairs(0.5)
    pair.notebook.stdin.write("close\n")
    pair.notebook.stdin.flush()
    assert pair.notebook.stdout.readline().strip() == "closed"
    with pytest.raises(subprocess.TimeoutExpired):
        pair.rank.wait(timeout=1.5)
    pair.kill_notebook()  # still watched: the kernel's end now ends it
    assert pair.rank.wait(timeout=10) == 0
    assert_all_gone([pair.child], within=5)


def test_only_ranks_nbdist_started_end_with_the_kernel() -> None:
    from nbdist.cluster.cell_channel import NotebookChannel

    channel = NotebookChannel(b"key", "hmac-sha256", "127.0.0.1", curve=False)
    try:
        owned = channel.setup_for("127.0.0.1", ends_with_kernel=True)
        attached = channel.setup_for("127.0.0.1", ends_with_kernel=False)
    finally:
        channel.close()
    assert owned.notebook_process == (psutil.Process().pid, psutil.Process().create_time())
    assert attached.notebook_process is None


def test_a_process_ending_itself_stops_its_children_and_never_freezes_itself(assert_all_gone):
    """What a rank's guard and the controller (when it leads no process group) end with: its
    children frozen and stopped, then its own exit (freezing itself would hang it for good)."""
    code = ("import subprocess\nfrom nbdist.worker.process_tree import exit_with_descendants\n"
            "child = subprocess.Popen(['sleep', '600'])\nprint(child.pid, flush=True)\n"
            "exit_with_descendants(grace=1.0)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=ENV)
    try:
        child = int(proc.stdout.readline())
        assert proc.wait(timeout=10) == 0
        assert_all_gone([child], within=5)
    finally:
        if proc.poll() is None:
            proc.kill()
