"""What a site sets stays the site's, on real ranks: an exported GLOO/NCCL/TP_SOCKET_IFNAME is
kept (with a note) where nbdist would pick its own interface, and a checkpoint saved where the
ranks do not share a directory (each host's own working directory) fails naming the need for a
shared path instead of saving half of it."""

from __future__ import annotations

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
