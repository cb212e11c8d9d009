"""Lightning on the ranks: Fabric and the Trainer with strategy "ddp" run in cells and through
%dist_run on the cluster's process group, found through torchrun's environment, and start no
process of their own; "fsdp" where Lightning supports it (CUDA); its process-starting strategies
get a clear answer. Real engines; skipped when Lightning is not installed."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from nbdist import Cluster
from nbdist.config import NbdistConfig

# find_spec, not importorskip: importing Lightning here would change this process's os.environ
pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.skipif(find_spec("lightning") is None,
                       reason="Lightning is not installed (the frameworks extra)"),
]

SETUP = """
import psutil, torch, lightning as L
children_before = {p.pid for p in psutil.Process().children(recursive=True)}
ACCELERATOR = "DEVICE"
xs = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))
ys = xs.sum(dim=1, keepdim=True)
"""

FABRIC_TRAIN = """
fabric = L.Fabric(accelerator=ACCELERATOR, strategy="ddp", devices=2)
fabric.launch()
torch.manual_seed(0)
net = torch.nn.Linear(8, 1)
model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
x, y = fabric.to_device(xs), fabric.to_device(ys)
losses = []
for _ in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    opt.step()
    losses.append(loss.item())
who = (type(fabric._connector.cluster_environment).__name__, fabric.world_size, fabric.global_rank)
flat = torch.cat([q.detach().cpu().reshape(-1) for q in net.parameters()])
"""

TRAINER_FIT = """
import lightning.pytorch as pl

class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

torch.manual_seed(0)
module = Regression()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)
trainer = pl.Trainer(accelerator=ACCELERATOR, strategy="ddp", devices=2, max_epochs=2,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(module, loader)
who = (type(trainer.strategy.cluster_environment).__name__, trainer.world_size, trainer.global_rank)
losses = module.losses
flat = torch.cat([q.detach().cpu().reshape(-1) for q in module.parameters()])
"""

NO_CHILDREN = ("new_children = {p.pid for p in psutil.Process().children(recursive=True)}"
               " - children_before")


def _cluster(backend: str, config: NbdistConfig, assert_all_gone: Any) -> Iterator[Cluster]:
    cluster = Cluster(n=2, backend=backend, threads=1, config=config).start()
    try:
        yield cluster
    finally:
        assert_all_gone(cluster.stop())


@pytest.fixture(scope="module")
def gloo_ranks(fast_config: NbdistConfig, assert_all_gone: Any) -> Iterator[Cluster]:
    yield from _cluster("gloo", fast_config, assert_all_gone)


@pytest.fixture(scope="module")
def nccl_ranks(fast_config: NbdistConfig, assert_all_gone: Any) -> Iterator[Cluster]:
    yield from _cluster("nccl", fast_config, assert_all_gone)


@pytest.fixture
def ranks(device: str, request: pytest.FixtureRequest) -> Cluster:
    """Two ranks on the device under test, Lightning imported and each rank's data made."""
    cluster = request.getfixturevalue("gloo_ranks" if device == "cpu" else "nccl_ranks")
    cluster.run(SETUP.replace("DEVICE", device)).raise_for_errors()
    return cluster


def _assert_trained_as_ddp_without_new_processes(cluster: Cluster) -> None:
    assert cluster.pull("who") == {0: ("TorchElasticEnvironment", 2, 0),
                                   1: ("TorchElasticEnvironment", 2, 1)}
    losses, flats = cluster.pull("losses"), cluster.pull("flat")
    assert losses[0] != losses[1] and losses[0][-1] < losses[0][0]  # own data, one model
    assert flats[0].equal(flats[1])  # gradients averaged over both ranks: replicas agree
    cluster.run(NO_CHILDREN).raise_for_errors()
    assert cluster.pull("new_children") == {0: set(), 1: set()}
    cluster.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)\nassert t.item() == 2")\
        .raise_for_errors()


def test_fabric_ddp_trains_in_a_cell_on_the_clusters_group(ranks: Cluster) -> None:
    ranks.run(FABRIC_TRAIN, timeout=120).raise_for_errors()
    _assert_trained_as_ddp_without_new_processes(ranks)


def test_the_lightning_trainer_fits_with_ddp_in_a_cell(ranks: Cluster) -> None:
    ranks.run(TRAINER_FIT, timeout=120).raise_for_errors()
    _assert_trained_as_ddp_without_new_processes(ranks)


FABRIC_SCRIPT = """
import os
import torch
import lightning as L

fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
torch.manual_seed(0)
net = torch.nn.Linear(8, 1)
model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
xs = torch.randn(32, 8, generator=torch.Generator().manual_seed(fabric.global_rank))
losses = []
for _ in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(xs), xs.sum(dim=1, keepdim=True))
    fabric.backward(loss)
    opt.step()
    losses.append(loss.item())
who = (type(fabric._connector.cluster_environment).__name__, fabric.world_size, fabric.global_rank)
flat = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
"""


def test_a_fabric_script_runs_unchanged_through_dist_run(gloo_ranks: Cluster,
                                                         tmp_path: Path) -> None:
    gloo_ranks.run(SETUP.replace("DEVICE", "cpu")).raise_for_errors()
    script = tmp_path / "fabric_train.py"
    script.write_text(FABRIC_SCRIPT)
    gloo_ranks.run_script(str(script), timeout=120).raise_for_errors()
    _assert_trained_as_ddp_without_new_processes(gloo_ranks)


@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_spawn"])
def test_lightnings_own_process_launchers_say_to_use_ddp(gloo_ranks: Cluster,
                                                        strategy: str) -> None:
    gloo_ranks.run(SETUP.replace("DEVICE", "cpu")).raise_for_errors()
    result = gloo_ranks.run(textwrap.dedent(f"""
        fabric = L.Fabric(accelerator="cpu", strategy="{strategy}", devices=2)
        fabric.launch(lambda fabric: None)
    """), timeout=60)
    assert sorted(result.errors) == [0, 1]
    assert result.errors[0].ename == "LauncherInCellError"
    assert "Use strategy='ddp'" in result.errors[0].evalue
    # "ddp_spawn" makes a spawn-context queue before it launches: Python starts its resource
    # tracker for the queue's lock then. No worker process is ever started.
    gloo_ranks.run(NO_CHILDREN + "\nworkers = [c for c in new_children if 'resource_tracker' "
                   "not in ' '.join(psutil.Process(c).cmdline())]").raise_for_errors()
    assert gloo_ranks.pull("workers") == {0: [], 1: []}


def test_fsdp_runs_where_lightning_supports_it(ranks: Cluster, device: str) -> None:
    """Lightning's FSDP strategy needs CUDA (its own check, the same under torchrun); on GPUs it
    shards the model over the cluster's ranks."""
    result = ranks.run(textwrap.dedent("""
        fabric = L.Fabric(accelerator=ACCELERATOR, strategy="fsdp", devices=2)
        fabric.launch()
        with fabric.init_module():
            net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 1))
        model = fabric.setup_module(net)
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
        loss = torch.nn.functional.mse_loss(model(fabric.to_device(xs)), fabric.to_device(ys))
        fabric.backward(loss)
        opt.step()
        local = sum(q.numel() for q in model.parameters())
    """), timeout=120)
    if device == "cpu":
        assert result.errors[0].ename == "ValueError"
        assert "FSDP is only available on GPU" in result.errors[0].evalue
        return
    result.raise_for_errors()
    total = 8 * 64 + 64 + 64 + 1
    assert all(0 < local < total for local in ranks.pull("local").values())  # shards, not copies
