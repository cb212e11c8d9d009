# A Lightning Fabric training loop (CPU, DDP), in the style of Lightning's "Convert to Fabric"
# guide: the plain PyTorch loop with fabric.launch / setup / setup_dataloaders / backward.
#   torchrun --standalone --nproc-per-node 2 lightning_fabric.py [--epochs 2] [--out DIR]
# Cells (`# %%`): setup, first epoch, second epoch + losses file.
import argparse
import json
import os

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args = parser.parse_args()

torch.set_num_threads(1)
fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
fabric.seed_everything(0)  # the same initial weights on every rank (DDP broadcasts them too)

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
model, optimizer = fabric.setup(model, optimizer)

# synthetic regression data, the same everywhere; Fabric's sampler gives each rank its half
data_gen = torch.Generator().manual_seed(1234)
true_w = torch.randn(16, 1, generator=data_gen)
X = torch.randn(10 * args.batch * fabric.world_size, 16, generator=data_gen)
Y = torch.tanh(X @ true_w) + 0.01 * torch.randn(X.shape[0], 1, generator=data_gen)
dataloader = fabric.setup_dataloaders(DataLoader(TensorDataset(X, Y), batch_size=args.batch))
losses = []


def train_epoch(epoch):
    model.train()
    for xb, yb in dataloader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        fabric.backward(loss)  # gradients are all-reduced (averaged) across ranks here
        optimizer.step()
        losses.append(loss.item())
    fabric.print(f"epoch {epoch} loss {loss.item():.6f}")


# %%
train_epoch(0)

# %%
for epoch in range(1, args.epochs):
    train_epoch(epoch)

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"losses-rank{fabric.global_rank}.json"), "w") as f:
    json.dump(losses, f)
