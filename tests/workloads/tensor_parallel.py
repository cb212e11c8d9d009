# Tensor parallel (Colwise/Rowwise) MLP and a sequence-parallel variant on a
# 1-D DeviceMesh over CPU/gloo, in the style of PyTorch's TP tutorial. Run with
#   torchrun --standalone --nproc-per-node 2 tensor_parallel.py [--steps 10] [--out DIR]
# Losses file: the TP losses (steps) followed by the SP losses (steps); every rank
# records the same global loss. Each phase is also checked against a plain
# (unsharded) copy of the model trained on the same data.
import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=10, help="steps per phase")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=8, help="sequence length (divisible by world size)")
parser.add_argument("--dim", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.5)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
dist.init_process_group(backend="gloo")
rank = dist.get_rank()
world_size = dist.get_world_size()
mesh = init_device_mesh("cpu", (world_size,))


class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(self.norm(x))))


# identical data on every rank (TP ranks see the same batch)
data_gen = torch.Generator().manual_seed(99)
X = torch.randn(args.steps, args.batch, args.seq, args.dim, generator=data_gen)
A = torch.randn(args.dim, args.dim, generator=data_gen) / args.dim**0.5
Y = torch.tanh(X @ A)
loss_fn = nn.MSELoss()
losses = []


def check_close(name, step, got, ref):
    if abs(got - ref) > 1e-4 * max(1.0, abs(ref)):
        raise AssertionError(f"{name} step {step}: parallel loss {got} != reference {ref}")


# %%
# Phase 1: tensor parallel. w1 is split by output features, w2 by input features;
# the activations between them stay sharded, the output is all-reduced.
torch.manual_seed(0)
tp_model = FeedForward(args.dim)
ref_model = copy.deepcopy(tp_model)
parallelize_module(tp_model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
tp_opt = torch.optim.SGD(tp_model.parameters(), lr=args.lr)
ref_opt = torch.optim.SGD(ref_model.parameters(), lr=args.lr)

for step in range(args.steps):
    tp_opt.zero_grad()
    loss = loss_fn(tp_model(X[step]), Y[step])
    loss.backward()
    tp_opt.step()
    losses.append(loss.item())

    ref_opt.zero_grad()
    ref_loss = loss_fn(ref_model(X[step]), Y[step])
    ref_loss.backward()
    ref_opt.step()
    check_close("TP", step, loss.item(), ref_loss.item())
    if step % 3 == 0:
        print(f"rank {rank} TP step {step} loss {loss.item():.6f}", flush=True)

# %%
# Phase 2: sequence parallel. The LayerNorm runs on the local sequence shard
# (SequenceParallel), w1 all-gathers the sequence (input Shard(1)), w2
# reduce-scatters back to sequence shards (output Shard(1)).
torch.manual_seed(1)
sp_model = FeedForward(args.dim)
ref_model = copy.deepcopy(sp_model)
parallelize_module(
    sp_model,
    mesh,
    {
        "norm": SequenceParallel(sequence_dim=1),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    },
)
sp_opt = torch.optim.SGD(sp_model.parameters(), lr=args.lr)
ref_opt = torch.optim.SGD(ref_model.parameters(), lr=args.lr)
seq_chunk = args.seq // world_size
local = slice(rank * seq_chunk, (rank + 1) * seq_chunk)

for step in range(args.steps):
    sp_opt.zero_grad()
    out_local = sp_model(X[step][:, local])  # this rank's sequence shard in and out
    local_loss = loss_fn(out_local, Y[step][:, local])
    (local_loss / world_size).backward()  # grads of replicated params are summed over ranks
    sp_opt.step()
    global_loss = local_loss.detach().clone()
    dist.all_reduce(global_loss)
    global_loss /= world_size
    losses.append(global_loss.item())

    ref_opt.zero_grad()
    ref_loss = loss_fn(ref_model(X[step]), Y[step])
    ref_loss.backward()
    ref_opt.step()
    check_close("SP", step, global_loss.item(), ref_loss.item())
    if step % 3 == 0:
        print(f"rank {rank} SP step {step} loss {global_loss.item():.6f}", flush=True)

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"losses-rank{rank}.json"), "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()
