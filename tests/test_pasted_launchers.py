"""Launchers pasted into cells: PyTorch's DDP tutorial with `mp.spawn`, `start_processes`,
`multiprocessing.Process` one per rank, accelerate's `notebook_launcher`, and `!torchrun` /
`!deepspeed` / `!accelerate launch`. Real engines; no rank starts a child process; a model trained
before survives; the last test drives a real kernel through nbclient."""

from __future__ import annotations

import textwrap
from importlib.util import find_spec
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from nbdist import Cluster
from nbdist.worker.pasted_code import launcher_in

# PyTorch's "Getting Started with Distributed Data Parallel" tutorial, as pasted (CPU: gloo, no
# `.to(rank)`); the bottom line counts devices, here the 2 the tutorial would use
DDP_TUTORIAL = """
import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    tutorial_weights.append(model.net1.weight.detach().clone())
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")

def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)

if __name__ == "__main__":
    tutorial_weights = []
    run_demo(demo_basic, 2)
"""

# a model trained before the pasted tutorial, by hand: gradients averaged with all_reduce
TRAIN_BEFORE = """
import psutil
children_before = {p.pid for p in psutil.Process().children(recursive=True)}
torch.manual_seed(0)
kept = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(kept.parameters(), lr=0.1)
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
def train_kept(steps=3):
    for _ in range(steps):
        opt.zero_grad()
        kept(x).pow(2).mean().backward()
        for q in kept.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world_size
        opt.step()
train_kept()
kept_before = [q.detach().clone() for q in kept.parameters()]
"""

NO_CHILDREN = ("new_children = {p.pid for p in psutil.Process().children(recursive=True)}"
               " - children_before")


@pytest.fixture(scope="module")
def cluster(cluster2: Cluster) -> Cluster:
    return cluster2


def _assert_usable_and_model_kept(cluster: Cluster) -> None:
    """No rank started a process; the model from before is intact and trains on in the group."""
    cluster.run(NO_CHILDREN).raise_for_errors()
    assert cluster.pull("new_children") == {0: set(), 1: set()}
    cluster.run(
        "assert all(torch.equal(a, b) for a, b in zip(kept_before, kept.parameters()))\n"
        "train_kept()\nflat = torch.cat([q.detach().reshape(-1) for q in kept.parameters()])"
    ).raise_for_errors()
    flats = cluster.pull("flat")
    assert flats[0].equal(flats[1])  # gradients still averaged across both ranks


def test_the_ddp_tutorial_pasted_into_a_cell_runs_on_the_ranks_in_place(cluster: Cluster) -> None:
    cluster.run(TRAIN_BEFORE).raise_for_errors()
    result = cluster.run(DDP_TUTORIAL, timeout=60).raise_for_errors()
    assert result.stdout[0].splitlines() == [
        "nbdist: mp.spawn(demo_basic, nprocs=2) runs demo_basic(rank, ...) in place on each of "
        "the 2 ranks: they already are the processes it would start",
        "Running basic DDP example on rank 0.",
        "nbdist: init_process_group() skipped: the cluster's process group is already up "
        "(gloo, world size 2, rank 0)",
        "Finished running basic DDP example on rank 0.",
    ]
    assert result.stdout[1].splitlines() == ["Running basic DDP example on rank 1.",
                                             "Finished running basic DDP example on rank 1."]
    assert any("re-formed" in a for a in result.actions)  # the tutorial's cleanup() destroyed it
    weights = cluster.pull("tutorial_weights")
    assert weights[0][0].equal(weights[1][0])  # one DDP step over both ranks: replicas agree
    _assert_usable_and_model_kept(cluster)


@pytest.mark.parametrize("call, asked", [
    ("mp.spawn(f, nprocs=4)", 4),
    ("mp.start_processes(f, args=(1,), nprocs=torch.cuda.device_count())", 0),
])
def test_another_process_count_says_what_the_ranks_are_and_what_to_write(
        cluster: Cluster, call: str, asked: int) -> None:
    cluster.run(TRAIN_BEFORE).raise_for_errors()
    result = cluster.run(f"import torch.multiprocessing as mp\ndef f(i, *a): print(i)\n{call}")
    assert sorted(result.errors) == [0, 1]
    error = result.errors[0]
    assert error.ename == "LauncherInCellError"
    assert f"nprocs={asked}) asks for {asked} processes" in error.evalue
    assert "2 ranks already are 2 processes in one process group" in error.evalue
    assert "`f(rank, *args)`" in error.evalue and "`nprocs=world_size`" in error.evalue
    assert not result.actions  # an ordinary error: the group was never touched
    _assert_usable_and_model_kept(cluster)


# PyTorch's "Writing Distributed Applications" tutorial: one multiprocessing.Process per rank
PROCESS_PER_RANK = """
import torch.multiprocessing as mp

def run(rank, size):
    tensor = torch.ones(1) * (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print(f"Rank {rank} has data {tensor.item()}")
    totals.append(tensor.item())

def init_process(rank, size, fn, backend="gloo"):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)

totals, processes = [], []
for r in range(COUNT):
    p = mp.Process(target=init_process, args=(r, COUNT, run))
    p.start()
    processes.append(p)
for p in processes:
    p.join()
exit_codes = [p.exitcode for p in processes]
"""


def test_a_process_per_rank_runs_in_place_and_too_few_is_explained(cluster: Cluster) -> None:
    cluster.run(TRAIN_BEFORE).raise_for_errors()
    result = cluster.run("import os\n" + PROCESS_PER_RANK.replace("COUNT", "2"), timeout=60)
    result.raise_for_errors()
    assert result.stdout[0].splitlines()[0].startswith(
        "nbdist: multiprocessing.Process(target=init_process, args=(i, ...)) runs on rank i")
    assert "Rank 1 has data 3.0" in result.stdout[1]
    assert cluster.pull("totals") == {0: [3.0], 1: [3.0]}
    assert cluster.pull("exit_codes") == {0: [0, 0], 1: [0, 0]}

    too_few = cluster.run("import os\n" + PROCESS_PER_RANK.replace("COUNT", "1"), timeout=60)
    assert too_few.errors[1].ename == "LauncherInCellError"  # rank 1 had nothing to run
    assert "started processes for ranks [0] only, so rank(s) [1]" in too_few.errors[1].evalue
    too_many = cluster.run("import os\n" + PROCESS_PER_RANK.replace("COUNT", "3"), timeout=60)
    assert "world_size=3 (the cluster has 2 ranks)" in too_many.errors[1].evalue  # its own init
    beyond = cluster.run("def g(i):\n    pass\nmp.Process(target=g, args=(2,)).start()")
    assert sorted(beyond.errors) == [0, 1]
    assert "starts a process for rank 2" in beyond.errors[0].evalue
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2").raise_for_errors()
    _assert_usable_and_model_kept(cluster)


def test_a_process_that_is_not_one_per_rank_is_a_real_process(cluster: Cluster) -> None:
    """A library's target (here `time.sleep`), or no rank as first argument: a real child."""
    cluster.run(textwrap.dedent("""
        import multiprocessing, time
        helper = multiprocessing.Process(target=time.sleep, args=(0.01,))
        helper.start()
        helper.join()
        codes = (helper.pid != os.getpid(), helper.exitcode)
    """)).raise_for_errors()
    assert cluster.pull("codes") == {0: (True, 0), 1: (True, 0)}


def test_a_process_run_in_place_reads_as_finished_and_closes(monkeypatch) -> None:
    """No cluster: after the stand-in start(), join, exitcode, is_alive and close work."""
    import multiprocessing

    from nbdist.worker import pasted_code

    monkeypatch.setattr(pasted_code, "STATE", pasted_code.PastedState(rank=0, world_size=1))
    ran: list[int] = []

    def work(i: int) -> None:
        ran.append(i)

    work.__module__ = "__main__"  # as a function defined in a cell
    process = multiprocessing.Process(target=work, args=(0,))
    pasted_code._process_start(multiprocessing.process.BaseProcess.start, process)
    process.join()
    assert ran == [0] and process.exitcode == 0 and not process.is_alive()
    process.close()  # deletes the sentinel start() sets: the stand-in sets one too


@pytest.mark.frameworks
@pytest.mark.skipif(find_spec("accelerate") is None,
                    reason="accelerate is not installed (the frameworks extra)")
def test_accelerate_notebook_launcher_runs_in_place(cluster: Cluster) -> None:
    cluster.run(TRAIN_BEFORE).raise_for_errors()
    result = cluster.run(textwrap.dedent("""
        import os

        from accelerate import Accelerator, notebook_launcher

        def training_function(scale):
            accelerator = Accelerator(cpu=True)
            total = accelerator.reduce(torch.ones(1) * scale * (accelerator.process_index + 1))
            seen.append((accelerator.process_index, accelerator.num_processes, total.item(),
                         os.environ.get("ACCELERATE_MIXED_PRECISION")))

        seen = []
        notebook_launcher(training_function, (2,), num_processes=2, mixed_precision="bf16")
        precision_after = os.environ.get("ACCELERATE_MIXED_PRECISION")
    """), timeout=120).raise_for_errors()
    assert result.stdout[0].startswith("nbdist: notebook_launcher(training_function) runs "
                                       "training_function(*args) in place on each of the 2 ranks")
    assert cluster.pull("seen") == {0: [(0, 2, 6.0, "bf16")], 1: [(1, 2, 6.0, "bf16")]}
    assert cluster.pull("precision_after") == {0: None, 1: None}
    wrong = cluster.run("notebook_launcher(training_function, (2,), num_processes=8)")
    assert "num_processes=8) asks for 8 processes" in wrong.errors[0].evalue
    _assert_usable_and_model_kept(cluster)


@pytest.mark.parametrize("command, launcher, instead", [
    ("!torchrun --nproc-per-node 2 train.py --epochs 3", "torchrun",
     "%dist_run train.py --epochs 3"),
    ("!OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone t.py", "torchrun",
     "%dist_run t.py"),
    ("!deepspeed --num_gpus 2 ds_train.py --deepspeed_config ds.json", "deepspeed",
     "%dist_run ds_train.py --deepspeed_config ds.json"),
    ("files = !cd /tmp && accelerate launch --num_processes 2 hf.py", "accelerate launch",
     "%dist_run hf.py"),
])
def test_a_shell_launcher_in_a_distributed_cell_points_to_dist_run(
        cluster: Cluster, command: str, launcher: str, instead: str) -> None:
    result = cluster.run(command)
    assert sorted(result.errors) == [0, 1]
    error = result.errors[0]
    assert error.ename == "LauncherInCellError"
    assert f"runs {launcher} on each of the 2 ranks" in error.evalue
    assert f"`{instead}`" in error.evalue
    assert not result.actions


def test_other_shell_commands_run_as_before(cluster: Cluster) -> None:
    result = cluster.run("!echo rank {rank}\nlisting = !accelerate --help 2>/dev/null | head -1")
    result.raise_for_errors()
    assert {r: out.splitlines() for r, out in result.stdout.items()} == {0: ["rank 0"],
                                                                         1: ["rank 1"]}


@pytest.mark.parametrize("command, expected", [
    ("torchrun --nproc-per-node=2 x.py", "torchrun"),
    ("/usr/bin/env torchrun x.py", "torchrun"),
    ("env NCCL_DEBUG=INFO torchrun x.py", "torchrun"),
    ("python3.11 -m torch.distributed.launch x.py", "torch.distributed.launch"),
    ("nohup deepspeed x.py > log &", "deepspeed"),
    ("mpirun -np 2 python x.py", "mpirun"),
    ("accelerate config default", None),
    ("ls | grep torchrun", None),
    ("pip install 'deepspeed", None),  # an unbalanced quote: split on spaces
    ("echo torchrun", None),
])
def test_launcher_in_reads_the_program_not_the_words(command: str, expected: str | None) -> None:
    assert launcher_in(command) == expected


NOTEBOOK_CELLS = [
    ("%load_ext nbdist", []),
    ("%dist_start -n 2 --threads 1", []),
    ("%%distributed\n" + DDP_TUTORIAL, []),
    ("%%distributed\n!torchrun --nproc-per-node 2 train.py", ["raises-exception"]),
    ("%%distributed\nimport sys\nprint('rank prompt', hasattr(sys, 'ps1'))", []),
    ("import sys\nprint('notebook prompt', hasattr(sys, 'ps1'))", []),
    ("%dist_stop", []),
]


def test_in_a_real_kernel_the_tutorial_runs_and_torchrun_is_explained(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    for source, tags in NOTEBOOK_CELLS:
        nb.cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": tags}))
    NotebookClient(nb, kernel_name="python3", timeout=240,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.outputs)
    assert "runs demo_basic(rank, ...) in place on each of the 2 ranks" in text
    assert "Finished running basic DDP example on rank 1." in text
    errors = [o for o in nb.cells[3].outputs if o.output_type == "error"]
    assert errors and "%dist_run train.py" in errors[0].evalue
    assert "rank prompt False" in text  # the ranks look like torchrun workers...
    assert "notebook prompt True" in text  # ...and the notebook keeps IPython's behaviour
