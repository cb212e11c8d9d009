# FSDP2 (fully_shard) + Adam, checkpointed with torch.distributed.checkpoint (DCP)
# and resumed into a fresh model/optimizer. Run with
#   torchrun --standalone --nproc-per-node 2 fsdp2_dcp.py [--steps 8] [--out DIR]
# Cells: setup, phase 1 (train + save), phase 2 (fresh model, load, train + losses file).
import argparse
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=8, help="steps per phase")
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--lr", type=float, default=5e-3)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
dist.init_process_group(backend="gloo")
rank = dist.get_rank()
world_size = dist.get_world_size()
ckpt_dir = os.path.join(args.out, "ckpt")


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim=32, n_blocks=2, n_out=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, n_out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(seed):
    """Model with per-block FSDP2 sharding plus the root, and its Adam optimizer."""
    torch.manual_seed(seed)  # same full weights on every rank before sharding
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    return model, optimizer


# synthetic classification data, one shard per rank
data_gen = torch.Generator().manual_seed(4321)
X = torch.randn(2 * args.steps * args.batch * world_size, 32, generator=data_gen)
Y = (X[:, :4] * 3).argmax(dim=1)
X_local, Y_local = X[rank::world_size], Y[rank::world_size]
loss_fn = nn.CrossEntropyLoss()
losses = []


def checksum(model, optimizer):
    """Sum of the full (unsharded) parameters and Adam moments: proves the reload."""
    total = 0.0
    for p in model.parameters():
        total += p.full_tensor().double().sum().item()
        st = optimizer.state.get(p, {})
        if "exp_avg" in st:
            total += st["exp_avg"].full_tensor().double().sum().item()
    return total


def train(model, optimizer, first_step, n_steps, phase):
    for step in range(first_step, first_step + n_steps):
        xb = X_local[step * args.batch : (step + 1) * args.batch]
        yb = Y_local[step * args.batch : (step + 1) * args.batch]
        optimizer.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 4 == 0:
            print(f"rank {rank} phase {phase} step {step} loss {loss.item():.6f}", flush=True)


# %%
model, optimizer = build(seed=0)
train(model, optimizer, 0, args.steps, phase=1)

if rank == 0 and os.path.isdir(ckpt_dir):
    shutil.rmtree(ckpt_dir)  # a stale checkpoint from an earlier run must not be mixed in
dist.barrier()
model_sd, optim_sd = get_state_dict(model, optimizer)
dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)
dist.barrier()
saved_checksum = checksum(model, optimizer)
if rank == 0:
    print(f"saved DCP checkpoint to {ckpt_dir}: {sorted(os.listdir(ckpt_dir))}", flush=True)

# %%
# a FRESH model and optimizer (different init seed), state restored from the checkpoint
del model, optimizer
model, optimizer = build(seed=1)
model_sd, optim_sd = get_state_dict(model, optimizer)
state = {"model": model_sd, "optim": optim_sd}
dcp.load(state, checkpoint_id=ckpt_dir)
set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
loaded_checksum = checksum(model, optimizer)
assert abs(loaded_checksum - saved_checksum) <= 1e-9 * max(1.0, abs(saved_checksum)), (
    f"reload mismatch: {loaded_checksum} != {saved_checksum}"
)
if rank == 0:
    print(f"reloaded from {ckpt_dir}, checksum {loaded_checksum:.6f} matches", flush=True)
train(model, optimizer, args.steps, args.steps, phase=2)

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"losses-rank{rank}.json"), "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()
