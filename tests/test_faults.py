"""docs/FAULTS.md scenarios on CPU/gloo with real engines. After each: the next collective works
(directly or after one restart) and no process is orphaned. Time bounds are loose (noisy 2-core
machine) but far below the 30 s process-group timeout used here."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from nbdist import Cluster, torch_support
from tests.sinks import RecordingSink

ALL_REDUCE_OK = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


def assert_collective_works(cluster: Cluster) -> None:
    result = cluster.run(ALL_REDUCE_OK, timeout=30).raise_for_errors()
    assert result.grouped_values() == [(list(range(cluster.world_size)), str(float(cluster.world_size)))]


def interrupt_after(seconds: float) -> threading.Timer:
    """Deliver a real SIGINT to this process (the one running the magic/runner)."""
    timer = threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture(autouse=True)
def no_stray_interrupt():
    yield
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer):
            thread.cancel()


@pytest.fixture(scope="module")
def cluster(cluster4: Cluster) -> Cluster:
    return cluster4


@pytest.fixture(autouse=True)
def full_cluster(cluster: Cluster):
    """Every test starts from a full, healthy cluster (restart if a previous test killed a rank)."""
    if any(p.state != "alive" for p in cluster.ranks) or cluster.controller_lost:
        cluster.restart()
    yield


def test_row1_rank_raises_while_others_wait_in_all_reduce(cluster: Cluster):
    cluster.run("survivor = 'kept'").raise_for_errors()
    code = "x = torch.ones(1)\nif rank == 1:\n    raise ValueError('rank 1 broke')\ndist.all_reduce(x)\n"
    started = time.perf_counter()
    result = cluster.run(code, timeout=60)
    elapsed = time.perf_counter() - started
    assert elapsed < 6, f"root cause took {elapsed:.1f} s (goal 2 s)"
    roots = result.root_causes()
    assert [e.rank for e in roots] == [1] and roots[0].ename == "ValueError"
    message = result.failure_message()
    # the root cause first; the three ranks it released share one line
    assert message.index("rank 1 raised ValueError") < message.index(
        "ranks 0,2-3: was waiting in all_reduce at cell line 4"), message
    for r in (0, 2, 3):
        assert result.errors[r].kind == "collective"
        assert "all_reduce at cell line 4" in result.errors[r].where
    assert any("rebuilt" in a for a in result.actions)
    assert_collective_works(cluster)
    assert cluster.pull("survivor") == {r: "kept" for r in range(4)}


def test_row1_with_a_ddp_model_holding_the_group(cluster: Cluster):
    # the DDP model keeps the process group object (and its sockets) alive after destroy: the
    # peers must still be released at once, not by the ladder's kill
    cluster.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp = DDP(torch.nn.Linear(64, 64))\n"
    ).raise_for_errors()
    code = (
        "loss = ddp(torch.randn(8, 64)).sum()\n"
        "if rank == 1:\n"
        "    raise ValueError('rank 1 broke before backward')\n"
        "loss.backward()\n"
    )
    result = cluster.run(code, timeout=60)
    assert [e.rank for e in result.root_causes()] == [1]
    named = ("all_reduce #\\d+ of the default group \\(gradients in backward\\(\\)\\)"
             if torch_support.has("flight-recorder") else "gradient all-reduce in backward\\(\\)")
    for rank in (0, 2, 3):
        assert re.fullmatch(f"{named} at cell line 4", result.errors[rank].where), \
            result.errors[rank].where
    assert not any("killed" in a for a in result.actions), result.actions
    assert all(p.state == "alive" for p in cluster.ranks)
    assert any("rebuilt" in a for a in result.actions), result.actions
    assert_collective_works(cluster)
    cluster.run("del ddp").raise_for_errors()


def test_a_runtime_error_keeps_its_full_traceback(cluster: Cluster):
    # RuntimeError goes through nbdist's cheap-traceback hook on the ranks (nbdist.worker.tracebacks):
    # a user's own RuntimeError must still show IPython's full traceback with the cell's lines
    code = "m = torch.nn.Linear(3, 4)\nif rank == 1:\n    m(torch.randn(2, 5))\ndist.barrier()\n"
    result = cluster.run(code, timeout=60)
    roots = result.root_causes()
    assert [e.rank for e in roots] == [1] and roots[0].ename == "RuntimeError"
    plain = re.sub(r"\x1b\[[0-9;]*m", "", roots[0].traceback)
    assert "m(torch.randn(2, 5))" in plain and "line 3" in plain, plain
    assert "mat1 and mat2 shapes cannot be multiplied" in result.failure_message()
    assert_collective_works(cluster)


def test_row1_barrier_variant_and_subset(cluster: Cluster):
    result = cluster.run("if rank == 2:\n    1/0\ndist.barrier()", timeout=60)
    assert [e.rank for e in result.root_causes()] == [2]
    assert "barrier" in result.errors[0].where
    assert_collective_works(cluster)


def test_row2_sigkill_during_all_reduce(cluster: Cluster, assert_all_gone):
    old_pids = {p.spec.rank: p.pid for p in cluster.ranks}
    code = (
        "import os, time\nprint('rank', rank, 'about to reduce', flush=True)\n"
        "if rank == 2:\n    time.sleep(0.5)\n    os.kill(os.getpid(), 9)\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\n"
    )
    started = time.perf_counter()
    result = cluster.run(code, timeout=60)
    elapsed = time.perf_counter() - started
    assert elapsed < 10, f"dead rank took {elapsed:.1f} s to report (goal 5 s)"
    err = result.errors[2]
    assert err.kind == "dead" and "signal 9" in err.evalue
    assert "about to reduce" in err.traceback  # its last output lines
    assert "rank 2 died" in result.failure_message()
    assert "Warning" not in err.traceback, err.traceback  # its log: nothing of nbdist's start
    assert cluster.status().rows[2].state.startswith("dead")
    assert any("%dist_restart" in a for a in result.actions)
    cluster.restart()
    new_pids = {p.spec.rank: p.pid for p in cluster.ranks}
    assert not set(old_pids.values()) & set(new_pids.values())
    assert_all_gone(list(old_pids.values()))
    assert_collective_works(cluster)


def test_row3_desync_names_the_odd_rank(cluster: Cluster):
    code = "dist.barrier()\nif rank != 1:\n    dist.barrier()\n"
    started = time.perf_counter()
    result = cluster.run(code, timeout=3)
    elapsed = time.perf_counter() - started
    assert result.timed_out and elapsed < 3 + 12
    report = "\n".join(result.report)
    if torch_support.has("flight-recorder"):  # torch's record of the group's collectives
        assert re.match(r"ranks 0,2-3 wait in barrier #\d+ of the default group \(at cell line 3\); "
                        r"rank 1 never entered it: it finished the cell", report), report
    else:  # nbdist's own count of the collectives each rank entered from Python
        assert "desync: rank 1" in report
    assert "rank 0: waiting in barrier at cell line 3" in report
    if any(p.state != "alive" for p in cluster.ranks):
        cluster.restart()
    assert_collective_works(cluster)


def test_row22_a_device_mesh_dimension_one_member_skips_is_released_without_a_kill(
        cluster: Cluster):
    cluster.run("from torch.distributed.device_mesh import init_device_mesh\n"
                "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
                "tp = mesh['tp'].get_group()\nkept = rank * 10\n").raise_for_errors()
    pids = [p.pid for p in cluster.ranks]
    result = cluster.run("x = torch.ones(5)\nif rank != 1:\n    dist.all_reduce(x, group=tp)\n",
                         timeout=3)
    assert result.timed_out
    if torch_support.has("flight-recorder"):
        assert re.match(r"rank 0 waits in all_reduce #\d+ of the group mesh_tp \(ranks 0, 1\) "
                        r"\(at cell line 3, \[5\] Float, 20 B\); rank 1 never entered it: it "
                        r"finished the cell", result.report[0]), result.report
    assert not any("killed" in a for a in result.actions), result.actions
    assert [p.pid for p in cluster.ranks] == pids
    assert cluster.pull("kept") == {r: r * 10 for r in range(4)}
    assert_collective_works(cluster)


def test_row4_python_hang_shows_every_stack_and_keeps_state(cluster: Cluster):
    cluster.run("kept = rank").raise_for_errors()
    code = "def spin():\n    while True:\n        pass\nspin()\n"
    result = cluster.run(code, timeout=2)
    assert result.timed_out
    report = "\n".join(result.report)
    for r in range(4):
        assert re.search(f"rank {r}: running Python at cell line [23] in spin", report), report
    assert all(e.kind == "interrupted" for e in result.errors.values())
    assert cluster.pull("kept") == {r: r for r in range(4)}
    assert_collective_works(cluster)


def test_row5_stop_button_during_training_loop(cluster: Cluster):
    cluster.run(
        "model = torch.nn.Linear(32, 32)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\nsteps = 0"
    ).raise_for_errors()
    code = (
        "while True:\n"
        "    loss = model(torch.randn(16, 32)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    steps += 1\n"
    )
    timer = interrupt_after(1.5)
    started = time.perf_counter()
    result = cluster.run(code, timeout=60)
    elapsed = time.perf_counter() - started
    timer.join()
    assert result.interrupted and elapsed < 1.5 + 6
    assert all(e.kind == "interrupted" for e in result.errors.values())
    # each rank says where it stopped (from its plain KeyboardInterrupt traceback)
    assert all(e.where in ("cell line 2", "cell line 3", "cell line 4") for e in result.errors.values()), \
        {r: e.where for r, e in result.errors.items()}
    assert all(v > 0 for v in cluster.pull("steps").values())  # state kept
    assert not any("rebuilt" in a for a in result.actions)
    assert_collective_works(cluster)


def test_row6_stop_button_while_ranks_inside_a_collective(cluster: Cluster):
    code = "import time\nif rank == 3:\n    time.sleep(600)\ndist.barrier()\n"
    timer = interrupt_after(1.5)
    started = time.perf_counter()
    result = cluster.run(code, timeout=120)
    elapsed = time.perf_counter() - started
    timer.join()
    assert result.interrupted and elapsed < 1.5 + 10
    assert result.errors[3].kind == "interrupted"
    if torch_support.has("flight-recorder"):
        assert re.match(r"ranks 0-2 wait in barrier #\d+ of the default group \(at cell line 4\); "
                        r"rank 3 never entered it: it is running Python at cell line 3",
                        result.report[0]), result.report
    assert all(p.state == "alive" for p in cluster.ranks)
    assert any("rebuilt" in a for a in result.actions), result.actions
    assert_collective_works(cluster)


def test_row6_every_rank_blocked_inside_a_collective_is_released_without_a_kill(cluster: Cluster):
    # nobody is idle, so tearing down idle peers cannot help: only the release signal can
    code = (
        "t = torch.zeros(1)\n"
        "if rank == 3:\n"
        "    dist.recv(t, src=0)\n"
        "else:\n"
        "    dist.barrier()\n"
    )
    pids = [p.pid for p in cluster.ranks]
    timer = interrupt_after(1.5)
    result = cluster.run(code, timeout=120)
    timer.join()
    assert result.interrupted
    assert any("made it fail" in a for a in result.actions), result.actions
    assert not any("killed" in a for a in result.actions), result.actions
    assert [p.pid for p in cluster.ranks] == pids and all(p.state == "alive" for p in cluster.ranks)
    assert any("rebuilt" in a for a in result.actions), result.actions
    assert_collective_works(cluster)


def test_row7_out_of_memory_on_rank0(cluster: Cluster):
    code = "if rank == 0:\n    big = torch.empty(2**44, dtype=torch.uint8)\ndist.all_reduce(torch.ones(1))\n"
    result = cluster.run(code, timeout=60)
    roots = result.root_causes()
    assert [e.rank for e in roots] == [0]
    assert "bytes" in roots[0].evalue or "memory" in roots[0].evalue.lower()
    assert all(result.errors[r].kind == "collective" for r in (1, 2, 3))
    assert_collective_works(cluster)


def test_row8_segfault_is_reported_with_its_signal(cluster: Cluster):
    code = "import ctypes, time\nif rank == 1:\n    time.sleep(0.3)\n    ctypes.string_at(0)\ndist.barrier()\n"
    result = cluster.run(code, timeout=60)
    err = result.errors[1]
    assert err.kind == "dead" and "SIGSEGV" in err.evalue
    assert "Segmentation fault" in err.traceback  # faulthandler's line from the engine log
    cluster.restart()
    assert_collective_works(cluster)


def test_row9_controller_killed(cluster: Cluster, assert_all_gone):
    controller_pid = cluster._processes.controller[0]
    # its schedulers and heart monitor are forked children: orphaned by the kill, they must
    # still be stopped (they were left running before: 8 per kill)
    children = [c.pid for c in psutil.Process(controller_pid).children(recursive=True)]
    assert children
    os.kill(controller_pid, signal.SIGKILL)
    started = time.perf_counter()
    deadline = time.monotonic() + 10
    while not cluster.controller_lost and time.monotonic() < deadline:
        cluster.poll_dead()
        time.sleep(0.1)
    assert cluster.controller_lost
    assert "controller lost" in cluster.status().summary_line()
    result = cluster.run("1", timeout=5)
    assert time.perf_counter() - started < 20
    assert result.errors and any("controller" in a for a in result.actions)
    old = cluster.all_pids()
    cluster.restart()
    assert not cluster.controller_lost
    assert set(children) <= set(old)
    assert_all_gone([p for p in old if p != controller_pid])
    assert_collective_works(cluster)


def test_row11_stale_files_and_busy_ports_do_not_block_start(cluster_factory, tmp_path):
    stale = tmp_path / "nbdist-stale"
    stale.mkdir()
    (stale / "pids.json").write_text('{"pids": [[999999, 1.0]]}')
    import socket

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    try:
        fresh = cluster_factory(2)
        assert_collective_works(fresh)
    finally:
        squatter.close()


def test_row13_200kb_of_stderr_never_blocks(cluster: Cluster, fast_config):
    small = fast_config.replace(max_output_chars=50_000)
    cluster.config, saved = small, cluster.config
    sink = RecordingSink()
    code = "import sys\nsys.stderr.write('x' * 200_000 + '\\n')\nprint('final loss 0.25', file=sys.stderr)\n'done'"
    try:
        result = cluster.run(code, timeout=60, sink=sink)
    finally:
        cluster.config = saved
    result.raise_for_errors()
    assert all(len(result.stderr[r]) == 200_001 + len("final loss 0.25\n") for r in range(4))
    assert result.grouped_values() == [([0, 1, 2, 3], "'done'")]
    for r in range(4):  # the head live, then (at the end) the last lines: where the flood ended
        shown = sink.text(r, "stderr")
        assert shown.startswith("x" * 50_000) and shown.endswith("final loss 0.25\n")
        assert len(shown) < 50_000 + 2 * small.output_tail_chars
    assert any("characters left out here; the last lines follow" in s for s in sink.statuses)


# row 15 (security probe): tests/test_security.py, on the whole process tree


def _start_kernel(tmp_path, source: str) -> subprocess.Popen[str]:
    """A process that stands for a notebook kernel: `source` run with this checkout's nbdist."""
    script = tmp_path / "kernel.py"
    script.write_text(source)
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})


def _kill_kernel(kernel: subprocess.Popen[str], pids: list[int], assert_all_gone) -> None:
    """SIGKILL the kernel (no cleanup runs in it): every one of `pids` must end by itself."""
    kernel.kill()
    killed = time.perf_counter()
    kernel.wait(timeout=10)
    assert_all_gone(pids, within=10)
    print(f"all {len(pids)} processes gone {time.perf_counter() - killed:.2f} s after the "
          "kernel's SIGKILL")


def test_row10_kernel_killed_leaves_no_orphans(tmp_path, assert_all_gone):
    # rank 0 blocked in all_reduce, rank 1 asleep, each with a child of its own: no cleanup code
    # runs in the killed kernel, so each process must see it go by itself
    proc = _start_kernel(
        tmp_path,
        "import threading\n"
        "from nbdist import Cluster\n"
        "c = Cluster(n=2).start()\n"
        "c.run(\"import subprocess\\nchild = subprocess.Popen(['sleep', '600']).pid\").raise_for_errors()\n"
        "pids = c.all_pids() + list(c.pull('child').values())\n"
        "threading.Timer(1.5, lambda: print(c.workdir, *pids, flush=True)).start()\n"
        "c.run('import time\\nif rank == 0:\\n    dist.all_reduce(torch.ones(1))\\n'\n"
        "      'else:\\n    time.sleep(600)', timeout=600)\n"
    )
    try:
        line = proc.stdout.readline()
        workdir, *pids = line.split()
        pids = [int(p) for p in pids]
        assert len(pids) >= 6, line  # controller and its family, fork server, 2 engines, 2 sleeps
        running = [psutil.Process(pid) for pid in pids]
        assert all(p.status() != psutil.STATUS_ZOMBIE for p in running)
        _kill_kernel(proc, pids, assert_all_gone)
        assert not os.path.exists(workdir)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_row10_kernel_killed_after_its_controller_leaves_no_orphans(tmp_path, assert_all_gone):
    # row 9 then row 10: the controller SIGKILLed first orphans its schedulers and heart monitor,
    # and the kernel that would stop them at the next restart is killed before it
    proc = _start_kernel(
        tmp_path,
        "import time\n"
        "from nbdist import Cluster\n"
        "c = Cluster(n=2).start()\n"
        "print(c._processes.controller[0], *c.all_pids(), flush=True)\n"
        "time.sleep(600)\n"
    )
    family: list[int] = []
    try:
        controller, *pids = [int(p) for p in proc.stdout.readline().split()]
        family += [c.pid for c in psutil.Process(controller).children(recursive=True)]
        assert family and set(family) <= set(pids)
        os.kill(controller, signal.SIGKILL)
        time.sleep(0.5)
        assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in family)
        _kill_kernel(proc, pids, assert_all_gone)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in family:  # a failure leaves no orphan either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_row14_thirty_cycles_leak_nothing(tmp_path, fast_config, assert_all_gone):
    me = psutil.Process()
    fds_before = me.num_fds()
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    cluster = Cluster(n=2, config=fast_config).start()
    workdirs = {cluster.workdir}  # its own only: other clusters may run beside the test
    try:
        for cycle in range(30):
            workdirs.add(cluster.workdir)
            cluster.run("t = torch.ones(1); dist.all_reduce(t)").raise_for_errors()
            cluster.signal_rank(1, signal.SIGKILL)
            result = cluster.run("dist.barrier()", timeout=20)
            assert result.errors, cycle
            cluster.restart()
    finally:
        assert_all_gone(cluster.stop())  # stop() returns the PIDs it stopped
    assert not [d for d in workdirs if d and os.path.exists(d)]
    assert me.num_fds() <= fds_before + 10
    if os.path.isdir("/dev/shm"):
        assert not (set(os.listdir("/dev/shm")) - shm_before)
