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
from IPython.testing.globalipapp import get_ipython

from nbdist import export
from nbdist.cluster import free_port
from nbdist.errors import NbdistError

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


def test_exported_script_trains_under_torchrun_with_two_gloo_ranks(tmp_path: Path) -> None:
    cells = export.distributed_cells(_history(TRAIN_CELLS), world_size=2)
    script = export.write_script(tmp_path / "train.py", cells)
    code, out = torchrun(script, tmp_path)
    assert code == 0, out
    pairs = re.findall(r"first loss ([\d.]+) last loss ([\d.]+)", out)
    assert len(pairs) == 2, out  # one line per rank
    for first, last in pairs:
        assert float(last) < 0.5 * float(first), out
    assert out.count("only rank 0 saves 0") == 1
    assert out.count("] True") == 2, out  # DDP kept the replicas identical
