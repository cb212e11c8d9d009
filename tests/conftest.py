"""Fixtures shared by the tests: real clusters that always stop, fast fault settings, the small
model the strategy tests train, and a hygiene check for leaked processes, env vars, threads and
process groups."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nbformat
import psutil
import pytest
import torch

from nbdist import Cluster, torch_support
from nbdist.config import NbdistConfig
from tests.browser import FRONTENDS, cluster_notebook
from tests.kernels import KernelSession


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``fsdp2`` need FSDP2 on CPU ranks where their ``device`` is cpu (or unset):
    skipped, with the version it needs, on a torch that lacks it (.ci/floor-suite)."""
    if torch_support.has("fsdp2-cpu"):
        return
    skip = pytest.mark.skip(reason=torch_support.FEATURES["fsdp2-cpu"].requirement)
    for item in items:
        callspec = getattr(item, "callspec", None)
        device = callspec.params.get("device", "cpu") if callspec else "cpu"
        if item.get_closest_marker("fsdp2") and device == "cpu":
            item.add_marker(skip)

REPO = Path(__file__).resolve().parents[1]
TESTS_DIR = str(Path(__file__).resolve().parent) + os.sep

# Short knobs so faults resolve fast in tests; far below any process-group timeout.
_FAST = NbdistConfig(
    process_group_timeout=30.0,
    fault_settle=1.0,
    interrupt_grace=1.5,
    teardown_grace=2.0,
    telemetry_interval=0.2,
    stop_timeout=3.0,
)

# Process-wide, before any cluster starts: ranks inherit it (one thread each on a small machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + within
    while True:  # a zombie has exited: an orphan's may wait a while for init to reap it
        _gone, alive = psutil.wait_procs(procs, timeout=0.01)
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() > deadline:
            break
    assert not alive, f"processes still running: {[(p.pid, p.cmdline()[:3]) for p in alive]}"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def fast_config() -> NbdistConfig:
    """Short timeouts so faults resolve in seconds; tests derive from it with ``.replace(...)``."""
    return _FAST


@pytest.fixture(scope="session")
def assert_all_gone() -> Callable[..., None]:
    """``assert_all_gone(pids, within=10.0)``: fail unless every PID has exited within the deadline."""
    return _assert_all_gone


def _start(n: int, **kwargs: object) -> Cluster:
    return Cluster(n=n, config=_FAST, **kwargs).start()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster2() -> Iterator[Cluster]:
    cluster = _start(2)
    try:
        yield cluster
    finally:
        _assert_all_gone(cluster.stop())


@pytest.fixture(scope="module")
def cluster4() -> Iterator[Cluster]:
    cluster = _start(4)
    try:
        yield cluster
    finally:
        _assert_all_gone(cluster.stop())


@pytest.fixture
def cluster_factory() -> Iterator[object]:
    """Start clusters inside a test; every one is stopped (by PID) when the test ends."""
    started: list[Cluster] = []

    def make(n: int = 2, **kwargs: object) -> Cluster:
        cluster = Cluster(n=n, config=kwargs.pop("config", _FAST), **kwargs)  # type: ignore[arg-type]
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        _assert_all_gone(cluster.stop())  # stop() returns the PIDs it stopped


# --- the small model the strategy, memory and DeepSpeed tests train ---------------------------

# Runs on every rank before a test: a residual MLP whose blocks sit in a ModuleList (what
# per-block wrapping looks for). No head: with identical blocks, ZeRO's flat partitions end on
# parameter boundaries at 2 and 4 ranks, so measured bytes meet the formulas without slack.
_NET_CODE = """
from torch import nn

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

class Net(nn.Module):
    def __init__(self, d=384, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
"""

_MODEL_CODE = f"""
import os
os.environ.setdefault("TORCH_EXTENSIONS_DIR", {str(REPO / ".torch_extensions")!r})
import nbdist
{_NET_CODE}
_g = torch.Generator().manual_seed(100 + rank)
x, y = torch.randn(16, 384, generator=_g), torch.randn(16, 384, generator=_g)
probe = torch.randn(4, 384, generator=torch.Generator().manual_seed(7))
loss_fn = lambda out: ((out - y) ** 2).mean()

def build(strategy, seed=0, lr=1e-3, **options):
    torch.manual_seed(seed + rank)  # ranks start different: prepare must make them agree
    return nbdist.prepare(Net(), lambda ps: torch.optim.Adam(ps, lr=lr), strategy, **options)

def train(p, steps=5):
    losses = []
    for _ in range(steps):
        loss = loss_fn(p.model(x))
        p.backward(loss)
        p.step()
        losses.append(loss.item())
    return losses

def full_params(model):
    # a flat copy of every parameter's local data (FSDP2: this rank's shard)
    return torch.cat([getattr(q, "_local_tensor", q).detach().reshape(-1) for q in model.parameters()])
"""

# The cuda variant's ranks compute on their GPU: the batch and probe follow the model there.
_TO_DEVICE_CODE = "x, y, probe = x.to(device), y.to(device), probe.to(device)"


@pytest.fixture(scope="session")
def small_model_code() -> str:
    """Rank code defining ``Net``, ``x``/``y``/``probe``, ``loss_fn``, ``build``, ``train``, ``full_params``."""
    return _MODEL_CODE


@pytest.fixture(scope="session")
def small_model_psi() -> int:
    """Ψ of the small model: its parameter count (4 blocks of two 384×384 linears with biases)."""
    return 4 * 2 * (384 * 384 + 384)


@pytest.fixture(scope="module")
def ranks2(cluster2: Cluster) -> Cluster:
    """Two CPU/gloo ranks with the small model's code loaded."""
    cluster2.run(_MODEL_CODE).raise_for_errors()
    return cluster2


@pytest.fixture(scope="module")
def cuda_ranks2() -> Iterator[Cluster]:
    """Two NCCL ranks, one GPU each, with the small model's code loaded and its data on the GPU."""
    cluster = _start(2)
    try:
        cluster.run(_MODEL_CODE + _TO_DEVICE_CODE).raise_for_errors()
        yield cluster
    finally:
        _assert_all_gone(cluster.stop())


@pytest.fixture(params=[
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        GPUS < 2, reason="needs two CUDA GPUs (NCCL: one rank per device)")]),
])
def device(request: pytest.FixtureRequest) -> str:
    """The device a training or memory test runs on: always cpu, cuda where two GPUs exist."""
    return request.param


@pytest.fixture
def ranks2_on_device(device: str, request: pytest.FixtureRequest) -> Cluster:
    """``ranks2`` on the device under test (gloo/CPU or NCCL/CUDA)."""
    return request.getfixturevalue("ranks2" if device == "cpu" else "cuda_ranks2")


def _assert_consolidated_file_reproduces(cluster: Cluster, reference: torch.Tensor) -> None:
    """In one plain process, no process group: the consolidated checkpoint (the ranks' ``full``
    path) is an ordinary state dict that gives the ranks' output (``reference``) on ``probe``."""
    namespace: dict = {"torch": torch}
    exec(_NET_CODE, namespace)
    plain = namespace["Net"]()
    plain.load_state_dict(torch.load(cluster.pull("full")[0]))
    with torch.no_grad():
        assert torch.allclose(plain(cluster.pull("probe")[0]), reference, atol=1e-6)


@pytest.fixture(scope="session")
def assert_consolidated_file_reproduces() -> Callable[[Cluster, torch.Tensor], None]:
    """``assert_consolidated_file_reproduces(cluster, reference)``: see the function it returns."""
    return _assert_consolidated_file_reproduces


# --- the dashboard notebook the headless and browser tests execute ----------------------------

_TRAIN_CELL = """%%distributed
import time, torch, nbdist
layer = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(layer.parameters(), lr=0.05)
data = torch.randn(32, 64)
end = time.time() + {seconds}
step = 0
while time.time() < end:
    loss = layer(data).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss, wall=time.time())
    step += 1
    time.sleep(0.02)
"""


def _dashboard_notebook(seconds: float, ranks: int = 2) -> nbformat.NotebookNode:
    """Start a cluster, train for ``seconds`` with ``nbdist.log``, stop the cluster."""
    return cluster_notebook(f"-n {ranks}", _TRAIN_CELL.format(seconds=seconds))


@pytest.fixture(scope="session")
def dashboard_notebook() -> Callable[..., nbformat.NotebookNode]:
    """``dashboard_notebook(seconds, ranks=2)``: a notebook that trains with the live dashboard."""
    return _dashboard_notebook


# --- the browser tests: each runs in JupyterLab 4 and in Notebook 7 -----------------------------


@pytest.fixture(params=FRONTENDS)
def frontend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """Screenshots and logs for a human to look at: under the test's tmp_path (pytest keeps the
    last three runs' directories), never in the repository."""
    path = tmp_path / "artifacts"
    path.mkdir()
    print(f"browser artifacts: {path}")
    return path


# --- hygiene ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def no_leaked_processes() -> Iterator[None]:
    """Fail the module if it leaves child processes of the test process behind."""
    before = _children()
    yield
    leaked = _children() - before
    if leaked:
        _assert_all_gone(sorted(leaked), within=10.0)


def _started_from_test_code() -> bool:
    """Whether the Thread.start() being called comes from a file under tests/ (not a library)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == threading.__file__:
        frame = frame.f_back  # Timer and friends start themselves from threading.py
    return frame is not None and frame.f_code.co_filename.startswith(TESTS_DIR)


@pytest.fixture(autouse=True)
def no_leaked_env_threads_or_process_group() -> Iterator[None]:
    """Fail a test that changes os.environ (restored either way: use monkeypatch.setenv), leaves a
    thread it started running, or leaves a torch.distributed process group in this process.

    Only threads started by test code count: ipyparallel, zmq and nbdist keep their own threads
    for as long as a module-scoped cluster lives, which is by design.
    """
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's own
    started: list[threading.Thread] = []
    original_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if _started_from_test_code():
            started.append(thread)
        original_start(thread)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.start = original_start  # type: ignore[method-assign]
    problems = []

    now = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    changed = sorted(k for k in environ.keys() | now.keys() if environ.get(k) != now.get(k))
    if changed:
        for name in now.keys() - environ.keys():
            del os.environ[name]
        os.environ.update(environ)
        problems.append(f"changed environment variables {changed} (restored; use monkeypatch.setenv)")

    deadline = time.monotonic() + 5.0
    for thread in started:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [thread.name for thread in started if thread.is_alive()]
    if alive:
        problems.append(f"left threads it started running after 5 s: {alive}")

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        problems.append("left a torch.distributed process group initialized in the test process")

    if problems:
        pytest.fail("test hygiene: " + "; ".join(problems), pytrace=False)


# --- a real kernel, driven as a person would: cells in, typed answers to input() ----------------


@pytest.fixture
def real_kernel(tmp_path: Path) -> Iterator[KernelSession]:
    """A fresh ipykernel in tmp_path; its cluster is stopped and the kernel shut down after."""
    session = KernelSession(tmp_path)
    try:
        yield session
    finally:
        session.close()


# --- IPython's shell with the magics ------------------------------------------------------------


@pytest.fixture(scope="module")
def ip(assert_all_gone: Callable[..., None]) -> Iterator[object]:
    """IPython's global test shell with nbdist's magics loaded. After the module, the cluster its
    tests left running is stopped by PID and forgotten, as `%dist_stop` would: the next module
    starts with no current cluster (not a stopped one left behind)."""
    from IPython.testing import globalipapp

    from nbdist.notebook import magics

    # start_ipython() returns None once another module started the shell
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    yield shell
    cluster = magics.current_cluster()
    if cluster is not None and cluster.running:
        assert_all_gone(cluster.stop())  # stop() returns the PIDs it stopped
    magics._CURRENT = None
