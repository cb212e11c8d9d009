"""The magics driven through a real IPython shell, against real engines."""

from __future__ import annotations

import re

import psutil
import pytest
from IPython.core.error import UsageError

from nbdist.errors import NbdistError
from nbdist.notebook import magics
from nbdist.notebook.options import launcher_kwargs, push_values


def test_launcher_flags_become_cluster_kwargs_without_ipython():
    assert launcher_kwargs() == {"master_addr": None, "interface": None}  # Cluster's own default
    assert launcher_kwargs(launcher="mpi", hosts="a,b", mpi_args="--bind-to none",
                           launcher_options=["timelimit=2:00:00"]) == {
        "master_addr": None, "interface": None, "launcher": "mpi",
        "launcher_options": {"timelimit": "2:00:00", "hosts": "a,b", "mpi_args": "--bind-to none"}}
    with pytest.raises(NbdistError, match="write KEY=VALUE"):
        launcher_kwargs(launcher="slurm", launcher_options=["partition"])


def test_push_items_become_values_without_ipython():
    namespace = {"lr": 0.5}
    assert push_values(["lr", "scale=2*lr"], namespace, lambda expr: eval(expr, {}, namespace)) == {
        "lr": 0.5, "scale": 1.0}
    for items, message in [([], "needs names"), (["missing"], "not defined in the notebook"),
                           (["1x=1"], "not a valid Python name")]:
        with pytest.raises(NbdistError, match=message):
            push_values(items, namespace, lambda expr: 1)


def test_cell_before_start_says_so(ip):
    with pytest.raises(UsageError, match="run %dist_start first"):
        ip.run_cell_magic("distributed", "", "print(1)")


def test_a_cell_that_does_not_parse_shows_the_caret_block_alone(ip, capsys):
    """As IPython shows a local SyntaxError: no frames of the magic, nbdist or IPython, and
    nothing sent (no cluster is needed to see it); through %autodist too."""
    for cell in ("%%distributed\nfor step in range(3)\n    pass\n", "for step in range(3)\n"):
        autodist = not cell.startswith("%%")
        if autodist:
            ip.run_line_magic("autodist", "on")
        capsys.readouterr()
        try:
            result = ip.run_cell(cell)
            shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
        finally:
            ip.run_line_magic("autodist", "off")
        assert isinstance(result.error_before_exec, SyntaxError), result
        assert "SyntaxError: expected ':'" in shown and "File <distributed cell>:1" in shown, shown
        assert "for step in range(3)\n" in shown and "^" in shown, shown
        assert "nbdist" not in shown and "Traceback" not in shown, shown
        assert "interactiveshell" not in shown and "run_cell_magic" not in shown, shown


@pytest.mark.parametrize("line,message", [
    ("-n 0", "1 or more"), ("-n two", "not a whole number"),
    ("--backend mpi", "invalid choice"), ("--bogus", "unrecognized arguments"),
])
def test_bad_start_arguments(ip, line, message):
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("dist_start", line)
    assert magics.current_cluster() is None


def test_session(ip, capsys, assert_all_gone):
    ip.run_line_magic("dist_start", "-n 2")
    out = capsys.readouterr().out
    assert "2 rank(s) ready (gloo)" in out and "rank  local  host" in out
    ip.run_line_magic("dist_start", "-n 2")
    assert "already running; not starting a second one" in capsys.readouterr().out

    ip.run_cell_magic("distributed", "", "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nprint('hello', rank)\nt")
    out = capsys.readouterr().out
    assert "[rank 0]\x1b[0m hello 0" in out and "[rank 1]\x1b[0m hello 1" in out
    assert "Out[ranks 0-1]: tensor([3.])" in out

    ip.run_cell_magic("distributed", "--ranks 1 --rank0", "print('only one')\nrank")
    assert "only one" not in capsys.readouterr().out  # --rank0 hides rank 1's output

    for line, message in [("--ranks 5", "do not exist"), ("--ranks 1-0", "backwards"),
                          ("--timeout -1", "more than 0"), ("--nope", "unrecognized"),
                          ("--output loud", "invalid choice")]:
        with pytest.raises(UsageError, match=message):
            ip.run_cell_magic("distributed", line, "pass")

    ip.user_ns["lr"] = 0.5
    ip.run_line_magic("dist_push", "lr scale=2*lr")
    assert ip.run_line_magic("dist_pull", "scale") == {0: 1.0, 1: 1.0}
    with pytest.raises(UsageError, match="not defined in the notebook"):
        ip.run_line_magic("dist_push", "missing_name")

    ip.user_ns["notebook_value"] = "untouched"
    with pytest.raises(Exception, match="rank 1 raised ZeroDivisionError"):
        ip.run_cell_magic("distributed", "", "if rank == 1:\n    1/0\ndist.barrier()")
    assert ip.user_ns["notebook_value"] == "untouched"
    ip.run_cell_magic("distributed", "", "dist.barrier()\n'ok'")
    assert "Out[ranks 0-1]: 'ok'" in capsys.readouterr().out

    status = ip.run_line_magic("dist_status", "")
    assert "2 rank(s), gloo" in str(status)
    # from torch's flight recorder (2.13+) or, before it, nbdist's own record of the cells' calls
    side_by_side = repr(ip.run_line_magic("dist_status", "--collectives"))
    assert re.search(r"default group\s+\d+\s+barrier\s+barrier", side_by_side), side_by_side

    ip.run_line_magic("autodist", "on")
    ip.run_cell("auto_value = rank * 7")
    ip.run_line_magic("autodist", "off")
    assert ip.run_line_magic("dist_pull", "auto_value") == {0: 0, 1: 7}

    cluster = magics.current_cluster()
    pids = cluster.all_pids()
    ip.run_line_magic("dist_stop", "")
    assert "stopped" in capsys.readouterr().out
    assert_all_gone(pids, within=5)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
