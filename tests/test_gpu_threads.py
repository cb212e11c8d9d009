"""The CPU half of the checks on a rank's threads off its main one and on what CUDA work they do:
which device each thread binds, logged values that fail or wait, the breakdown's peak that never
resets the user's counter, FSDP's fp16 gradient scaler. tests/test_gpu_threads_cuda.py proves the
GPU half."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from nbdist.memory.breakdown import forward_peak
from nbdist.strategies._common import spread_over_gpus
from nbdist.worker import metrics, thread_device
from nbdist.worker.agent import TelemetryAgent


def test_the_ranks_device_is_named_by_its_index() -> None:
    assert thread_device.cuda_index("cuda:1") == 1
    assert thread_device.cuda_index(torch.device("cuda", 3)) == 3
    assert thread_device.cuda_index(2) == 2
    assert thread_device.cuda_index(torch.device("cpu")) is None
    assert thread_device.cuda_index(None) is None


def test_the_main_thread_is_the_users_and_is_left_alone() -> None:
    # on this CPU build a set_device would raise: nothing is tried on the main thread
    assert thread_device.bind_thread("cuda:1") == "main"


# a GPU torch here refuses, so the binding shows without CUDA in the test process; a GPU host
# proves the real one (tests/test_gpu_threads_cuda.py) and would initialise CUDA here
ABSENT = 1
no_cuda_here = pytest.mark.skipif(torch.cuda.is_available(),
                                  reason="tests/test_gpu_threads_cuda.py binds a real GPU")


@no_cuda_here
def test_a_telemetry_thread_binds_the_ranks_gpu_before_its_first_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the thread tries the rank's GPU, says torch refused it, and keeps sampling; a CUDA build
    # sets CUDA_MODULE_LOADING when it tries, unless it is set already
    monkeypatch.setenv("CUDA_MODULE_LOADING", os.environ.get("CUDA_MODULE_LOADING", "LAZY"))
    sampled = threading.Event()
    agent = TelemetryAgent(0, 0.05, lambda _payload: None, device=f"cuda:{ABSENT}")
    agent.register("probe", lambda: sampled.set())
    agent.cell_running = True
    thread_device.BOUND.pop("nbdist-telemetry", None)
    agent.start()
    try:
        assert sampled.wait(10), "the telemetry thread never sampled"
    finally:
        agent.stop()
    assert thread_device.BOUND["nbdist-telemetry"].startswith(f"cuda:{ABSENT} refused ("), (
        thread_device.BOUND)


@no_cuda_here
def test_a_thread_told_no_device_takes_the_one_the_rank_was_pinned_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # what the release thread does: it has no agent to ask
    monkeypatch.setenv("NBDIST_DEVICE", f"cuda:{ABSENT}")
    monkeypatch.setenv("CUDA_MODULE_LOADING", os.environ.get("CUDA_MODULE_LOADING", "LAZY"))
    bound: list[str] = []
    thread = threading.Thread(target=lambda: bound.append(thread_device.bind_thread()))
    thread.start()
    thread.join()
    assert bound[0].startswith(f"cuda:{ABSENT} refused ("), bound


def test_every_thread_of_a_rank_that_samples_is_bound(cluster_factory) -> None:
    # the telemetry thread ticks; the release thread answers a where-are-you signal: both bind
    cluster = cluster_factory(1)
    code = (
        "import os, time\nfrom nbdist.worker import release, thread_device\n"
        "os.kill(os.getpid(), release.REPORT_SIGNAL)\n"
        "deadline = time.monotonic() + 20\n"
        "while len(thread_device.BOUND) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "sorted(thread_device.BOUND.items())"
    )
    result = cluster.run(code, timeout=60).raise_for_errors()
    assert result.grouped_values() == [
        ([0], "[('nbdist-release', 'cpu'), ('nbdist-telemetry', 'cpu')]")]


class _Pending(metrics.PendingValue):
    """A logged value whose event or read can fail, as a CUDA one can."""

    __slots__ = ("done", "number", "query_fails", "read_fails")

    def __init__(self, number: float, query_fails: bool = False, read_fails: bool = False):
        self.done = threading.Event()
        self.number = number
        self.query_fails = query_fails
        self.read_fails = read_fails

    def ready(self) -> bool:
        if self.query_fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done.is_set()

    def value(self) -> float:
        if self.read_fails:
            raise RuntimeError("the copy never finished")
        return self.number


@pytest.fixture
def metrics_agent():
    agent = TelemetryAgent(0, 0.5, lambda _payload: None)
    metrics.install_metrics(agent)
    yield agent
    metrics.uninstall_metrics(agent)


def test_a_failed_query_or_read_is_a_gap_and_a_waiting_value_keeps_its_place(
        metrics_agent) -> None:
    waiting = _Pending(0.5)
    done = _Pending(0.75, read_fails=True)
    done.done.set()
    metrics.log(step=0, loss=_Pending(9.0, query_fails=True), lr=0.1)
    metrics.log(step=1, loss=done)
    metrics.log(step=2, loss=waiting)
    metrics.log(step=3, loss=0.25)
    first = metrics.drain()
    # the failed ones are gaps, never a number from a buffer a copy may still be writing
    assert first["step"] == [0.0, 1.0] and first["values"]["loss"] == [None, None]
    assert first["values"]["lr"] == [0.1, None]
    assert metrics.drain() is None  # step 2 waits, step 3 behind it
    waiting.done.set()
    rest = metrics.drain()
    assert rest["step"] == [2.0, 3.0] and rest["values"]["loss"] == [0.5, 0.25]


def test_the_forward_peak_never_needs_the_counter_reset() -> None:
    gib = 2**30
    # the forward raised torch's counter: its reading is exact
    assert forward_peak(before=gib, counter_before=3 * gib, counter_after=4 * gib,
                        seen=2 * gib) == 3 * gib
    # it stayed under the user's earlier peak: the most seen as tensors were saved
    assert forward_peak(before=gib, counter_before=3 * gib, counter_after=3 * gib,
                        seen=2 * gib) == gib


def test_a_model_on_one_device_is_not_spread() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert spread_over_gpus(model) == []
    assert spread_over_gpus(model.to("meta")) == []


FP16_FSDP = """
import nbdist
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
p = nbdist.prepare(net, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy='fsdp',
                   mixed_precision='fp16')
x = torch.randn(4, 8)
def weights():
    return [w.full_tensor().clone() for w in p.model.parameters()]
start, scale = weights(), p.grad_scaler.get_scale()
p.backward(p.model(x).float().pow(2).mean() * float('inf'))  # every gradient inf or nan
p.step()
skipped = all(torch.equal(a, b) for a, b in zip(start, weights()))
halved = p.grad_scaler.get_scale() == scale / 2
p.backward(p.model(x).float().pow(2).mean())
p.step()
moved = not any(torch.equal(a, b) for a, b in zip(start, weights()))
finite = all(torch.isfinite(w).all().item() for w in weights())
(type(p.grad_scaler).__name__, skipped, halved, moved, finite)
"""


@pytest.mark.fsdp2
def test_fsdp_in_fp16_scales_the_loss_and_skips_an_overflowing_step(cluster_factory) -> None:
    cluster = cluster_factory(2)
    result = cluster.run(FP16_FSDP, timeout=120).raise_for_errors()
    assert result.grouped_values() == [([0, 1], "('GradScaler', True, True, True, True)")]


@pytest.mark.fsdp2
def test_bf16_needs_no_scaler(cluster_factory) -> None:
    cluster = cluster_factory(1)
    code = ("import nbdist\np = nbdist.prepare(torch.nn.Linear(4, 4), strategy='fsdp',\n"
            "                   mixed_precision='bf16')\np.grad_scaler is None")
    assert cluster.run(code, timeout=120).raise_for_errors().grouped_values() == [([0], "True")]

