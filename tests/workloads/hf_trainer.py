# Hugging Face Trainer (DDP on CPU, gloo): a tiny GPT-2 built from a GPT2Config, causal-LM
# training on seeded random tokens, in the style of the transformers "Trainer" docs. Nothing is
# downloaded (no tokenizer, no pretrained weights). Run with
#   torchrun --standalone --nproc-per-node 2 hf_trainer.py [--steps 6] [--out DIR]
# Cells: setup, trainer.train() for --steps, trainer.train() again (a second epoch over the same
# data with the same model and optimizer) + losses file.
import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=6, help="optimizer steps per train() call")
parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--fsdp", default="", help='e.g. "full_shard" (on CPU accelerate runs DDP)')
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args, _ = parser.parse_known_args()

torch.set_num_threads(1)


class RandomTokens(torch.utils.data.Dataset):
    """Seeded random sequences; the labels are the inputs (the model shifts them)."""

    def __init__(self, n, length=16, vocab=96, seed=7):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab, (n, length), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


config = GPT2Config(
    vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
torch.manual_seed(0)  # same initial weights on every rank
model = GPT2LMHeadModel(config)

training_args = TrainingArguments(
    output_dir=os.path.join(args.out, "hf-trainer"),
    per_device_train_batch_size=args.batch,
    max_steps=args.steps,
    learning_rate=args.lr,
    lr_scheduler_type="constant",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    use_cpu=True,
    ddp_backend="gloo",
    fsdp=args.fsdp,
    seed=0,
)
world_size = training_args.world_size
trainer = Trainer(
    model=model, args=training_args,
    train_dataset=RandomTokens(args.steps * args.batch * world_size),
)
rank = training_args.process_index
losses = []


def train_more():
    """One trainer.train(); the loss it logged each step (averaged over the ranks)."""
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    losses.extend(logged)
    print(f"rank {rank} losses {logged[0]:.6f} .. {logged[-1]:.6f}", flush=True)


# %%
train_more()

# %%
train_more()

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"losses-rank{rank}.json"), "w") as f:
    json.dump(losses, f)
