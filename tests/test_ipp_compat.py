"""Each private ipyparallel / ipykernel / IPython attribute nbdist relies on (nbdist/ipp_compat.py),
checked against the installed versions: on a real engine, IPython's real shell and a raw
ipyparallel cluster. When one fails after an upgrade, pyproject.toml's cap is what to revisit."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from nbdist import Cluster, ipp_compat


def _until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def test_iopub_thread_is_diverted_while_a_rank_runs_a_cell(cluster2: Cluster) -> None:
    cluster2.run(
        "from nbdist import ipp_compat\n"
        "iopub = ipp_compat.iopub_thread()\n"
        "kind = type(iopub).__module__ + '.' + type(iopub).__name__\n"
        "diverted = 'send_multipart' in iopub.__dict__\n"
        "own_send = callable(type(iopub).send_multipart)\n"
        "print('through the channel')"
    ).raise_for_errors()
    assert set(cluster2.pull("kind").values()) == {"ipykernel.iostream.IOPubThread"}
    assert cluster2.pull("diverted") == {0: True, 1: True}
    assert cluster2.pull("own_send") == {0: True, 1: True}


def test_iopub_divert_and_restore_on_a_thread_of_our_own() -> None:
    import zmq
    from ipykernel.iostream import IOPubThread

    context = zmq.Context()
    out, back = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    port = back.bind_to_random_port("tcp://127.0.0.1")
    out.connect(f"tcp://127.0.0.1:{port}")
    iopub = IOPubThread(out)  # not started: its own send goes straight to the socket
    sent: list[list[Any]] = []
    try:
        ipp_compat.divert_iopub(iopub, lambda parts, *a, **k: sent.append(parts))
        iopub.send_multipart([b"x"])
        ipp_compat.restore_iopub(iopub)
        assert "send_multipart" not in iopub.__dict__
        ipp_compat.iopub_send(iopub, [b"y"])
        assert back.poll(10_000) and back.recv_multipart() == [b"y"]
    finally:
        iopub.close()
        back.close(linger=0)
        context.destroy(linger=0)
    assert sent == [[b"x"]]


@pytest.fixture
def shell() -> Any:
    from IPython.testing import globalipapp

    return globalipapp.start_ipython() or globalipapp.get_ipython()


def test_stored_tracebacks_hook_is_what_history_calls(shell: Any) -> None:
    assert hasattr(type(shell), "_format_exception_for_storage")
    seen: list[str] = []

    def store(exc: BaseException, **_: Any) -> dict[str, Any]:
        seen.append(type(exc).__name__)
        return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": []}

    ipp_compat.skip_stored_tracebacks(shell, store)
    try:
        shell.run_cell("1 / 0", store_history=True)
    finally:
        del shell._format_exception_for_storage
    assert seen == ["ZeroDivisionError"]


def test_show_traceback_prints_the_structured_traceback(shell: Any, capsys: Any) -> None:
    ipp_compat.show_traceback(shell, ValueError, ValueError("bad"), ["line one", "ValueError: bad"])
    assert "line one\nValueError: bad" in capsys.readouterr().out


def test_forget_last_traceback(shell: Any) -> None:
    shell.run_cell("1 / 0")
    assert getattr(shell, "_last_traceback", "absent") is not None
    ipp_compat.forget_last_traceback(shell)
    assert getattr(shell, "_last_traceback", None) is None


def test_ipyparallel_hooks_on_a_raw_cluster(tmp_path: Any) -> None:
    """Started inside a running event loop, as in a kernel: ipyparallel then runs the Cluster on a
    thread of its own (`_async_thread`), and its wait threads report exits through
    `loop.add_callback`."""
    import ipyparallel as ipp

    found: dict[str, Any] = {}

    async def in_a_kernel_like_loop() -> None:
        cluster = ipp.Cluster(n=1, controller_ip="127.0.0.1", profile_dir=str(tmp_path),
                              cluster_id="compat", log_level=40)
        cluster.start_controller_sync()
        cluster.start_engines_sync()
        found["cluster"] = cluster
        client = cluster.connect_client_sync()
        try:
            client.wait_for_engines(1, timeout=60)
            found["connection"] = ipp_compat.client_connection(client)
            lost: list[int] = []
            found["hooked"] = ipp_compat.on_unregistration(client, lost.append)
            (engine_set,) = cluster.engines.values()
            (engine,) = engine_set.launchers.values()
            stops: list[tuple[str, Any]] = []
            ipp_compat.run_wait_callbacks_at_once(engine)
            engine.on_stop(lambda data: stops.append((_thread_name(), data["exit_code"])))
            os.kill(engine.pid, signal.SIGKILL)
            _until(lambda: bool(stops), "on_stop from the wait thread")
            _until(lambda: bool(lost), "unregistration notification")
            found["stops"], found["lost"] = stops, lost
        finally:
            client.close()
            cluster.stop_cluster_sync()
        launchers = [la for es in cluster.engines.values() for la in es.launchers.values()]
        ipp_compat.end_wait_threads(launchers, launchers, timeout=5.0)
        found["wait_threads"] = [la._wait_thread for la in launchers]

    asyncio.run(in_a_kernel_like_loop())
    cluster = found["cluster"]
    assert found["connection"]["interface"].startswith("tcp://")
    assert found["hooked"] and found["lost"] == [0]
    (thread_name, exit_code), = found["stops"]
    assert thread_name.startswith("wait(pid=") and exit_code == -signal.SIGKILL
    assert not any(t is not None and t.is_alive() for t in found["wait_threads"])
    assert cluster._async_thread is not None and cluster._async_thread.is_alive()
    ipp_compat.end_loop_thread(cluster, timeout=10.0)
    assert not cluster._async_thread.is_alive()


def _thread_name() -> str:
    import threading

    return threading.current_thread().name


def test_a_launcher_subclass_owns_its_wait_thread(tmp_path) -> None:
    """What `ForkEngineLauncher` overrides: `_wait` runs on the thread `_start_waiting` starts
    (named ``wait(pid=N)``) and returns once `_stop_waiting` is set."""
    import sys
    import threading

    from ipyparallel.cluster.launcher import LocalProcessLauncher

    seen: list[str] = []

    class Probe(LocalProcessLauncher):
        def _wait(self) -> None:
            seen.append(threading.current_thread().name)
            self._stop_waiting.wait(30)

    # its log goes to profile_dir/log (without one: ./log/process-PID.log, left behind)
    launcher = Probe(cmd_and_args=[sys.executable, "-c", "import time; time.sleep(60)"],
                     profile_dir=str(tmp_path))
    launcher.start()
    try:
        _until(lambda: bool(seen), "call of the overridden _wait")
        assert seen == [f"wait(pid={launcher.pid})"]
    finally:
        launcher._stop_waiting.set()
        launcher._wait_thread.join(10)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.process.wait(10)
    assert not launcher._wait_thread.is_alive()



# ---------------------------------------------------------------- the standard library's forkserver


class _Child(ipp_compat.ForkserverChild):
    """What the forkserver's child runs here: exits with `code`, or sleeps until killed; it
    reports, through its exit code, what it inherited."""

    def __init__(self, code: int, sleep: bool = False) -> None:
        self.code, self.sleep = code, sleep

    def run(self) -> int:
        import multiprocessing
        from multiprocessing import forkserver, resource_tracker

        if self.sleep:
            time.sleep(60)
        inherited = (forkserver._forkserver._forkserver_alive_fd,
                     resource_tracker._resource_tracker._fd)
        if inherited != (None, None) or multiprocessing.current_process().name != "MainProcess":
            return 99
        return self.code


@pytest.fixture
def forkserver(tmp_path: Any) -> Any:
    """A forkserver started through `forkserver_command`, as `ForkServerProcess` starts one: its
    socket's address; stopped by closing its alive pipe."""
    import socket
    import subprocess
    import sys

    address = str(tmp_path / "fs.sock")
    alive_r, alive_w = os.pipe()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        listener.listen()
        command = ipp_compat.forkserver_command(sys.executable, listener.fileno(), alive_r,
                                                ["json"])
        server = subprocess.Popen(command, pass_fds=(listener.fileno(), alive_r))
    os.close(alive_r)
    try:
        yield address
    finally:
        os.close(alive_w)  # what ends the server: its alive pipe reads EOF
        assert server.wait(30) == 0


def test_forkserver_forks_a_child_and_tells_its_exit_code(forkserver: str) -> None:
    import psutil

    status, pid = ipp_compat.forkserver_fork(forkserver, _Child(7), timeout=30)
    try:
        assert ipp_compat.forkserver_exit_code(status) == 7  # 99: it kept what it inherited
    finally:
        os.close(status)
    status, pid = ipp_compat.forkserver_fork(forkserver, _Child(0, sleep=True), timeout=30)
    try:
        assert psutil.Process(pid).ppid() != os.getpid()  # the server's child, not ours
        os.kill(pid, signal.SIGKILL)
        assert ipp_compat.forkserver_exit_code(status) == -signal.SIGKILL
    finally:
        os.close(status)


def test_a_forked_child_holds_neither_alive_pipe_nor_resource_tracker(tmp_path: Any) -> None:
    """`forget_forkserver_fds` on what a child of the standard library's own forkserver holds
    (its `_forkserver_alive_fd` and `_resource_tracker._fd`), in a process that is not this one."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from multiprocessing import forkserver, resource_tracker\n"
        "from nbdist import ipp_compat\n"
        "r, w = os.pipe()\n"
        "forkserver._forkserver._forkserver_alive_fd, resource_tracker._resource_tracker._fd = r, w\n"
        "ipp_compat.forget_forkserver_fds()\n"
        "assert forkserver._forkserver._forkserver_alive_fd is None\n"
        "assert resource_tracker._resource_tracker._fd is None\n"
        "for fd in (r, w):\n"
        "    try:\n"
        "        os.fstat(fd)\n"
        "    except OSError:\n"
        "        continue\n"
        "    raise AssertionError(f'fd {fd} still open')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
