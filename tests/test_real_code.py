"""Real distributed code in cells (docs/FAULTS.md rows 17-18): a typo between two training cells
never costs the trained model, a pasted init/destroy_process_group or a second rpc.init_rpc just
works, and a torchrun script runs unchanged through %dist_run. Real engines, real process groups;
the notebook variant drives a real kernel through nbclient."""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from nbdist import Cluster
from nbdist.text import strip_ansi
from nbdist.worker.net import free_port

DDP_SETUP = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + rank)
data, target = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
losses = []
"""

FSDP_SETUP = """
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(100 + rank)
data, target = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
losses = []
"""

TRAIN = """
for _ in range(3):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(data), target)
    loss.backward()
    opt.step()
    losses.append(loss.item())
"""

TYPOS = ["undefined_name + 1", "settings = {}\nsettings['lr']", "[1, 2][5]"]


@pytest.fixture(scope="module")
def cluster(cluster2: Cluster) -> Cluster:
    return cluster2


@pytest.mark.parametrize(
    "setup", [DDP_SETUP, pytest.param(FSDP_SETUP, marks=pytest.mark.fsdp2)], ids=["ddp", "fsdp2"])
def test_a_typo_between_two_training_cells_keeps_the_model(cluster: Cluster, setup: str) -> None:
    cluster.run(setup).raise_for_errors()
    cluster.run(TRAIN).raise_for_errors()
    generation = cluster.generation
    for typo in TYPOS:
        result = cluster.run(typo)
        assert sorted(result.errors) == [0, 1], result.errors
        assert all(err.kind == "root" for err in result.errors.values())
        assert not result.actions, f"the group was touched after an ordinary error: {result.actions}"
    assert cluster.generation == generation
    cluster.run(TRAIN).raise_for_errors()
    with_typos = cluster.pull("losses")

    cluster.run(setup).raise_for_errors()  # the same run without the typos, for reference
    cluster.run(TRAIN).raise_for_errors()
    cluster.run(TRAIN).raise_for_errors()
    assert cluster.pull("losses") == with_typos


def test_a_rank_raising_while_others_wait_still_releases_them(cluster: Cluster) -> None:
    """The other side of row 17: one rank's error while a peer is blocked in a collective tears
    the group down (the only way to release the peer) and rebuilds it."""
    generation = cluster.generation
    result = cluster.run("if rank == 1:\n    raise ValueError('only rank 1')\ndist.barrier()", timeout=30)
    assert result.errors[1].kind == "root" and result.errors[0].kind == "collective"
    assert any(a.startswith("tore down the process group on rank(s) 1") for a in result.actions)
    assert cluster.generation == generation + 1
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2").raise_for_errors()


def test_a_syntax_error_is_raised_before_anything_is_sent(cluster: Cluster) -> None:
    count = "get_ipython().execution_count"
    before = cluster.run(count).raise_for_errors().grouped_values()
    with pytest.raises(SyntaxError, match="never closed"):
        cluster.run("x = (1,\nprint(x)")
    after = cluster.run(count).raise_for_errors().grouped_values()
    assert [int(v) for _, v in after] == [int(v) + 1 for _, v in before]  # nothing ran between


def test_a_traceback_shows_the_cell_and_the_library_it_called_not_nbdist(cluster: Cluster) -> None:
    """nbdist wraps torch.distributed's collectives and runs a pasted mp.spawn in place: none of
    its frames is shown, but where nbdist itself raised; the rank keeps every frame to debug."""
    result = cluster.run("import torch.distributed as dist\ndist.all_reduce([1, 2])", timeout=60)
    plain = strip_ansi(result.errors[0].traceback)
    assert "----> 2 dist.all_reduce([1, 2])" in plain and "distributed_c10d.py" in plain, plain
    assert "/nbdist/" not in plain and "interactiveshell" not in plain, plain
    message = result.failure_message()
    assert "── ranks 0-1 raised TypeError: Invalid function argument" in message, message
    assert message.count("Traceback (most recent call last)") == 1, message
    cluster.run(FRAME_FILES).raise_for_errors()  # a cell that ends well keeps sys.last_traceback
    frames = cluster.pull("_frame_files")
    assert any("/nbdist/worker/collectives.py" in f for f in frames[0]), frames[0]
    spawned = cluster.run("import torch.multiprocessing as mp\ndef f(i):\n    pass\n"
                          "mp.spawn(f, nprocs=5)", timeout=60)
    plain = strip_ansi(spawned.errors[1].traceback)
    assert "----> 4 mp.spawn(f, nprocs=5)" in plain and "LauncherInCellError" in plain, plain
    assert plain.count("/nbdist/") == 1 and "pasted_code.py" in plain, plain  # where it raised
    parsed = cluster.run("def parse(text):\n    return compile(text, 'cfg', 'exec')\n"
                         "parse('for x')", timeout=60)  # a SyntaxError the cell's code raised
    plain = strip_ansi(parsed.errors[0].traceback)
    assert "Cell In[" in plain and "in parse" in plain and "File cfg:1" in plain, plain
    assert "interactiveshell" not in plain and "/nbdist/" not in plain, plain


FRAME_FILES = """
import sys as _sys
_tb, _frame_files = _sys.last_traceback, []
while _tb is not None:
    _frame_files.append(_tb.tb_frame.f_code.co_filename)
    _tb = _tb.tb_next
"""
"""On a rank: the files of the last error's traceback, as post-mortem debugging walks it."""


def test_pasted_init_and_destroy_process_group(cluster: Cluster) -> None:
    cluster.run("kept = torch.arange(3)").raise_for_errors()
    result = cluster.run("import torch.distributed as dist\ndist.init_process_group(backend='gloo')")
    result.raise_for_errors()
    assert "init_process_group() skipped" in result.stdout[0]
    assert not result.actions

    result = cluster.run("dist.init_process_group('nccl', world_size=3)")
    assert sorted(result.errors) == [0, 1]
    message = result.errors[0].evalue
    assert "backend 'nccl' (the group is 'gloo')" in message and "world_size=3" in message

    generation = cluster.generation
    result = cluster.run("dist.destroy_process_group()").raise_for_errors()
    assert any("destroyed the process group" in a and "re-formed" in a for a in result.actions)
    assert cluster.generation == generation + 1
    result = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), kept.tolist())")
    assert result.raise_for_errors().grouped_values() == [([0, 1], "(2.0, [0, 1, 2])")]


def test_rpc_init_twice_then_shutdown_and_again(cluster: Cluster) -> None:
    init = ("from torch.distributed import rpc\n"
            "rpc.init_rpc(f'worker{rank}', rank=rank, world_size=world_size)\n"
            "rpc.rpc_sync(f'worker{(rank + 1) % world_size}', torch.add, args=(torch.ones(1), rank)).item()")
    first = cluster.run(init, timeout=60).raise_for_errors()
    assert {tuple(ranks): value for ranks, value in first.grouped_values()} == {(0,): "1.0", (1,): "2.0"}
    second = cluster.run(init, timeout=60).raise_for_errors()
    assert "rpc.init_rpc('worker0') skipped" in second.stdout[0]
    other_name = cluster.run("rpc.init_rpc(f'other{rank}', rank=rank, world_size=world_size)")
    assert "RPC already runs on this rank as 'worker" in other_name.errors[0].evalue
    cluster.run("rpc.shutdown()", timeout=60).raise_for_errors()
    # a fresh port for the new RPC rendezvous, as a script run twice under torchrun would get
    # (a free one: MASTER_PORT + 1 was sometimes taken, EADDRINUSE)
    cluster.run(f"import os\nos.environ['MASTER_PORT'] = '{free_port()}'")
    cluster.run(init + "\nrpc.shutdown()", timeout=60).raise_for_errors()


SCRIPT = '''
import argparse, os, sys
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--scale", type=float, default=1.0)
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()
dist.init_process_group(backend="gloo")
env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
total = torch.ones(1) * args.scale * (dist.get_rank() + 1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} total {total.item()} argv {sys.argv[1:]}")
dist.destroy_process_group()
if __name__ == "__main__":
    sys.exit(args.exit_code)
'''


def test_dist_run_runs_a_torchrun_script_unchanged(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = cluster.run_script(str(script), ["--scale", "2"], timeout=60).raise_for_errors()
    assert result.stdout[0].splitlines() == [
        "nbdist: init_process_group() skipped: the cluster's process group is already up "
        "(gloo, world size 2, rank 0)",
        "rank 0 total 6.0 argv ['--scale', '2']",
    ]
    assert any("re-formed" in a for a in result.actions)  # the script destroyed the group
    env = cluster.pull("env")
    assert env[1]["RANK"] == "1" and env[1]["WORLD_SIZE"] == "2" and env[1]["LOCAL_RANK"] == "1"
    assert env[0]["TORCHELASTIC_RUN_ID"] == "nbdist"
    assert [value.item() for value in cluster.pull("total").values()] == [6.0, 6.0]  # globals stay
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2").raise_for_errors()

    failed = cluster.run_script(str(script), ["--exit-code", "3"], timeout=60)
    assert sorted(failed.errors) == [0, 1]
    assert failed.errors[0].ename == "ScriptExit" and "exited with code 3" in failed.errors[0].evalue
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2").raise_for_errors()


NOTEBOOK_CELLS = [
    ("%load_ext nbdist", []),
    ("%dist_start -n 2 --threads 1", []),
    ("%%distributed\n" + DDP_SETUP, []),
    ("%%distributed\n" + TRAIN, []),
    ("%%distributed\nundefined_name + 1", ["raises-exception"]),
    ("%%distributed\nx = (1,\nprint(x)", ["raises-exception"]),
    ("%%distributed\n" + TRAIN, []),
    ("with_typos = %dist_pull losses", []),
    ("%%distributed\n" + DDP_SETUP + TRAIN + TRAIN, []),
    ("reference = %dist_pull losses\nassert with_typos == reference, (with_typos, reference)\nprint('same losses')", []),
    ("%dist_stop", []),
]


def test_in_a_real_kernel_a_typo_and_a_syntax_error_keep_the_model(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    for source, tags in NOTEBOOK_CELLS:
        nb.cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": tags}))
    NotebookClient(nb, kernel_name="python3", timeout=240,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = {i: o for i, cell in enumerate(nb.cells) for o in cell.outputs if o.output_type == "error"}
    assert errors[4].ename == "DistributedCellError" and "NameError" in errors[4].evalue
    assert errors[5].ename == "SyntaxError"
    typo = strip_ansi("\n".join(errors[4].traceback))
    assert "── ranks 0-1 raised NameError: name 'undefined_name' is not defined ──" in typo, typo
    assert typo.count("Traceback (most recent call last)") == 1, typo  # one for both ranks
    caret = strip_ansi("\n".join(errors[5].traceback))  # as a local SyntaxError: no frames
    assert "x = (1," in caret and "^" in caret and "never closed" in caret, caret
    assert "nbdist" not in caret and "Traceback" not in caret, caret
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.outputs)
    assert "tore down" not in text and "rebuilt" not in text
    assert "same losses" in text


NON_INTERACTIVE_CHECKS = """
import __main__, argparse, sys
import torch.distributed as dist
seen = {
    "ps1": hasattr(sys, "ps1") or hasattr(sys, "ps2"),
    "interactive": sys.flags.interactive,
    "torchelastic": dist.is_torchelastic_launched(),
    "main_file": getattr(__main__, "__file__", None),
    "argv": sys.argv[1:],
    "parsed": vars(argparse.ArgumentParser().parse_args()),  # what a script without options sees
    "group_rank": os.environ["GROUP_RANK"],
}
"""


def test_a_rank_looks_like_a_torchrun_worker_to_libraries(cluster: Cluster, tmp_path: Path) -> None:
    """What Lightning and others check for an interactive session, in a cell and in %dist_run."""
    cluster.run("import os\n" + NON_INTERACTIVE_CHECKS).raise_for_errors()
    cell = cluster.pull("seen")[1]
    assert cell == {"ps1": False, "interactive": 0, "torchelastic": True, "main_file": None,
                    "argv": [], "parsed": {}, "group_rank": "0"}
    script = tmp_path / "checks.py"
    script.write_text("import os\n" + NON_INTERACTIVE_CHECKS)
    cluster.run_script(str(script), timeout=60).raise_for_errors()
    in_script = cluster.pull("seen")[0]
    assert in_script == {**cell, "main_file": str(script)}
    cluster.run("import __main__\nafter = getattr(__main__, '__file__', None)").raise_for_errors()
    assert cluster.pull("after") == {0: None, 1: None}  # the script's __file__ left with it
