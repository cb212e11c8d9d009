"""The rank service with real engines: commands by name only, answered on the service's own
thread while a cell runs or pdb waits; the protocol version compared at set-up; `%dist_env`."""

from __future__ import annotations

import builtins
import time
from typing import Any

import pytest

from nbdist import Cluster
from nbdist.errors import ClusterStartError, NbdistError
from tests.sinks import RecordingSink


def test_a_rank_refuses_a_command_it_does_not_have_and_names_it(cluster2) -> None:
    refused = cluster2.call("undo.snapshot", ranks=[0], timeout=30)
    assert not refused.results
    assert "no command 'undo.snapshot'" in refused.failures[0], refused.failures
    assert "env.collect" in refused.failures[0]  # and says what it has
    with pytest.raises(NbdistError, match="sleep is not a rank command"):
        cluster2.call(time.sleep, 0.1)  # a function is no command: it never reaches a rank


class _AskingSink(RecordingSink):
    """At rank 1's first line (its cell then sleeps 4 s), asks rank 1 for its environment and
    notes how long the answer took."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__()
        self.cluster = cluster
        self.answer: Any = None
        self.seconds = 0.0

    def on_stream(self, rank: int, name: str, text: str) -> None:
        super().on_stream(rank, name, text)
        if rank == 1 and self.answer is None:
            started = time.perf_counter()
            self.answer = self.cluster.call("env.collect", ranks=[1], timeout=3)
            self.seconds = time.perf_counter() - started


def test_the_service_answers_while_the_ranks_main_thread_runs_a_cell(cluster2) -> None:
    sink = _AskingSink(cluster2)
    code = "import time\nif rank == 1:\n    print('busy', flush=True)\n    time.sleep(4)\n"
    result = cluster2.run(code, sink=sink, timeout=60).raise_for_errors()
    assert sink.answer is not None and 1 in sink.answer.results, sink.answer.failures
    assert sink.seconds < 3 and result.elapsed > 3.5  # answered before the cell ended


def test_the_service_answers_while_the_rank_waits_in_pdb(cluster2, monkeypatch) -> None:
    answers: list[Any] = []

    def ask(prompt: str) -> str:  # the person at the prompt, meanwhile asking the rank
        answers.append(cluster2.call("env.collect", ranks=[1], timeout=5))
        return "c"

    monkeypatch.setattr(builtins, "input", ask)
    stopped = cluster2.run("breakpoint()\n'resumed'", ranks=[1], timeout=60)
    assert stopped.raise_for_errors().value_text(1) == "'resumed'"
    assert answers and 1 in answers[0].results, answers[0].failures
    assert answers[0].results[1].pid == cluster2.ranks[1].pid


def test_the_service_thread_is_marked_for_debuggers_to_skip(cluster2) -> None:
    probe = ("import threading\n"
             "[(t.pydev_do_not_trace, t.is_pydev_daemon_thread) for t in threading.enumerate() "
             "if t.name == 'nbdist-rank-service']")
    assert cluster2.run(probe, ranks=[0], timeout=30).value_text(0) == "[(True, True)]"


def test_env_marks_the_variable_one_rank_changed(cluster2) -> None:
    cluster2.run("import os\nos.environ['NBDIST_TEST_KNOB'] = 'changed'", ranks=[1],
                 timeout=30).raise_for_errors()
    try:
        table = cluster2.env()
        assert [env.rank for env in table.ranks] == [0, 1]
        assert table.differing == ["NBDIST_TEST_KNOB"]
        header, rows = table.rows()
        column = header.index("NBDIST_TEST_KNOB")
        assert [row[column] for row in rows] == [("(unset)", True), ("changed", True)]
        assert "changed*" in str(table) and "background:#ffe08a" in table._repr_html_()
        assert table.ranks[0].torch == table.ranks[1].torch != ""
    finally:
        cluster2.run("os.environ.pop('NBDIST_TEST_KNOB', None)", ranks=[1], timeout=30)


def test_a_rank_that_speaks_another_protocol_is_one_clear_line(cluster2) -> None:
    """As a host with another nbdist would answer the probe: both versions named, one line."""
    from nbdist.cluster import rank_setup

    cluster2.run("import nbdist.worker.bootstrap as b\nb.PROTOCOL = 998", ranks=[1],
                 timeout=30).raise_for_errors()
    try:
        engines = [p.spec.engine_id for p in cluster2.ranks]
        with pytest.raises(ClusterStartError) as raised:
            rank_setup.probe(cluster2.client, engines, 60)
        message = str(raised.value)
        assert "\n" not in message and "protocol 998" in message and "protocol 1 " in message
        assert f"engine {engines[1]}" in message, message
    finally:
        cluster2.run("b.PROTOCOL = __import__('nbdist.protocol').protocol.VERSION", ranks=[1],
                     timeout=30).raise_for_errors()


def test_a_notebook_that_speaks_another_protocol_starts_nothing(monkeypatch) -> None:
    import psutil

    from nbdist.protocol import wire

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    monkeypatch.setattr(wire, "VERSION", 997)  # this notebook's; the ranks keep theirs
    with pytest.raises(ClusterStartError, match=r"speaks nbdist protocol 1 .*this notebook "
                                                r"protocol 997") as raised:
        Cluster(n=1, threads=1).start()
    assert "\n" not in str(raised.value)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # everything the failed start began is stopped
        left = {p.pid for p in psutil.Process().children(recursive=True)} - before
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"processes left by the failed start: {sorted(left)}"


def test_dist_env_in_a_real_kernel(real_kernel) -> None:
    """The magic's table as a notebook shows it: HTML with the changed variable's cells marked."""
    results: list[dict] = []

    def keep(msg: dict) -> None:
        if msg["msg_type"] == "execute_result":
            results.append(msg["content"]["data"])

    assert real_kernel.run("%load_ext nbdist\n%dist_start -n 2")["status"] == "ok"
    assert real_kernel.run("%%distributed --ranks 1\nimport os\n"
                           "os.environ['NBDIST_TEST_KNOB'] = 'changed'")["status"] == "ok"
    assert real_kernel.run("%dist_env", output_hook=keep)["status"] == "ok"
    html, text = results[-1]["text/html"], results[-1]["text/plain"]
    assert "NBDIST_TEST_KNOB" in html and html.count("background:#ffe08a") == 2, html
    assert "changed*" in text and "(unset)*" in text, text
    reply = real_kernel.run("%dist_env --ranks 7")
    assert reply["status"] == "error" and "[7] do not exist" in reply["evalue"], reply


def test_a_request_the_rank_cannot_read_is_answered_with_why(cluster2) -> None:
    """Signed, but of a type this rank does not speak: whoever waits hears why at once."""
    channel = cluster2.channel()
    token = channel.new_token()
    channel.send(0, cluster2.ranks[0].endpoint, "nbdist_undo", {"token": token})
    channel.hold()
    try:
        started = time.perf_counter()
        answered = channel._answers(token, {0}, 20)
    finally:
        channel.release()
    assert "unknown message type 'nbdist_undo'" in answered.failures[0], answered.failures
    assert time.perf_counter() - started < 10  # not the deadline


def test_a_message_the_notebook_cannot_read_is_said_not_dropped(cluster2) -> None:
    sink = RecordingSink()
    code = ("from nbdist.worker import cell_channel as c\n"
            "c.SERVER.session.send(c.SERVER, 'nbdist_bogus', content={}, ident=c.SERVER.idents)\n"
            "print('after', flush=True)\n")
    cluster2.run(code, ranks=[0], sink=sink, timeout=30).raise_for_errors()
    said = [s for s in sink.statuses if "nbdist_bogus" in s]
    assert said and said[0].startswith("nbdist: rank 0: the notebook could not read"), said
    assert sink.text(0, "stdout") == "after\n"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_env_names_cuda_and_nccl_on_gpu_ranks(fast_config) -> None:
    """What a CPU build leaves empty: each rank's CUDA and NCCL versions and its GPUs, read on the
    service thread (whose CUDA context is not the main thread's)."""
    import torch

    with Cluster(config=fast_config) as cluster:
        table = cluster.env()
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        assert len(table.ranks) == torch.cuda.device_count(), table.failures
        for env in table.ranks:
            assert env.cuda == torch.version.cuda and env.nccl == nccl, env
            count = int(env.devices.split(" GPU(s)")[0])  # as the rank sees them
            assert 1 <= count <= torch.cuda.device_count(), env
        assert "cuda" not in table.differing and "nccl" not in table.differing


def test_an_unsigned_or_wrongly_signed_call_is_refused(cluster2, tmp_path) -> None:
    """The rank service's socket checks the cluster's key as the cell socket does: a forged call
    to a registered command (here one that writes a file) runs nothing."""
    import zmq
    from jupyter_client.session import Session

    from nbdist.protocol.wire import Call

    marker = tmp_path / "ran"
    cluster2.run("from nbdist.worker.rank_service import command\n"
                 "command('test.touch')(lambda path: open(path, 'w').write('x'))",
                 ranks=[0], timeout=30).raise_for_errors()
    tag, content, buffers = Call("forged", "test.touch", (str(marker),)).to_wire()
    context = zmq.Context()
    try:
        for key in (b"", b"not the cluster key"):
            dealer = context.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.connect(cluster2.ranks[0].endpoint.service_address)
            Session(key=key).send(dealer, tag, content=content, buffers=buffers)
            dealer.close()
        time.sleep(0.5)
        assert not marker.exists()
        signed = cluster2.call("test.touch", str(marker), ranks=[0], timeout=30)
        assert 0 in signed.results and marker.exists(), signed.failures  # the real one runs
    finally:
        context.term()
