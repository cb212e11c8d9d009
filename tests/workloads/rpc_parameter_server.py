# Parameter server + DDP trainers over torch.distributed.rpc, in the style of
# PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework"
# tutorial: rank 0 = master, rank 1 = parameter server holding an EmbeddingBag
# (a RemoteModule), ranks 2.. = trainers whose dense layer is DDP over their own
# group. Distributed autograd + DistributedOptimizer update both. Run with
#   torchrun --standalone --nproc-per-node 4 rpc_parameter_server.py [--steps 12] [--out DIR]
#
# RPC rendezvous, as found in torch 2.13 (torch/distributed/rendezvous.py, rpc/__init__.py):
# * rpc.init_rpc with a world_size rendezvous through
#   rpc_backend_options.init_method (default "env://" = MASTER_ADDR:MASTER_PORT),
#   then wraps the store in PrefixStore("rpc_prefix_<n>"), n counting init_rpc calls
#   in this process (so a second init_rpc after rpc.shutdown() uses fresh keys).
# * Both env:// and tcp:// go through _create_c10d_store: if the environment has
#   TORCHELASTIC_USE_AGENT_STORE=True (torchrun sets it) EVERY rank only connects
#   as a client, assuming torchrun's agent hosts the TCPStore at that address. That
#   holds for MASTER_PORT only. Otherwise rank 0 hosts a new TCPStore there, which
#   fails (address in use) if that port already hosts the process group's store,
#   as it does once a process group was initialized with env:// by anyone but torchrun.
# * So, like the tutorial, RPC gets its own port (--rpc-port, default MASTER_PORT+1,
#   init_method tcp://MASTER_ADDR:port) and TORCHELASTIC_USE_AGENT_STORE is
#   cleared around init_rpc so that rank 0 hosts the RPC store itself. This works
#   under torchrun and inside an already-initialized process group alike.
# The functions run remotely (_run_trainer) are pickled by reference as
# __main__._run_trainer, so they must be defined in the __main__ namespace of
# every rank before the master calls them (the first cell).
import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS = 32
EMBEDDING_DIM = 16
NUM_CLASSES = 8

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.2)
parser.add_argument("--rpc-port", type=int, default=int(os.environ.get("MASTER_PORT", "29500")) + 1)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
dist.init_process_group(backend="gloo")
rank = dist.get_rank()
world_size = dist.get_world_size()
assert world_size >= 4, "needs a master, a parameter server and at least 2 trainers"
MASTER, PS = 0, 1
TRAINERS = list(range(2, world_size))
trainer_group = dist.new_group(TRAINERS)  # every rank must call new_group
torch.manual_seed(0)  # on the PS this fixes the embedding table's initial values
losses = []  # filled on the trainers (inside the RPC call from the master)


def worker_name(r):
    return "master" if r == MASTER else "ps" if r == PS else f"trainer{r}"


class HybridModel(nn.Module):
    """Remote sparse part (embedding on the PS) + local dense part replicated with DDP."""

    def __init__(self, remote_emb_module):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES), process_group=trainer_group)

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def get_batches(trainer_rank, steps):
    gen = torch.Generator().manual_seed(1000 + trainer_rank)
    for _ in range(steps):
        lengths = torch.randint(1, 3, (args.batch,), generator=gen)
        indices = torch.randint(0, NUM_EMBEDDINGS, (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        # a learnable target: the class is a function of the bag's first index
        target = indices[offsets] % NUM_CLASSES
        yield indices, offsets, target


def _run_trainer(remote_emb_module, trainer_rank):
    """Runs on a trainer (called by the master over RPC)."""
    torch.manual_seed(0)
    model = HybridModel(remote_emb_module)
    param_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        param_rrefs.append(RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    for step, (indices, offsets, target) in enumerate(get_batches(trainer_rank, args.steps)):
        with dist_autograd.context() as context_id:
            loss = criterion(model(indices, offsets), target)
            dist_autograd.backward(context_id, [loss])  # DDP all-reduces fc grads here
            # The trainers step one after the other, so the PS applies the two
            # embedding updates in a fixed order: losses are reproducible bit for bit.
            for turn in TRAINERS:
                if turn == trainer_rank:
                    opt.step(context_id)
                dist.barrier(group=trainer_group)
        losses.append(loss.item())
        if step % 4 == 0 or step == args.steps - 1:
            print(f"{worker_name(trainer_rank)} step {step} loss {loss.item():.6f}", flush=True)
    return len(losses)


@contextlib.contextmanager
def _without_agent_store():
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


# %%
master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
if master_addr in ("localhost", "127.0.0.1", "::1"):
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe: listen on loopback only
options = TensorPipeRpcBackendOptions(
    init_method=f"tcp://{master_addr}:{args.rpc_port}", rpc_timeout=120
)
with _without_agent_store():
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
print(f"rank {rank}: rpc up as {worker_name(rank)}", flush=True)

# %%
if rank == MASTER:
    remote_emb_module = RemoteModule(
        f"{worker_name(PS)}/cpu",
        nn.EmbeddingBag,
        args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
        kwargs={"mode": "sum"},
    )
    futs = [
        rpc.rpc_async(worker_name(t), _run_trainer, args=(remote_emb_module, t), timeout=0)
        for t in TRAINERS
    ]
    print("master: trainers ran", [f.wait() for f in futs], "steps", flush=True)

# %%
rpc.shutdown()  # graceful: waits until every worker is done (the master's futures)
if rank in TRAINERS:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"losses-rank{rank}.json"), "w") as f:
        json.dump(losses, f)
dist.destroy_process_group()
