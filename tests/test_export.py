"""`%dist_export`: notebook cells become a script that torchrun runs with 2 gloo ranks and trains."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from nbdist import export
from nbdist.cluster import free_port
from nbdist.errors import NbdistError
from nbdist.notebook import magics

TRAIN_CELLS = [
    "%load_ext nbdist",
    "%dist_start -n 2",
    "%%distributed --setup\nimport nbdist\ntorch.manual_seed(0)\n"
    "model = torch.nn.Linear(8, 1).to(device)\n"
    "model = torch.nn.parallel.DistributedDataParallel(model)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
    "%%distributed\n"
    "g = torch.Generator().manual_seed(rank)\n"
    "x = torch.randn(64, 8, generator=g)\n"
    "y = x.sum(dim=1, keepdim=True)\n"
    "losses = []\n"
    "for step in range(30):\n"
    "    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
    "    nbdist.log(step=step, loss=loss)\n"
    "    losses.append(loss.item())\n"
    "%time x.shape\n"
    "print(f'first loss {losses[0]:.4f} last loss {losses[-1]:.4f}')\n",
    "%%distributed --ranks 0\nprint('only rank 0 saves', rank)\n",
    "%%distributed\nw = model.module.weight.detach().clone()\ndist.broadcast(w, 0)\n"
    "torch.equal(w, model.module.weight)\n",
    "print('a notebook-only cell')",
    "%dist_stop",
]


def get_ipython():
    """The test shell (globalipapp's own get_ipython works on the first call only)."""
    globalipapp.start_ipython()
    return globalipapp.get_ipython()


def _history(cells: list[str]) -> list[tuple[str, str]]:
    return export.cells_from_history(["", *cells])


def test_picks_distributed_cells_only_and_parses_options() -> None:
    cells = export.distributed_cells(_history(TRAIN_CELLS), world_size=2)
    assert [c.label for c in cells] == ["In[3]", "In[4]", "In[5]", "In[6]"]
    assert cells[0].options == ["--setup"]
    assert cells[2].ranks == [0]
    assert cells[1].ranks is None and not cells[1].source.startswith("%%")


def test_autodist_cells_count_as_distributed() -> None:
    sources = _history(["x = 1", "%autodist on", "y = rank", "%dist_status", "%autodist off", "z = 2"])
    cells = export.distributed_cells(sources)
    assert [c.source for c in cells] == ["y = rank"]


def test_script_compiles_comments_magics_and_shows_last_expression() -> None:
    script = export.export_script(export.distributed_cells(_history(TRAIN_CELLS), 2))
    compile(script, "train.py", "exec")
    assert "pass  # nbdist export: IPython-only line skipped: %time x.shape" in script
    assert "_show(torch.equal(w, model.module.weight))" in script
    assert "if rank in (0,):\n    print('only rank 0 saves', rank)" in script
    assert "init_process_group" in script


def test_nothing_to_export_is_a_clear_error() -> None:
    with pytest.raises(NbdistError, match="no %%distributed cells"):
        export.export_script(export.distributed_cells(_history(["x = 1"])))


def test_notebook_source_skips_cells_tagged_to_fail(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in TRAIN_CELLS[:4]]
    failing = nbformat.v4.new_code_cell("%%distributed\nraise RuntimeError('on purpose')")
    failing.metadata["tags"] = ["raises-exception"]
    nb.cells.append(failing)
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    cells = export.distributed_cells(export.cells_from_notebook(path), 2)
    assert len(cells) == 2 and all("on purpose" not in c.source for c in cells)


def test_magic_writes_the_script_from_history(tmp_path: Path) -> None:
    ip = get_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.history_manager.input_hist_raw[:] = ["", *TRAIN_CELLS[2:4], "%dist_export x"]
    target = tmp_path / "train.py"
    ip.run_line_magic("dist_export", str(target))
    assert "mse_loss" in target.read_text() and os.access(target, os.X_OK)
    with pytest.raises(UsageError, match="%dist_export"):
        ip.run_line_magic("dist_export", "")


def test_export_session_writes_from_history_and_reports_without_ipython(tmp_path: Path) -> None:
    log = export.SessionLog(failures={"In[3]": "rank 1 raised ValueError: no"})
    history = ["", *TRAIN_CELLS[2:4], "%%distributed\nraise ValueError('no')"]
    report = export.export_session(tmp_path / "t.py", history, log, world_size=2, threads=3)
    assert report.nproc == 2 and report.path.read_text().startswith("#!/usr/bin/env python\n")
    assert "THREADS = 3\n" in report.path.read_text()
    assert report.summary() == [
        f"wrote 2 cell run(s) to {report.path}; run it with torchrun --nproc-per-node 2 {report.path}",
        "left out 1 cell(s) that failed in the notebook (In[3]); they are in the script as comments",
    ]


def test_script_head_fills_the_template_once() -> None:
    head = export.script_head(title="T {nproc}", nproc=4, filename="f.py", threads=None)
    compile(head, "f.py", "exec")
    assert head.startswith('#!/usr/bin/env python\n"""T {nproc}\n')  # a title is kept as written
    assert "torchrun --nproc-per-node 4 f.py" in head and "THREADS = None\n" in head
    assert head.endswith("rank, world_size, local_rank, device = _setup_rank()\n")


def test_pushed_values_are_assignments_or_placeholders_that_say_what_to_do() -> None:
    import torch

    log = export.SessionLog()
    log.record_push({"lr": 0.1, "cfg": {"sizes": [8, 16], "eps": float("inf"), "tags": ("a",), "none": None},
                     "weights": torch.zeros(3, 4), "dtype": torch.bfloat16})
    log.cell_finished(_FakeResult(1))
    steps = export.script_steps(_history(["x = 1\n%dist_push ...", *TRAIN_CELLS[2:4]]), 2, log)
    assert isinstance(steps[0], export.Push) and steps[0].label == "In[1]"
    script = export.export_script(steps)
    compile(script, "train.py", "exec")
    assert "lr = 0.1\ncfg = {'sizes': [8, 16], 'eps': float(\"inf\"), 'tags': ('a',), 'none': None}\n" in script
    assert "dtype = torch.bfloat16" in script
    assert ("raise NotImplementedError('weights was pushed from the notebook (a Tensor of shape (3, 4), "
            "torch.float32); define it here')") in script
    assert script.index("raise NotImplementedError") < script.index("torch.manual_seed(0)")
    assert [v.name for v in export.placeholders(steps)] == ["weights"]
    namespace: dict[str, object] = {"torch": torch}
    exec(script[script.index("# --- In[1]"):script.index("# `weights`")], namespace)
    assert namespace["cfg"] == {"sizes": [8, 16], "eps": float("inf"), "tags": ("a",), "none": None}
    huge = export.PushedValue.of("big", list(range(100_000)))
    assert huge.source is None and "too large" in huge.description


def test_repeated_cells_loop_and_failed_cells_stay_as_comments() -> None:
    train = "%%distributed --ranks 0\nstep += 1\nstep"
    log = export.SessionLog(failures={"In[4]": "rank 1 raised ValueError: no"})
    sources = _history(["%%distributed\nstep = 0", train, train, train, train, train, "%%distributed\nstep"])
    script = export.export_script(export.script_steps(sources, 2, log))
    compile(script, "train.py", "exec")
    assert ("# --- In[2], In[3]: %%distributed (ranks 0 only) ---\n"
            "for _nbdist_run in range(2):  # the notebook ran this cell 2 times in a row\n"
            "    if rank in (0,):\n        step += 1\n        _show(step)\n") in script
    assert ("# left out: this cell failed in the notebook (rank 1 raised ValueError: no);\n"
            "# whatever it did on the ranks before it failed is not reproduced here.\n"
            "# if rank in (0,):\n#     step += 1\n") in script
    assert "# --- In[5], In[6]: %%distributed" in script  # the runs after the failure, together
    namespace: dict[str, object] = {"rank": 0, "_show": lambda value: None,
                                    "_cell_boundary": lambda: None}
    exec(script[script.index("# --- In[1]"):script.rindex("if dist.is_initialized()")], namespace)
    assert namespace["step"] == 4  # 5 runs in the notebook, one of them failed


def test_a_cell_whose_magic_line_failed_is_a_comment_not_an_export_error() -> None:
    sources = _history(["%%distributed\nstep = 0", "%%distributed --ranks 5\nstep = 1"])
    with pytest.raises(NbdistError, match="do not exist"):
        export.script_steps(sources, 2)
    log = export.SessionLog(failures={"In[2]": "UsageError: rank(s) [5] do not exist (ranks 0-1)"})
    script = export.export_script(export.script_steps(sources, 2, log))
    assert "# --- In[2]: %%distributed --ranks 5 ---\n# left out" in script and "\n# step = 1\n" in script


def test_notebook_source_knows_failures_from_saved_errors_and_literal_pushes(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in
                ["%dist_push lr=0.1 data", *TRAIN_CELLS[2:4], "%%distributed\nboom()"]]
    nb.cells[-1].outputs = [nbformat.v4.new_output("error", ename="NameError", evalue="name 'boom' is not defined")]
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    steps = export.script_steps(export.cells_from_notebook(path), 2, export.notebook_log(path))
    script = export.export_script(steps)
    assert "lr = 0.1\n" in script
    assert "raise NotImplementedError('data was pushed from the notebook" in script
    assert "failed in the notebook (its saved output is an error: NameError: name 'boom' is not defined)" in script
    assert "\n# _show(boom())" in script


class _FakeResult:
    """What IPython's post_run_cell event hands over."""

    def __init__(self, count: int, error: BaseException | None = None, store_history: bool = True) -> None:
        self.execution_count = count
        self.info = type("Info", (), {"store_history": store_history})()
        self.error_before_exec = None
        self.error_in_exec = error


def test_magics_log_pushes_and_failures_and_warn_about_placeholders(tmp_path: Path, monkeypatch, capsys, cluster2) -> None:
    import torch

    ip = get_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.reset(new_session=True)
    magics.session_log().clear()
    monkeypatch.setattr(magics, "_CURRENT", cluster2)  # a real 2-rank cluster
    ip.user_ns["weights"] = torch.ones(2)
    for source in ["lr = 0.5\n%dist_push lr weights", "%dist_push not_defined",
                   "%%distributed\n1/0", "%%distributed\nprint(rank, lr)"]:
        ip.run_cell(source, store_history=True)
    ip.run_line_magic("dist_push", "silent=1")  # not a history cell: filed under the next one
    ip.run_cell("x = 1", store_history=True)
    log = magics.session_log()
    assert [v.name for v in log.pushes["In[1]"]] == ["lr", "weights"] and "In[2]" not in log.pushes
    assert "ZeroDivisionError" in log.failures["In[3]"], log.failures
    capsys.readouterr()
    target = tmp_path / "train.py"
    ip.run_cell(f"%dist_export {target}", store_history=True)
    said = capsys.readouterr().out
    assert "wrote 1 cell run(s)" in said, said
    assert "nbdist: warning: 1 pushed value(s) cannot be written into the script: weights " \
           "(a Tensor of shape (2,), torch.float32)" in said, said
    assert "left out 1 cell(s) that failed in the notebook (In[3])" in said, said
    script = target.read_text()
    assert f"THREADS = {cluster2.requested_threads}\n" in script and "lr = 0.5\n" in script
    assert "silent = 1" in script.split("# --- In[5]")[1]  # filed under the next history cell
    ip.reset(new_session=True)
    magics.session_log().clear()


def torchrun(script: Path, cwd: Path, timeout: float = 180) -> tuple[int, str]:
    """`torchrun --nproc-per-node 2 FILE` on a free port; the whole process group is killed on
    timeout (killing torchrun alone would orphan its workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(script)],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout:.0f} s:\n{out[-3000:]}")
    return proc.returncode, out


def test_exported_script_runs_without_nbdist_installed(tmp_path: Path) -> None:
    """The cells' own `import nbdist` and `nbdist.log` work in a process where nbdist cannot be
    imported (a world of one, plain python); any other nbdist name says what it needs."""
    cells = [*TRAIN_CELLS[:-2],
             "%%distributed\ntry:\n    nbdist.prepare\nexcept AttributeError as error:\n"
             "    print('without nbdist:', error)\n"]
    script = tmp_path / "train.py"
    script.write_text(export.export_script(export.distributed_cells(_history(cells), 1)))
    hide_nbdist = ("import runpy, sys; sys.modules['nbdist'] = None; "
                   f"runpy.run_path({str(script)!r}, run_name='__main__')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", hide_nbdist], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"first loss [\d.]+ last loss [\d.]+", done.stdout), done.stdout
    assert ("without nbdist: nbdist.prepare needs nbdist installed; without it only nbdist.log"
            in done.stdout), done.stdout


NOTEBOOK_SESSION = [
    "%dist_start -n 2",
    "lr = 0.05\n%dist_push lr steps_per_run=10 sizes=(8,16)",
    "%%distributed --setup\nimport nbdist\nfrom torch import nn\ntorch.manual_seed(0)\n"
    "model = nn.parallel.DistributedDataParallel(\n"
    "    nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.Tanh(), nn.Linear(sizes[1], 1)).to(device))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=lr)\n"
    "losses = []\n",
    "%%distributed\ng = torch.Generator().manual_seed(rank)\nx = torch.randn(64, sizes[0], generator=g)\n"
    "y = x[:, :4].sum(dim=1, keepdim=True).tanh()\n",
    *3 * [
        "%%distributed\n"
        "for step in range(steps_per_run):\n"
        "    loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    nbdist.log(step=len(losses), loss=loss)\n"
        "    losses.append(loss.item())\n"
        "%time x.shape\n"
        "print(f'rank {rank} after {len(losses)} steps: loss {losses[-1]:.6f}')\n"
    ],
    "%%distributed\nlosses.append(loss_typo)",  # fails on every rank before it changes anything
    "%%distributed --ranks 0\nprint('only rank 0 saves', rank)\n",
    "%%distributed\nw = model.module[0].weight.detach().clone()\ndist.broadcast(w, 0)\n"
    "torch.equal(w, model.module[0].weight)\n",
    "print('a notebook-only cell')",
]


def test_exported_notebook_session_trains_the_same_under_torchrun(tmp_path: Path, capsys,
                                                                  assert_all_gone) -> None:
    """A real session (pushes, a training cell run 3 times, a failing cell, a rank-0 cell) is
    exported by %dist_export; torchrun with 2 gloo ranks reaches the notebook's losses."""
    ip = get_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.reset(new_session=True)  # In[n] and the history start over, whatever ran before
    magics.session_log().clear()
    target = tmp_path / "train.py"
    try:
        for source in NOTEBOOK_SESSION:
            ip.run_cell(source, store_history=True)
        notebook_losses = ip.run_line_magic("dist_pull", "losses")
        capsys.readouterr()
        ip.run_cell(f"%dist_export {target}", store_history=True)
    finally:
        cluster = magics.current_cluster()
        if cluster is not None and cluster.running:
            pids = cluster.all_pids()
            ip.run_line_magic("dist_stop", "")
            assert_all_gone(pids)
    said = capsys.readouterr().out
    assert "wrote 7 cell run(s)" in said and "left out 1 cell(s) that failed in the notebook (In[8])" in said
    assert "warning" not in said  # every pushed value was plain data
    assert all(len(losses) == 30 for losses in notebook_losses.values()), notebook_losses

    script = target.read_text()
    assert "lr = 0.05\nsteps_per_run = 10\nsizes = (8, 16)\n" in script
    assert "for _nbdist_run in range(3):  # the notebook ran this cell 3 times in a row" in script
    assert "# left out: this cell failed in the notebook (rank 0 raised NameError" in script
    assert "# _show(losses.append(loss_typo))" in script

    code, out = torchrun(target, tmp_path)
    assert code == 0, out
    for rank, losses in notebook_losses.items():
        exported = re.findall(rf"rank {rank} after (\d+) steps: loss ([\d.]+)", out)
        assert [int(steps) for steps, _ in exported] == [10, 20, 30], out  # the cell ran 3 times
        for steps, loss in exported:
            assert float(loss) == pytest.approx(losses[int(steps) - 1], rel=1e-4, abs=1e-6), out
    assert losses[-1] < 0.5 * losses[0]
    assert out.count("only rank 0 saves 0") == 1
    assert out.count("] True") == 2, out  # DDP kept the replicas identical


HANDOFF_CELLS = [
    # rank 0 writes a file late; the others read it in the next cell (a race without a barrier)
    "%%distributed\nimport time\nif rank == 0:\n    time.sleep(1.5)\n    with open('handoff.txt', 'w') as f:\n"
    "        f.write('from rank 0')\n",
    "%%distributed\nwith open('handoff.txt') as f:\n    text = f.read()\n",
    "%%distributed\nlen(text)  # a trailing comment after the cell's value\n",
    # RPC on its own tcp:// rendezvous, as the notebook allows (rank 0 hosts that store)
    "%%distributed\nimport os\nfrom torch.distributed import rpc\n"
    "url = f\"tcp://127.0.0.1:{int(os.environ['MASTER_PORT']) + 1}\"\n"
    "rpc.init_rpc(f'w{rank}', rank=rank, world_size=world_size,\n"
    "             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=url))\n"
    "peer_sum = rpc.rpc_sync(f'w{(rank + 1) % world_size}', torch.add, args=(torch.ones(1), rank)).item()\n"
    "rpc.shutdown()\nprint(f'rank {rank} rpc {peer_sum}')\n",
]


def test_exported_cells_keep_the_notebook_order_rendezvous_and_values(tmp_path: Path, cluster2) -> None:
    """The same cells three ways: in the notebook (cells), exported under torchrun, and the
    exported script through %dist_run. A file handed from rank 0 to the others across a cell
    boundary, a value with a trailing comment and RPC over tcp:// give the same output."""
    steps = export.script_steps([(f"In[{i}]", s) for i, s in enumerate(HANDOFF_CELLS, 1)], 2)
    target = export.write_script(tmp_path / "handoff.py", steps, nproc=2)
    compile(target.read_text(), str(target), "exec")
    assert target.read_text().count("\n_cell_boundary()") == len(HANDOFF_CELLS)

    code, out = torchrun(target, tmp_path)
    assert code == 0, out
    assert out.count("[rank 0] 11") == 1 and out.count("[rank 1] 11") == 1, out
    assert "rank 0 rpc 1.0" in out and "rank 1 rpc 2.0" in out, out

    cwd = os.getcwd()
    os.chdir(tmp_path)  # the ranks work in the notebook's directory: the cells' relative path
    try:
        cluster2.run(f"import os\nos.chdir({str(tmp_path)!r})").raise_for_errors()
        in_cells = [cluster2.run(source.split("\n", 1)[1], timeout=60).raise_for_errors()
                    for source in HANDOFF_CELLS]
        assert in_cells[2].grouped_values() == [([0, 1], "11")]
        assert "rank 1 rpc 2.0" in in_cells[3].stdout[1]
        (tmp_path / "handoff.txt").unlink()
        through_run = cluster2.run_script(str(target), timeout=120).raise_for_errors()
        assert "[rank 1] 11" in through_run.stdout[1] and "rank 0 rpc 1.0" in through_run.stdout[0]
    finally:
        cluster2.run(f"os.chdir({cwd!r})")
        os.chdir(cwd)
