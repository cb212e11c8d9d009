# Data-parallel MLP regression under DistributedDataParallel (gloo, CPU).
# In the style of the PyTorch "Getting Started with DDP" tutorial; run with
#   torchrun --standalone --nproc-per-node 2 ddp.py [--steps 20] [--out DIR]
# Cells (`# %%`): setup, first half of the steps, second half + losses file.
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
dist.init_process_group(backend="gloo")
rank = dist.get_rank()
world_size = dist.get_world_size()

torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
ddp_model = DDP(model)
optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr)
loss_fn = nn.MSELoss()

# synthetic regression data: the same "dataset" everywhere, each rank takes its own shard
data_gen = torch.Generator().manual_seed(1234)
true_w = torch.randn(16, 1, generator=data_gen)
X = torch.randn(args.steps * args.batch * world_size, 16, generator=data_gen)
Y = torch.tanh(X @ true_w) + 0.01 * torch.randn(X.shape[0], 1, generator=data_gen)
X_local, Y_local = X[rank::world_size], Y[rank::world_size]
losses = []


def train_step(step):
    xb = X_local[step * args.batch : (step + 1) * args.batch]
    yb = Y_local[step * args.batch : (step + 1) * args.batch]
    optimizer.zero_grad()
    loss = loss_fn(ddp_model(xb), yb)
    loss.backward()  # gradients are all-reduced (averaged) across ranks here
    optimizer.step()
    losses.append(loss.item())
    if step % 5 == 0 or step == args.steps - 1:
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)


# %%
half = args.steps // 2
for step in range(half):
    train_step(step)

# %%
for step in range(half, args.steps):
    train_step(step)

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"losses-rank{rank}.json"), "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()
