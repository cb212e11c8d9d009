"""What a site sets stays the site's, on real ranks: an exported GLOO/NCCL/TP_SOCKET_IFNAME is
kept (with a note) where nbdist would pick its own interface, and a checkpoint saved where the
ranks do not share a directory (each host's own working directory) fails naming the need for a
shared path instead of saving half of it; a rank away from the notebook's machine removes its
own flight-recorder directory even when it ends itself because the kernel is gone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbdist import Cluster
from nbdist.cluster.launchers import MultiHostWarning

SITE = {"NCCL_SOCKET_IFNAME": "site0", "TP_SOCKET_IFNAME": "lo"}


@pytest.fixture(scope="module")
def site_ranks(fast_config) -> Iterator[Cluster]:
    # --interface takes the path of ranks on several hosts (rendezvous off loopback, an
    # interface handed to every rank), here on this machine's loopback interface
    cluster = Cluster(n=2, config=fast_config, interface="lo",
                      launcher_options={"environment": SITE})
    with pytest.warns(MultiHostWarning, match="unauthenticated"):
        cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_an_exported_socket_interface_is_kept_and_said(site_ranks: Cluster):
    names = ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"]
    result = site_ranks.run(f"import os\n[os.environ.get(k) for k in {names!r}]")
    # gloo's was unset: --interface's; the site's NCCL and TensorPipe ones stay
    assert result.raise_for_errors().grouped_values() == [([0, 1], "['lo', 'site0', 'lo']")]
    assert site_ranks.ranks[0].notes == [
        "NCCL_SOCKET_IFNAME=site0 is yours and kept (nbdist would set lo: see "
        "docs/MULTI_NODE.md)"]


def test_a_checkpoint_in_each_ranks_own_directory_names_the_shared_path(
        site_ranks: Cluster, tmp_path: Path):
    site_ranks.push({"root": str(tmp_path)})
    result = site_ranks.run(
        "import os, nbdist\nos.makedirs(f'{root}/host{rank}', exist_ok=True)\n"
        "os.chdir(f'{root}/host{rank}')  # as if each rank were on a host of its own\n"
        "try:\n"
        "    p = nbdist.prepare(torch.nn.Linear(4, 4), strategy='ddp')\n"
        "    nbdist.save_checkpoint('ckpt', p)\n"
        "finally:\n"
        "    os.chdir(root)\n", timeout=120)
    assert sorted(result.errors) == [1], result.failure_message()
    error = result.errors[1]
    assert error.ename == "FileNotFoundError"
    assert "rank 1 does not see the nbdist_checkpoint.json rank 0 just wrote there" in error.evalue
    assert "a path on a filesystem every host mounts" in error.evalue


ORPHANED_REMOTE_RANK = """
import os, sys, time, zmq
from nbdist.worker import orphan_guard
from nbdist.worker.process_group import dump_environment
prefix = dump_environment({}, 0, None)['TORCH_FR_DUMP_TEMP_FILE']  # a rank away from the notebook
print(os.path.dirname(prefix), flush=True)
context = zmq.Context()
notebook_end = context.socket(zmq.PULL)
port = notebook_end.bind_to_random_port('tcp://127.0.0.1')
rank_end = context.socket(zmq.PUSH)
rank_end.connect(f'tcp://127.0.0.1:{port}')
orphan_guard.guard(rank_end, (2**22 + 1, 0.0), grace=0.2)  # a kernel on another machine
time.sleep(1.0)
notebook_end.close(linger=0)  # the kernel is gone
time.sleep(60)
print('still running', flush=True)
"""


def test_a_remote_rank_that_ends_itself_removes_its_dump_directory():
    child = subprocess.Popen([sys.executable, "-c", ORPHANED_REMOTE_RANK],
                             stdout=subprocess.PIPE, text=True)
    try:
        directory = child.stdout.readline().strip()
        assert os.path.isdir(directory)
        assert child.wait(timeout=30) == 0  # the guard's exit, not the script's end
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "still running" not in child.stdout.read()
    assert not os.path.exists(directory)  # os._exit skips atexit: the guard removed it
