# DeepSpeed called directly: deepspeed.init_distributed() + deepspeed.initialize(config=...),
# ZeRO stage 2 or 3, fp32 on CPU (gloo). In the style of DeepSpeed's getting-started training loop
# (engine(x), engine.backward(loss), engine.step()); run with
#   torchrun --standalone --nproc-per-node 2 deepspeed_zero.py [--stage 2|3] [--out DIR]
# The optimizer is torch's AdamW handed to initialize(): a config "optimizer" section would load
# DeepSpeed's own fused Adam, a C++ op compiled on first use.
# Cells: setup, first half of the steps, second half + losses file.
import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--stage", type=int, default=2, choices=(2, 3))
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank = deepspeed.comm.get_rank()
world_size = deepspeed.comm.get_world_size()


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
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(n_blocks)))
        self.head = nn.Linear(dim, n_out)

    def forward(self, x):
        return self.head(self.blocks(x))


ds_config = {
    "train_micro_batch_size_per_gpu": args.batch,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": args.stage,
        "reduce_bucket_size": 50_000,
        # ZeRO-3: partition every parameter, however small (the default keeps small ones whole)
        "stage3_param_persistence_threshold": 0,
    },
    "steps_per_print": 10_000,
    "wall_clock_breakdown": False,
}

torch.manual_seed(0)  # same initial weights on every rank
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
assert engine.zero_optimization_stage() == args.stage
if args.stage == 3:  # each rank keeps only its partition of every weight (ds_tensor)
    params = list(engine.module.parameters())
    assert all(p.numel() == 0 and p.ds_tensor.numel() < p.ds_numel for p in params)

# synthetic classification data, one shard per rank
data_gen = torch.Generator().manual_seed(2024)
X = torch.randn(args.steps * args.batch * world_size, 32, generator=data_gen)
Y = (X[:, :4] * 3).argmax(dim=1)
X_local, Y_local = X[rank::world_size], Y[rank::world_size]
loss_fn = nn.CrossEntropyLoss()
losses = []


def train_step(step):
    xb = X_local[step * args.batch : (step + 1) * args.batch]
    yb = Y_local[step * args.batch : (step + 1) * args.batch]
    loss = loss_fn(engine(xb), yb)
    engine.backward(loss)  # ZeRO reduce-scatters the gradients here
    engine.step()
    losses.append(loss.item())
    if step % 4 == 0 or step == args.steps - 1:
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
engine.destroy()
deepspeed.comm.destroy_process_group()
