# minGPT-style Trainer with snapshots (PyTorch "DDP tutorial series",
# multigpu_torchrun.py): DDP + DistributedSampler, rank 0 saves
# {MODEL_STATE, OPTIMIZER_STATE, EPOCHS_RUN} to {out}/snapshot.pt every epoch, and
# a new invocation with the same --out resumes from it. Each invocation trains
# --epochs more epochs (epochs_run .. epochs_run+epochs-1). Run with
#   torchrun --standalone --nproc-per-node 2 trainer_snapshot.py [--epochs 2] [--out DIR]
# (use a fresh --out to start from scratch). Writes losses-rank{r}.json (every
# step of this invocation) and epochs-rank{r}.json (the epoch of each of those steps).
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--epochs", type=int, default=2, help="epochs to train in this invocation")
parser.add_argument("--steps", type=int, default=8, help="steps per epoch per rank")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--save-every", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
dist.init_process_group(backend="gloo")
rank = dist.get_rank()
world_size = dist.get_world_size()
os.makedirs(args.out, exist_ok=True)
snapshot_path = os.path.join(args.out, "snapshot.pt")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.global_rank = dist.get_rank()
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.history = []  # (epoch, loss) for every step of this invocation
        if os.path.exists(snapshot_path):
            print(f"rank {self.global_rank}: loading snapshot {snapshot_path}", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"rank {self.global_rank}: resuming training at epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,  # epochs completed
        }
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"epoch {epoch}: snapshot saved at {self.snapshot_path}", flush=True)

    def _run_batch(self, source, targets, epoch):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.history.append((epoch, loss.item()))
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            last = self._run_batch(source, targets, epoch)
        print(
            f"rank {self.global_rank} epoch {epoch} steps {len(self.train_data)} last loss {last:.6f}",
            flush=True,
        )

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)
            dist.barrier()  # the snapshot is complete before anyone goes on
        self.epochs_run = max(self.epochs_run, max_epochs)


def load_train_objs():
    gen = torch.Generator().manual_seed(2024)
    n = args.steps * args.batch * world_size
    x = torch.randn(n, 20, generator=gen)
    w = torch.randn(20, 5, generator=gen)
    y = (x @ w).argmax(dim=1)
    train_set = TensorDataset(x, y)
    torch.manual_seed(0)  # same initial weights on every rank
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        sampler=DistributedSampler(dataset, shuffle=True, seed=7),
    )


# %%
dataset, model, optimizer = load_train_objs()
train_data = prepare_dataloader(dataset, args.batch)
trainer = Trainer(model, train_data, optimizer, args.save_every, snapshot_path)
start_epoch = trainer.epochs_run

# %%
trainer.train(start_epoch + args.epochs)

# %%
with open(os.path.join(args.out, f"losses-rank{rank}.json"), "w") as f:
    json.dump([loss for _, loss in trainer.history], f)
with open(os.path.join(args.out, f"epochs-rank{rank}.json"), "w") as f:
    json.dump([epoch for epoch, _ in trainer.history], f)
print(f"rank {rank}: trained epochs {start_epoch}..{trainer.epochs_run - 1}", flush=True)
dist.destroy_process_group()
