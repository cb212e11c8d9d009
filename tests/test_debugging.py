"""Debug a distributed cell like a local one: `%dist_diff` (compare a value across ranks) and
`%dist_debug` (post-mortem pdb on a rank), against real engines."""

from __future__ import annotations

import builtins

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from nbdist.cells.post_mortem import pick_rank
from nbdist.cells.result import CellResult
from nbdist.errors import NbdistError
from nbdist.notebook import magics

MODEL = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.BatchNorm1d(2))
"""


@pytest.fixture(scope="module")
def ip():
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


def test_seeded_model_is_equal_everywhere(cluster2):
    cluster2.run(MODEL).raise_for_errors()
    report = cluster2.diff("model")
    assert report.equal and report.entries == 9  # 6 parameters, 3 BatchNorm buffers
    assert "all ranks equal (9 entries compared" in str(report)


def test_one_perturbed_rank_is_named_with_its_entry_and_difference(cluster2):
    cluster2.run(MODEL + "if rank == 1:\n    with torch.no_grad():\n"
                 "        model[2].weight[1, 3] += 0.25\n").raise_for_errors()
    report = cluster2.diff("model")
    assert [d.name for d in report.diffs] == ["2.weight"]
    first = report.first
    assert first.differing == [1] and first.reference == [0]
    assert first.max_abs == pytest.approx(0.25, abs=1e-6)
    text = str(report)
    assert "first difference: 2.weight: rank 1 differs from rank 0" in text
    assert "max |difference| 0.25" in text
    # the state dict names the same entry
    assert cluster2.diff("model.state_dict()").first.name == "2.weight"


def test_forgot_to_seed_differs_and_ddp_makes_replicas_equal(cluster2):
    # torch.seed(): a random seed per process, as when each rank seeds from the clock
    cluster2.run("from torch import nn\ntorch.seed()\nraw = nn.Linear(4, 3)\n"
                 "ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 3))").raise_for_errors()
    unseeded = cluster2.diff("raw")
    assert {d.name for d in unseeded.diffs} == {"weight", "bias"}
    assert all(d.max_abs and d.max_abs > 0 for d in unseeded.diffs)
    ddp = cluster2.diff("ddp")  # DDP broadcasts rank 0's parameters when it wraps the model
    assert ddp.equal and ddp.entries == 2


def test_plain_values_and_containers(cluster2):
    assert cluster2.diff("{'lr': 0.1, 'steps': [1, 2], 'name': 'x'}").equal
    cluster2.run("import torch").raise_for_errors()
    report = cluster2.diff("{'lr': 0.1, 'seen': [rank, 2.0], 't': (torch.ones(2) * rank,)}")
    assert [d.name for d in report.diffs] == ["seen.0", "t.0"]
    assert report.diffs[0].detail == "0 vs 1"
    assert report.diffs[1].max_abs == pytest.approx(1.0)
    assert cluster2.diff("rank").first.name == ""  # a bare value is the one entry
    assert "(the value)" in str(cluster2.diff("rank"))
    with pytest.raises(NbdistError, match="NameError"):
        cluster2.diff("not_defined_anywhere")


def test_optimizer_state(cluster2):
    cluster2.run(
        "import torch\ntorch.manual_seed(0)\nnet = torch.nn.Linear(3, 2)\n"
        "opt = torch.optim.Adam(net.parameters(), lr=0.1)\n"
        "net(torch.ones(1, 3) * (rank + 1)).sum().backward()\nopt.step()").raise_for_errors()
    report = cluster2.diff("opt")
    names = [d.name for d in report.diffs]
    assert "state.0.exp_avg" in names and "param_groups.0.lr" not in names
    assert "optimizer: its state_dict" in str(report)
    cluster2.run("opt.zero_grad()\nnet(torch.ones(1, 3)).sum().backward()\n"
                 "opt2 = torch.optim.Adam(net.parameters(), lr=0.1)\nopt2.step()").raise_for_errors()
    assert cluster2.diff("opt2.state_dict()").equal


def test_dtensors_compare_what_should_be_equal(cluster2):
    cluster2.run(
        "import torch\nfrom torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Replicate, Shard, distribute_tensor\n"
        "mesh = init_device_mesh('cpu', (2,))\nfull = torch.arange(8.0).reshape(4, 2)\n"
        "params = {'rep': distribute_tensor(full, mesh, [Replicate()]),\n"
        "          'shard': distribute_tensor(full, mesh, [Shard(0)])}").raise_for_errors()
    report = cluster2.diff("params")
    assert report.equal and report.entries == 2
    assert "replicated DTensor: local tensors compared" in str(report)
    assert "sharded DTensor: only the local shards' shapes compared" in str(report)
    full = cluster2.diff("params", full=True)
    assert full.equal and "full tensors gathered and compared" in str(full)
    cluster2.run("if rank == 1:\n    params['rep'].to_local().add_(1.0)").raise_for_errors()
    drifted = cluster2.diff("params")
    assert [(d.name, d.differing, d.max_abs) for d in drifted.diffs] == [("rep", [1], 1.0)]


def test_a_walk_that_raises_keeps_the_last_flattened_object() -> None:
    """The rank keeps the last fingerprinted object's entries for `fetch`: whole, never a part
    of one whose walk failed (this is the rank-side code, run here without a cluster)."""
    import torch

    from nbdist.worker import diffing

    class Broken(torch.nn.Module):
        def named_parameters(self, *args, **kwargs):
            yield "weight", torch.ones(2)
            raise RuntimeError("cannot list parameters")

    diffing.fingerprint({"a": torch.zeros(3), "b": 1})
    with pytest.raises(RuntimeError, match="cannot list"):
        diffing.fingerprint({"z": torch.ones(1), "m": Broken()})
    assert sorted(diffing.fetch(["a", "b", "z", "m.weight"])) == ["a", "b"]


def test_nbdist_diff_inside_a_cell(cluster2):
    cluster2.run(MODEL + "if rank == 1:\n    with torch.no_grad():\n"
                 "        model[0].bias[0] -= 2.0\n").raise_for_errors()
    result = cluster2.run("import nbdist\nreport = nbdist.diff(model)\n"
                          "(report.first.name, report.first.differing, round(report.first.max_abs, 4))")
    result.raise_for_errors()
    assert result.grouped_values() == [([0, 1], "('0.bias', [1], 2.0)")]


def test_dist_diff_magic(cluster2, ip, capsys, monkeypatch):
    monkeypatch.setattr(magics, "_CURRENT", cluster2)
    cluster2.run(MODEL).raise_for_errors()
    ip.run_line_magic("dist_diff", "model")
    assert "all ranks equal (9 entries compared" in capsys.readouterr().out
    ip.run_line_magic("dist_diff", "--ranks 1 {'r': rank}")
    assert "all ranks equal (1 entry compared, ranks 1)" in capsys.readouterr().out
    ip.run_line_magic("dist_diff", "[rank, 1]")
    assert "first difference: 0: rank 1 differs from rank 0 (0 vs 1)" in capsys.readouterr().out
    with pytest.raises(UsageError, match="NameError"):
        ip.run_line_magic("dist_diff", "nothing_here")


def test_nothing_to_debug_says_so(cluster2):
    with pytest.raises(NbdistError, match="no failed %%distributed cell"):
        pick_rank(CellResult(code="", ranks=[0, 1]))
    shown: list[str] = []
    # rank 0 has raised nothing in this module (tests run in file order)
    assert cluster2.debug(0, ask=lambda prompt: "q", show=shown.append) == 0
    assert "no traceback to debug" in shown[0]


FAILING = """
def scale(x, factor):
    some_local = x * factor
    raise ValueError(f"bad factor {factor}")

if rank == 1:
    x = torch.arange(6.0).reshape(2, 3)
    scale(x, 3)
"""


def _scripted(commands: list[str], prompts: list[str]):
    answers = iter(commands)

    def ask(prompt: str) -> str:
        prompts.append(prompt)
        return next(answers)
    return ask


def test_dist_debug_walks_the_failed_ranks_frames(cluster2):
    result = cluster2.run(FAILING)
    assert list(result.errors) == [1]
    prompts: list[str] = []
    shown: list[str] = []
    ran = cluster2.debug(ask=_scripted(["w", "p some_local", "up", "p x.shape", "pp factor",
                                        "down", "p factor", "l", "q"], prompts), show=shown.append)
    assert ran == 8 and set(prompts) == {"(rank 1 pdb) "}
    opening, where, local, up, shape, pp_undefined, down, factor, listing = shown
    assert "post-mortem on rank 1 (ValueError: bad factor 3)" in opening
    assert "scale()" in opening and "raise ValueError" in opening
    assert "<module>()" in where and "> " in where.splitlines()[-2]  # innermost frame current
    assert "interactiveshell" not in where  # IPython's own frames are not shown
    assert local == "tensor([[ 0.,  3.,  6.],\n        [ 9., 12., 15.]])"
    assert "<module>()" in up and "scale(x, 3)" in up
    assert shape == "torch.Size([2, 3])"
    assert "NameError" in pp_undefined  # factor is scale()'s local, not the module's
    assert "scale()" in down and factor == "3"
    assert "some_local = x * factor" in listing
    # the rank, its namespace and the process group are healthy after quitting
    after = cluster2.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n(t.item(), x.shape "
                         "if rank == 1 else None)")
    after.raise_for_errors()
    assert [text for _, text in after.grouped_values()] == ["(3.0, None)",
                                                            "(3.0, torch.Size([2, 3]))"]


def test_dist_debug_after_a_peer_was_released_from_a_collective(cluster2):
    """Rank 1 raises while rank 0 waits in all_reduce: nbdist tears rank 1's group down to free
    rank 0 (which clears sys.last_exc there), yet rank 1's own error is still there to debug."""
    result = cluster2.run(FAILING + "dist.all_reduce(torch.ones(1))\n", timeout=30)
    assert result.errors[1].kind == "root" and result.errors[0].kind == "collective"
    assert any(a.startswith("tore down the process group on rank(s) 1") for a in result.actions)
    shown: list[str] = []
    cluster2.debug(ask=_scripted(["p some_local.sum()", "q"], []), show=shown.append)
    assert "post-mortem on rank 1 (ValueError: bad factor 3)" in shown[0]
    assert shown[1] == "tensor(45.)"
    assert cluster2.run("dist.barrier()").ok


def test_dist_debug_magic_reads_input(cluster2, ip, capsys, monkeypatch):
    monkeypatch.setattr(magics, "_CURRENT", cluster2)
    cluster2.run(FAILING)
    answers = iter(["p some_local.sum()", "c"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(answers))
    ip.run_line_magic("dist_debug", "")
    out = capsys.readouterr().out
    assert "post-mortem on rank 1" in out and "tensor(45.)" in out
    with pytest.raises(UsageError, match=r"\[7\] do not exist"):
        ip.run_line_magic("dist_debug", "7")
    assert cluster2.run("dist.barrier()").ok


def test_dist_debug_in_a_real_kernel(real_kernel):
    """%dist_debug in ipykernel: input() goes out as an input_request on the stdin channel."""
    real_kernel.answer_with(["p some_local[1]", "up", "p x[0]", "q"])
    run = real_kernel.run
    assert run("%load_ext nbdist\n%dist_start -n 2")["status"] == "ok"
    assert run("%%distributed\nimport torch\n" + FAILING)["status"] == "error"
    assert run("%dist_debug")["status"] == "ok"
    assert run("%%distributed\ndist.barrier()\nprint('barrier ok', rank)")["status"] == "ok"
    assert run("%%distributed\ntorch.manual_seed(0)\nlayer = torch.nn.Linear(3, 2)\n"
               "if rank == 1:\n    layer.bias.data += 0.5")["status"] == "ok"
    assert run("%dist_diff layer")["status"] == "ok"
    text = real_kernel.text()
    assert real_kernel.prompts == ["(rank 1 pdb) "] * 4
    assert "tensor([ 9., 12., 15.])" in text and "tensor([0., 1., 2.])" in text
    assert "barrier ok 0" in text and "barrier ok 1" in text
    assert "first difference: bias: rank 1 differs from rank 0" in text, text
    assert "max |difference| 0.5" in text, text


def test_dist_debug_runs_given_commands_without_asking(cluster2, ip, capsys, monkeypatch):
    """`%dist_debug -c CMD ...`: a headless run or a tutorial, no one at the keyboard."""
    monkeypatch.setattr(magics, "_CURRENT", cluster2)
    cluster2.run("d = {'lr': 0.1}\nif rank == 1:\n    d['momentum']")  # a KeyError on rank 1
    monkeypatch.setattr(builtins, "input", lambda prompt="": pytest.fail("asked for input"))
    ip.run_line_magic("dist_debug", "1 -c 'p d' -c 'p rank'")
    out = capsys.readouterr().out
    assert "post-mortem on rank 1 (KeyError: 'momentum')" in out
    assert "(rank 1 pdb) p d\n{'lr': 0.1}" in out and "(rank 1 pdb) q" in out
    assert cluster2.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").raise_for_errors().ok
