# A hand-written Hugging Face accelerate loop (CPU, gloo): a tiny BERT built from a BertConfig
# for sequence classification on seeded random tokens, prepared by Accelerator, with
# accelerator.backward and accelerator.gather_for_metrics for the accuracy, in the style of
# accelerate's nlp_example. Nothing is downloaded. Run with
#   torchrun --standalone --nproc-per-node 2 accelerate_loop.py [--steps 12] [--out DIR]
# Cells: setup, first half of the steps, second half + evaluation + losses file.
import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
accelerator = Accelerator(cpu=True)
set_seed(0)  # same initial weights on every rank

config = BertConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64, max_position_embeddings=16, num_labels=2,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)
model = BertForSequenceClassification(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def make_data(n, seed):
    """Random tokens; the label says whether token 5 occurs in the sequence."""
    tokens = torch.randint(64, (n, 12), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(tokens, (tokens == 5).any(dim=1).long())


world_size = accelerator.num_processes
train_set = make_data(args.steps * args.batch * world_size, seed=11)
train_loader = DataLoader(train_set, batch_size=args.batch)
eval_loader = DataLoader(make_data(4 * args.batch * world_size, seed=12), batch_size=args.batch)
# prepare() wraps the model in DDP and gives each rank its shard of each loader
model, optimizer, train_loader, eval_loader = accelerator.prepare(
    model, optimizer, train_loader, eval_loader
)
rank = accelerator.process_index
batches = iter(train_loader)
losses = []


def train_steps(n):
    model.train()
    for _ in range(n):
        input_ids, labels = next(batches)
        loss = model(input_ids=input_ids, labels=labels).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"step {len(losses)} loss {losses[-1]:.6f}")


# %%
train_steps(args.steps // 2)

# %%
train_steps(args.steps - args.steps // 2)

model.eval()
correct = total = 0
for input_ids, labels in eval_loader:
    with torch.no_grad():
        predictions = model(input_ids=input_ids).logits.argmax(dim=-1)
    predictions, labels = accelerator.gather_for_metrics((predictions, labels))
    correct += (predictions == labels).sum().item()
    total += labels.numel()
# every rank saw every rank's predictions: the same accuracy everywhere
accelerator.print(f"eval accuracy {correct / total:.3f} over {total} sequences")
all_losses = accelerator.gather(torch.tensor(losses)).view(world_size, -1)

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"losses-rank{rank}.json"), "w") as f:
    json.dump(losses, f)
with open(os.path.join(args.out, f"eval-rank{rank}.json"), "w") as f:
    json.dump({"accuracy": correct / total, "gathered_losses": all_losses.tolist()}, f)
accelerator.end_training()
